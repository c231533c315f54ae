"""Adversarial test tools: a store wrapper that pauses, fails or loses the reply of one chosen call.

:class:`AdversaryStore` wraps any :class:`~celery_lease.LockStore` and forwards every call to it.
A test arms a :class:`Trap` for one chosen call, picked by method name and ordinal (the n-th call
of that method from the moment the trap is armed) and optionally a predicate on the arguments;
when that call arrives, the trap does one of:

- ``delay="before"``: block the call on the trap's gate *before* the inner store sees it (a
  request slow on the wire: it takes effect only when the test opens the gate);
- ``delay="after"``: let the inner call take effect, then block before returning (a reply slow
  on the wire: the effect is on the server, the caller does not know yet);
- ``fail=True``: raise :class:`~celery_lease.StoreUnavailableError` without calling the inner
  store (the request never arrived);
- ``lose_reply=True``: call the inner store (the effect happens), then raise
  ``StoreUnavailableError`` (the reply was lost after the server committed).

A delay combines with ``fail`` or ``lose_reply`` (pause, then fail). Each trap fires once.
Traps are fired in the caller's thread, so ``trap.entered`` tells the test that the renewer (or
whoever made the call) has reached the chosen point, and ``trap.open()`` lets it go on::

    store = AdversaryStore(MemoryLockStore(clock=clock))
    trap = store.trap("renew", delay="before")      # the next renewal pauses before its effect
    with lease("k", store=store, ttl=0.6, clock=clock, cooldown="1h"):
        clock.advance(0.2)
        trap.wait_entered()                         # the renewer is now "on the wire"
    ...                                             # the body exited meanwhile
    trap.open()                                     # the renewal lands late
    trap.wait_done()

The wrapper has ``renew_many`` (:class:`~celery_lease.SupportsBatchRenew`),
``wait_for_release`` (:class:`~celery_lease.SupportsReleaseNotify`) and ``list``/``get``/
``last_token``/``force_release`` (:class:`~celery_lease.SupportsInspection`) only when the inner
store has them, so code that detects capabilities with ``isinstance`` sees the inner store's
shape. The renewer uses ``renew_many`` for a group of two or more leases of one store, so a trap
on ``"renew"`` does not see those: trap ``"renew_many"`` then. Every call is recorded in
:attr:`AdversaryStore.history` as ``(method, args, outcome)``, outcome being ``"ok"``,
``"failed"``, ``"lost_reply"`` or ``"error"`` (the inner store raised).

A gate that is never opened lets the call go on after :data:`GATE_TIMEOUT` real seconds and
marks the trap ``timed_out``, so a broken test fails instead of hanging.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal

from celery_lease import StoreUnavailableError
from celery_lease.stores.base import (
    LeaseInfo,
    LockStore,
    SupportsBatchRenew,
    SupportsInspection,
    SupportsReleaseNotify,
)

__all__ = ["GATE_TIMEOUT", "AdversaryStore", "Trap"]

GATE_TIMEOUT = 10.0
"""Real seconds a trapped call waits for its gate before going on by itself."""


class Trap:
    """One armed fault: which call it catches and what it does to it (see the module docstring).

    Attributes:
        entered: set when the chosen call reached the trap (before any delay).
        done: set when the chosen call returned or raised.
        gate: what a delayed call waits on; :meth:`open` sets it.
        args: the arguments of the caught call, once caught.
        timed_out: True if the gate was never opened and the call went on by itself.
    """

    def __init__(
        self,
        method: str,
        *,
        nth: int,
        match: Callable[..., bool] | None,
        delay: Literal["before", "after"] | None,
        fail: bool,
        lose_reply: bool,
    ) -> None:
        if nth < 1:
            raise ValueError(f"nth={nth!r} must be >= 1 (the first matching call is 1)")
        if delay not in (None, "before", "after"):
            raise ValueError(f"delay={delay!r} must be 'before', 'after' or None")
        if fail and lose_reply:
            raise ValueError("fail=True and lose_reply=True exclude each other")
        if delay == "after" and fail:
            raise ValueError("delay='after' with fail=True: a failed call has no 'after'")
        self.method = method
        self.nth = nth
        self.match = match
        self.delay = delay
        self.fail = fail
        self.lose_reply = lose_reply
        self.entered = threading.Event()
        self.done = threading.Event()
        self.gate = threading.Event()
        self.args: tuple[Any, ...] | None = None
        self.timed_out = False
        self._seen = 0

    def _catches(self, method: str, args: tuple[Any, ...]) -> bool:
        """Whether this call is the chosen one; counts matching calls. Under the store's lock."""
        if self.args is not None or method != self.method:
            return False
        if self.match is not None and not self.match(*args):
            return False
        self._seen += 1
        return self._seen == self.nth

    def open(self) -> None:
        """Let the delayed call go on."""
        self.gate.set()

    def _pause(self) -> None:
        if not self.gate.wait(GATE_TIMEOUT):
            self.timed_out = True

    def wait_entered(self, timeout: float = GATE_TIMEOUT) -> None:
        """Block (real time) until the chosen call reached the trap; AssertionError if not."""
        if not self.entered.wait(timeout):
            raise AssertionError(f"no {self.method}() call reached the trap in {timeout} s")

    def wait_done(self, timeout: float = GATE_TIMEOUT) -> None:
        """Block (real time) until the chosen call returned or raised; AssertionError if not."""
        if not self.done.wait(timeout):
            raise AssertionError(f"the trapped {self.method}() call did not end in {timeout} s")

    def __repr__(self) -> str:
        what = f"delay={self.delay} fail={self.fail} lose_reply={self.lose_reply}"
        return f"<Trap {self.method} #{self.nth} {what}>"


class AdversaryStore:
    """Wraps ``inner`` (a LockStore); forwards every call, except the ones a :class:`Trap` catches.

    Args:
        inner: the store to wrap; the wrapper has its optional capabilities and no others.
    """

    _classes: dict[tuple[bool, bool, bool], type[AdversaryStore]] = {}

    def __new__(cls, inner: LockStore) -> AdversaryStore:
        shape = (
            isinstance(inner, SupportsBatchRenew),
            isinstance(inner, SupportsReleaseNotify),
            isinstance(inner, SupportsInspection),
        )
        sub = cls._classes.get(shape)
        if sub is None:
            bases = tuple(
                mixin
                for mixin, present in zip(
                    (_BatchRenew, _ReleaseNotify, _Inspection), shape, strict=True
                )
                if present
            )
            sub = type(
                f"AdversaryStore[{''.join('BRI'[i] for i, p in enumerate(shape) if p)}]",
                (*bases, cls),
                {},
            )
            cls._classes[shape] = sub
        return object.__new__(sub)

    def __init__(self, inner: LockStore) -> None:
        self.inner: Any = inner
        self.history: list[tuple[str, tuple[Any, ...], str]] = []
        self._traps: list[Trap] = []
        self._lock = threading.Lock()

    def trap(
        self,
        method: str,
        *,
        nth: int = 1,
        match: Callable[..., bool] | None = None,
        delay: Literal["before", "after"] | None = None,
        fail: bool = False,
        lose_reply: bool = False,
    ) -> Trap:
        """Arm a trap for the ``nth`` call of ``method`` (whose arguments satisfy ``match``).

        Args:
            method: ``"acquire"``, ``"renew"``, ``"release"``, ``"renew_many"``, ...
            nth: which matching call, counted from now (1: the next one).
            match: called with the call's positional arguments; only calls it accepts count.
            delay: pause ``"before"`` or ``"after"`` the inner call, until :meth:`Trap.open`.
            fail: raise ``StoreUnavailableError`` instead of calling the inner store.
            lose_reply: call the inner store, then raise ``StoreUnavailableError``.
        """
        if not callable(getattr(self.inner, method, None)):
            raise ValueError(f"method={method!r}: {self.inner!r} has no such method")
        trap = Trap(method, nth=nth, match=match, delay=delay, fail=fail, lose_reply=lose_reply)
        with self._lock:
            self._traps.append(trap)
        return trap

    def calls(self, method: str) -> list[tuple[Any, ...]]:
        """The arguments of every call of ``method`` so far, in order."""
        with self._lock:
            return [args for name, args, _ in self.history if name == method]

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            trap = next((t for t in self._traps if t._catches(method, args)), None)
            if trap is not None:
                trap.args = args
                self._traps.remove(trap)
        fn = getattr(self.inner, method)
        if trap is None:
            return self._forward(method, fn, args, "ok")
        trap.entered.set()
        try:
            if trap.delay == "before":
                trap._pause()
            if trap.fail:
                self._note(method, args, "failed")
                raise StoreUnavailableError(f"adversary: {method}{args!r} failed before its effect")
            result = self._forward(method, fn, args, "lost_reply" if trap.lose_reply else "ok")
            if trap.delay == "after":
                trap._pause()
            if trap.lose_reply:
                raise StoreUnavailableError(
                    f"adversary: reply of {method}{args!r} lost after effect"
                )
            return result
        finally:
            trap.done.set()

    def _forward(
        self, method: str, fn: Callable[..., Any], args: tuple[Any, ...], outcome: str
    ) -> Any:
        try:
            result = fn(*args)
        except BaseException:
            self._note(method, args, "error")
            raise
        self._note(method, args, outcome)
        return result

    def _note(self, method: str, args: tuple[Any, ...], outcome: str) -> None:
        with self._lock:
            self.history.append((method, args, outcome))

    # The LockStore protocol ------------------------------------------------------------------

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        result: int | None = self._call("acquire", key, owner, ttl_ms)
        return result

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        return bool(self._call("renew", key, owner, ttl_ms))

    def release(self, key: str, owner: str) -> None:
        self._call("release", key, owner)

    def __repr__(self) -> str:
        return f"AdversaryStore({self.inner!r})"


class _BatchRenew:
    def renew_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        result: list[bool] = self._call("renew_many", list(items))  # type: ignore[attr-defined]
        return result


class _ReleaseNotify:
    def wait_for_release(self, key: str, timeout: float) -> bool:
        return bool(self._call("wait_for_release", key, timeout))  # type: ignore[attr-defined]


class _Inspection:
    def list(self, prefix: str = "") -> list[LeaseInfo]:
        result: list[LeaseInfo] = self._call("list", prefix)  # type: ignore[attr-defined]
        return result

    def get(self, key: str) -> LeaseInfo | None:
        result: LeaseInfo | None = self._call("get", key)  # type: ignore[attr-defined]
        return result

    def last_token(self, key: str) -> int | None:
        result: int | None = self._call("last_token", key)  # type: ignore[attr-defined]
        return result

    def force_release(self, key: str) -> LeaseInfo | None:
        result: LeaseInfo | None = self._call("force_release", key)  # type: ignore[attr-defined]
        return result
