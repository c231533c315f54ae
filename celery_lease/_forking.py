"""One registry of what each process resets after ``fork()`` and when a pool process starts.

The only module that calls ``os.register_at_fork``; standard library only. A fork that skips
Python's hooks is noticed by :func:`generation` through ``os.getpid()``. Order, weak references
and the table of resets: docs/internals.md ("What a fork resets").
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
            # removed when the instance dies: one C call, and the runners iterate over a copy
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
    """Run ``callback()`` in the child after every ``os.fork()``, after those registered before;
    ``name`` (``"module: what"``) is logged if it raises. A bound method is held weakly."""
    _add(_after_in_child, callback, name)


def on_fork_parent(*, name: str, before: Reset, after: Reset) -> None:
    """Run ``before()`` in the parent just before every ``os.fork()`` (in reverse registration
    order), ``after()`` once it returned (even when ``before`` raised)."""
    _add(_before, before, name)
    _add(_after_in_parent, after, name)


def on_new_process(callback: Reset, *, name: str) -> None:
    """Run ``callback()`` from :func:`reset_child_state` (not at ``os.fork()``), after those
    registered before. Other threads may run: forget caches, under their locks."""
    _add(_new_process, callback, name)


def reset_child_state() -> None:
    """Run every :func:`on_new_process` reset now, in registration order (a pool process at
    ``worker_process_init``). A reset that raises an :class:`Exception` is logged."""
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
"""``(pid, fork generation)`` as last seen; replaced whole, so readers never see a mix."""

_noticing = threading.RLock()
"""Held while a hookless fork's resets run (others wait); re-entrant for a reset that asks."""

_resetting: int | None = None
"""The pid whose resets :func:`_notice_fork` is running (asked again from a reset: the answer)."""


def generation() -> int:
    """This process's fork generation: 0 where celery-lease was imported, +1 per fork, to
    compare with the value recorded with a per-process state. On a pid change (a fork without
    hooks) it first runs every :func:`on_fork_child` reset in this thread."""
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
