"""One registry of what each process resets after ``fork()`` and when a pool process starts.

Every module of celery-lease that holds per-process state (locks, threads' bookkeeping, caches of
connections or stores) registers its reset here, and this is the only module that calls
``os.register_at_fork``: one hook for the whole registry, installed when this module is imported.
Standard library only, so that anything (the core, the stores, the Celery layer) may depend on it.

A fork that skips Python's at-fork hooks (uWSGI's default with the application loaded in the
master, any ``fork()`` made by C code) runs none of them. :func:`generation` notices such a fork
by the change of ``os.getpid()`` and runs the child resets then, in the child, at the first call
that asks (see there). Whatever decides identity or ownership (owner ids, whether a lease is this
process's) asks :func:`generation`, so it never trusts the hook alone.

Four moments, each with its own list, each run in registration order unless said otherwise:

- :func:`on_fork_parent` ``before``: in the parent, just before ``os.fork()``, in *reverse*
  registration order (as ``os.register_at_fork`` runs ``before`` hooks: the last registered
  prepares first, like nested ``with`` blocks);
- :func:`on_fork_parent` ``after``: in the parent, once ``os.fork()`` returned;
- :func:`on_fork_child`: in the child, once ``os.fork()`` returned. Only the forking thread exists
  there, so a reset may replace a lock that another thread of the parent held at the fork;
- :func:`on_new_process`: run by :func:`reset_child_state`, which the Celery layer calls when a pool
  process starts (``worker_process_init``: after the fork in a prefork child, and in the main
  process itself under solo). Other threads may be running then, so such a reset only forgets
  caches, under their own locks; it never replaces a lock or bumps a fork generation.

Modules register at import, so the order of the resets is the order in which celery-lease's modules
are imported (:mod:`celery_lease._core.dispatch` before :mod:`celery_lease._core.renewer`, for
instance).

A reset that raises is logged with this module's logger and the next one runs. In the fork hooks
any exception is caught (``os.register_at_fork`` itself swallows them, there is no caller to tell);
:func:`reset_child_state` catches :class:`Exception` only, so an interrupt still reaches its caller.

A bound method is held through a weak reference: registering ``store._reset`` does not keep
``store`` alive, and its entry goes away with it. Any other callable (a function, a closure, a
``functools.partial``) is held strongly, with whatever it refers to.

The threads, locks and fork resets this module takes part in: ``docs/internals.md``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
import weakref
from collections.abc import Callable

__all__ = [
    "generation",
    "on_fork_child",
    "on_fork_parent",
    "on_new_process",
    "reset_child_state",
]

logger = logging.getLogger("celery_lease.forking")

Reset = Callable[[], object]


class _Entry:
    """One registered reset; compared by identity (``list.remove`` of a dead one)."""

    __slots__ = ("_strong", "_weak", "name")

    def __init__(self, name: str, callback: Reset, entries: list[_Entry]) -> None:
        self.name = name
        self._strong: Reset | None = None
        self._weak: weakref.WeakMethod[Reset] | None = None
        if inspect.ismethod(callback):
            # Out of the list once the instance dies: list.remove is one C call under the GIL,
            # and the runners iterate over a copy, so this may happen at any moment.
            self._weak = weakref.WeakMethod(callback, lambda _: _discard(entries, self))
        else:
            self._strong = callback

    def callback(self) -> Reset | None:
        """The callback, or None once the instance of a bound method is gone."""
        return self._strong if self._weak is None else self._weak()


_before: list[_Entry] = []
_after_in_parent: list[_Entry] = []
_after_in_child: list[_Entry] = []
_new_process: list[_Entry] = []


def _add(entries: list[_Entry], callback: Reset, name: str) -> None:
    if not callable(callback):
        raise TypeError(f"{name}: {callback!r} is not callable")
    if not isinstance(name, str) or not name:
        raise ValueError(f"name={name!r} must be a non-empty string")
    entries.append(_Entry(name, callback, entries))


def _discard(entries: list[_Entry], entry: _Entry) -> None:
    with contextlib.suppress(ValueError):  # already removed
        entries.remove(entry)


def on_fork_child(callback: Reset, *, name: str) -> None:
    """Run ``callback()`` in the child after every ``os.fork()``, after those registered before.

    Args:
        callback: takes no argument; what it returns is ignored. A bound method is held weakly.
        name: what the callback resets, for the log line when it raises (``"module: what"``).
    """
    _add(_after_in_child, callback, name)


def on_fork_parent(*, name: str, before: Reset, after: Reset) -> None:
    """Run ``before()`` in the parent just before every ``os.fork()``, ``after()`` once it returned.

    ``before`` callbacks run in reverse registration order, ``after`` ones in registration order
    (``after`` runs even when ``before`` raised: it undoes what ``before`` did, if anything).
    """
    _add(_before, before, name)
    _add(_after_in_parent, after, name)


def on_new_process(callback: Reset, *, name: str) -> None:
    """Run ``callback()`` from :func:`reset_child_state`, after those registered before.

    Not run by ``os.fork()`` itself: register with :func:`on_fork_child` too for that. The callback
    runs in a live process (other threads may run): it forgets caches, under their locks.
    """
    _add(_new_process, callback, name)


def reset_child_state() -> None:
    """Run every :func:`on_new_process` reset now, in registration order.

    For a pool process when it starts (Celery's ``worker_process_init``), whether or not it was
    forked with Python's at-fork hooks. A reset that raises an :class:`Exception` is logged and
    the next one runs.
    """
    for entry in tuple(_new_process):
        callback = entry.callback()
        if callback is None:
            continue
        try:
            callback()
        except Exception:
            logger.exception("celery-lease: the process reset %r failed", entry.name)


def _run_fork_hooks(entries: tuple[_Entry, ...], when: str) -> None:
    for entry in entries:
        callback = entry.callback()
        if callback is None:
            continue
        try:
            callback()
        except BaseException:  # as os.register_at_fork: nothing to raise to, the next one runs
            logger.exception("celery-lease: the %s hook %r failed", when, entry.name)


def _run_before() -> None:
    _run_fork_hooks(tuple(_before)[::-1], "before-fork")


def _run_after_in_parent() -> None:
    _run_fork_hooks(tuple(_after_in_parent), "after-fork (parent)")


def _run_after_in_child() -> None:
    global _process, _noticing
    _process = (os.getpid(), _process[1] + 1)
    _noticing = threading.RLock()  # a thread of the parent may have held it at the fork
    _run_fork_hooks(tuple(_after_in_child), "after-fork (child)")


_process: tuple[int, int] = (os.getpid(), 0)
"""``(pid, fork generation)`` of this process as last seen: one tuple, replaced whole, so that
threads reading it never see the pid of one generation with the number of another."""

_noticing = threading.RLock()
"""Held while a fork that skipped the hooks is noticed: other threads of the child wait for its
resets. Re-entrant, for a reset that asks :func:`generation` itself."""

_resetting: int | None = None
"""The pid whose resets :func:`_notice_fork` is running (asked again from a reset: the answer)."""


def generation() -> int:
    """This process's fork generation: 0 in the process that imported celery-lease, one more in
    each forked child than in its parent.

    Compare it with the value recorded when a per-process state was made (an owner-id generator,
    a lease, a registry) to tell whether that state is this process's. Counted by the after-fork
    hook, and, for a fork that skipped Python's at-fork hooks, by this call: it compares
    ``os.getpid()`` (one system call, about 0.1-0.2 microseconds) with the pid it last saw, and
    on a change runs every :func:`on_fork_child` reset, in this thread, before it returns (other
    threads of the child asking meanwhile wait for them). Such a reset then runs in a live
    process, later than the fork: it is safe as long as no thread of the child used that state
    before the first call here (every path of celery-lease that acquires, renews or reads a
    lease asks first; a store's own calls compare the pid themselves).
    """
    pid = os.getpid()
    known = _process
    if known[0] == pid:
        return known[1]
    return _notice_fork(pid)


def _notice_fork(pid: int) -> int:
    """This process (``pid``) was forked without the hooks: run the child resets, once."""
    global _process, _resetting
    with _noticing:
        known = _process
        if known[0] == pid:  # another thread of the child noticed first
            return known[1]
        if _resetting == pid:  # a reset of this very notice asks
            return known[1] + 1
        _resetting = pid
        try:
            _run_fork_hooks(tuple(_after_in_child), "after-fork (child, forked without hooks)")
        finally:
            _process = (pid, known[1] + 1)
            _resetting = None
        return known[1] + 1


if hasattr(os, "register_at_fork"):  # pragma: no branch - absent on Windows only
    os.register_at_fork(
        before=_run_before,
        after_in_parent=_run_after_in_parent,
        after_in_child=_run_after_in_child,
    )
