"""A locked task's definition as its executions read it: the validated options, the key function,
and what they resolve to under the app's settings (``ttl`` / ``wait``, the store and its clock),
kept between executions while nothing it was resolved from changed. Built once per task class
or decorated body."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from celery_lease._celery.settings import (
    BUILTIN_TTL,
    BUILTIN_WAIT,
    LeaseSettings,
    changes,
    get_settings,
    pick,
)
from celery_lease._celery.store_resolution import execution_store, store_for
from celery_lease._core.keys import KeyFunction
from celery_lease._core.lease import check_ttl, clock_of
from celery_lease._core.options import LockOptions

if TYPE_CHECKING:
    from celery_lease._celery.protocols import CeleryApp
    from celery_lease.clock import Clock
    from celery_lease.stores.base import LockStore

# Where a ``LockedTask`` class or a ``@locked`` body carries its validated :class:`LockOptions`.
OPTIONS_ATTRIBUTE = "_lock_options"


def options_of(carrier: object) -> LockOptions | None:
    """The lock options a task class or ``@locked`` body carries, or None."""
    options = getattr(carrier, OPTIONS_ATTRIBUTE, None)
    return options if isinstance(options, LockOptions) else None


class Resolved:
    """What an execution of a :class:`Spec` resolved from its app: the app's settings, the
    execution's store and the clock its leases run on, ``ttl`` and ``wait`` in seconds; and what
    tells whether it still holds (:meth:`Spec.kept`)."""

    __slots__ = (
        "_app",
        "_changes",
        "_conf",
        "_own_clock",
        "clock",
        "settings",
        "store",
        "ttl",
        "wait",
    )

    def __init__(
        self,
        settings: LeaseSettings,
        store: LockStore,
        clock: Clock,
        ttl: float,
        wait: float,
        resolved_for: tuple[Callable[[], object], Callable[[], object], int, object],
    ) -> None:
        self.settings = settings
        self.store = store
        self.clock = clock
        self.ttl = ttl
        self.wait = wait
        # The app and its ``app.conf``, settings.changes() and the store's ``clock`` attribute
        # as they were before it was resolved.
        self._app, self._conf, self._changes, self._own_clock = resolved_for


@dataclass(frozen=True)
class Spec:
    """``limit``: the task's limit option as its executions call it (an int, a callable taking
    the body's arguments, or ``None``: the key itself, no slots); ``plain_key``: the key is
    built from the arguments alone (a template or the default digest, no validation)."""

    options: LockOptions
    key_function: KeyFunction
    limit: int | Callable[..., int] | None = None
    # Whether the key is a template's or the default digest of the arguments as received (no
    # key callable, no validation): building it runs no user code.
    plain_key: bool = False
    _durations: list[tuple[object, float, float]] = field(
        default_factory=lambda: [(None, 0.0, 0.0)], compare=False, repr=False
    )
    _resolved: list[Resolved | None] = field(
        default_factory=lambda: [None], compare=False, repr=False
    )

    def durations(self, settings: LeaseSettings) -> tuple[float, float]:
        """``(ttl, wait)`` in seconds, worked out and checked once per settings object."""
        read, ttl, wait = self._durations[0]
        if read is settings:
            return ttl, wait
        options = self.options
        ttl = pick(options.ttl, settings.default_ttl, BUILTIN_TTL)
        wait = pick(options.wait, settings.default_wait, BUILTIN_WAIT)
        check_ttl(ttl, ttl, name="ttl")  # as lease() checks it: lease_default_ttl may be too short
        self._durations[0] = (settings, ttl, wait)
        return ttl, wait

    def kept(self, app: CeleryApp) -> Resolved | None:
        """What :meth:`resolve` kept for ``app``, if it is still what resolving again would give:
        the same ``app.conf`` object, no :func:`~celery_lease._celery.settings.changes` since
        (settings read again, a refusal, a store built or forgotten, a fork) and the same
        ``clock`` attribute of the store; else ``None``. Asked once, at the start of an
        execution: a change its own key or limit function makes applies from the next one."""
        kept = self._resolved[0]
        if (
            kept is None
            or kept._app() is not app
            or kept._conf() is not app.conf
            or kept._changes != changes()
        ):
            return None
        try:
            if getattr(kept.store, "clock", None) is kept._own_clock:
                return kept
        except Exception:  # clock_of ignores such a clock (and warns once): resolved again
            pass
        return None

    def resolve(self, app: CeleryApp, settings: LeaseSettings, key: str) -> Resolved:
        """``ttl`` and ``wait`` (:meth:`durations`), the execution's store
        (:func:`~celery_lease._celery.store_resolution.execution_store`, which raises for a
        non-store as ``lease()`` does) and its clock (:func:`clock_of`) under ``settings``,
        ``app``'s; kept for the next execution unless a change may have come between."""
        number = changes()  # first: a change from here on makes what is kept stale
        conf = app.conf
        ttl, wait = self.durations(settings)
        option = self.options.store
        store = execution_store(option, app, key, settings)
        clock = clock_of(store)  # the store's own clock (a FakeClock under the pytest fixtures)
        try:
            own_clock = getattr(store, "clock", None)
            refs = (weakref.ref(app), weakref.ref(conf))
            current = get_settings(app)
        except Exception:  # a clock that raises, no weak reference, a refusal now: not kept
            return Resolved(settings, store, clock, ttl, wait, _NOT_KEPT)
        resolved = Resolved(settings, store, clock, ttl, wait, (*refs, number, own_clock))
        # Kept only for a synchronous store (an async one's ``.sync`` is read every time) and
        # settings still current after the number was read (a reset in between is seen).
        if current is settings and store is store_for(option, app, settings):
            self._resolved[0] = resolved
        return resolved


def _no_spec(task: object) -> Spec | None:
    """No task class registered: no task's calls are known to reach the engine."""
    return None


# ``task`` -> its Spec when every started call of it reaches the engine's ``run_locked`` (a
# LockedTask whose ``__call__`` is LockedTask's), else None: registered by the task module
# (:func:`register_spec_of_task`), which the modules under it cannot import.
spec_of_task: Callable[[object], Spec | None] = _no_spec


def register_spec_of_task(source: Callable[[object], Spec | None]) -> None:
    """Make ``source`` what :data:`spec_of_task` calls (the task module, when imported)."""
    global spec_of_task
    spec_of_task = source


def _gone() -> None:
    """A dead reference."""
    return None


_NOT_KEPT = (_gone, _gone, -1, None)  # what a Resolved that is not kept was resolved for
