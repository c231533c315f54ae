"""The SQLite store's connections in one process, and how they cross ``fork()``.

A child must never copy SQLite's per-process records of a file (its locks, its shared-memory
map) while they are in use or half torn down: its own connections would then hold no lock on the
file, or find it locked for ever. Every SQLite call of a store, opening and closing its
connection included, runs under its :class:`Connection`'s lock. The before-fork hook takes
:data:`_CREATING` (no new :class:`Connection` until the child exists), then each
:class:`Connection`'s lock (waiting for a call in flight), closes its connection and keeps both
until ``fork()`` returned.

A :class:`Connection` with an open connection is held strongly (:data:`_OPEN`), so it stays in
:data:`_ALL` even when its store is being collected by the garbage collector (which clears weak
references before it runs ``__del__``). Threads, locks and fork resets: docs/internals.md.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import weakref
from collections.abc import Callable
from contextlib import suppress

from celery_lease import _forking as forking
from celery_lease.errors import StoreUnavailableError

logger = logging.getLogger("celery_lease.stores.sqlite")

_CREATING = threading.RLock()
"""Held while a :class:`Connection` joins :data:`_ALL`, and by the before-fork hook across
``fork()``. Never taken while holding a :class:`Connection`'s lock."""

_ALL: weakref.WeakSet[Connection] = weakref.WeakSet()
"""Every store's :class:`Connection` in this process."""

_OPEN: dict[int, Connection] = {}
"""Each :class:`Connection` whose connection is open, by ``id``: kept alive until closed."""

_INHERITED: list[sqlite3.Connection | sqlite3.Cursor] = []
"""Connections inherited through ``fork()`` that could not be closed before it: kept alive and
never used or closed in the child (the parent may hold SQLite's mutexes on them)."""

_HELD_ACROSS_FORK: list[threading.Lock] = []
"""The locks of :class:`Connection` objects the before-fork hook took, released in the parent
once the child exists."""

_holds_creating = False
"""Whether the before-fork hook holds :data:`_CREATING` (released in the parent after fork)."""

_hook_thread: int | None = None
"""The thread running the fork hooks, from the before-fork hook until ``fork()`` returned."""


def refuse_in_fork_hooks(path: str) -> None:
    """Raise :class:`StoreUnavailableError` when called by the thread running the fork hooks
    (another before-fork hook, or a ``__del__`` the garbage collector runs there): a store used
    there would wait for ever for a lock the hook holds, or open a connection the child copies.
    """
    if _hook_thread is not None and _hook_thread == threading.get_ident():
        raise StoreUnavailableError(
            f"SQLite store {path!r} used while this thread runs the fork hooks: its connections"
            " are closed until fork() returns"
        )


class Connection:
    """One store's connection and its one cursor in this process, and the lock every SQLite
    call of the store runs under.

    Args:
        path: the database file (named in warnings).
        fork_wait: seconds the before-fork hook waits for a call in flight before it gives up
            and lets the child inherit the connection (with a warning).
    """

    __slots__ = ("__weakref__", "conn", "cursor", "fork_wait", "lock", "path", "pid")

    def __init__(self, path: str, fork_wait: float) -> None:
        forking.generation()  # after a fork without hooks: the child's resets first, once
        self.path = path
        self.fork_wait = min(fork_wait, threading.TIMEOUT_MAX)
        self.lock = threading.Lock()
        self.conn: sqlite3.Connection | None = None
        self.cursor: sqlite3.Cursor | None = None  # of conn: every call runs on it
        self.pid = os.getpid()
        with _CREATING:
            _ALL.add(self)

    def open(self, connect: Callable[[], sqlite3.Connection]) -> sqlite3.Connection:
        """``connect()`` and record the connection (the caller holds :attr:`lock`); a connection
        still recorded (its close was interrupted) is closed first."""
        self.close_quietly()
        conn = connect()
        self.conn, self.cursor = conn, None
        _OPEN[id(self)] = self
        return conn

    def close(self) -> None:
        """Close the cursor, then the connection, even when closing the cursor raised (the
        caller holds :attr:`lock`); an error of either close is raised."""
        cursor, conn = self.cursor, self.conn
        self.conn, self.cursor = None, None
        _OPEN.pop(id(self), None)
        try:
            if cursor is not None:
                cursor.close()
        finally:
            if conn is not None:
                conn.close()

    def close_quietly(self) -> None:
        """:meth:`close` with SQLite's errors not raised (the caller holds :attr:`lock`): after
        a failure that may have left a statement or transaction holding the file's lock
        (``close()`` finalises statements and rolls back)."""
        with suppress(sqlite3.Error):
            self.close()

    def close_unless_busy(self) -> None:
        """Close now if the lock is free; else leave it: the lock of a store nothing references
        any more can only be held by the before-fork hook, which closes the connection itself.
        Never waits (it runs in ``__del__``, wherever the garbage collector runs)."""
        if self.conn is None:
            return
        if self.pid != os.getpid():
            forking.generation()  # a fork without hooks: the resets park it
            return
        if not self.lock.acquire(blocking=False):
            return
        try:
            self.close_quietly()
        finally:
            self.lock.release()

    def close_for_fork(self) -> bool:
        """Before fork(): wait for a call in flight (:attr:`fork_wait` at most), close the
        connection and keep the lock until after fork(); False when the lock was not free in
        time (the child inherits the connection, with a warning)."""
        if self.pid != os.getpid():
            return True  # inherited (fork without the hooks): the child forgets it on use
        lock = self.lock
        if not lock.acquire(timeout=self.fork_wait):
            logger.warning(
                "celery-lease: fork() while the SQLite store %r was busy: its connection could "
                "not be closed first; the child may copy it in use, and then find the file "
                "locked or not exclude other processes reliably",
                self.path,
            )
            return False
        _HELD_ACROSS_FORK.append(lock)
        try:
            self.close()
        except sqlite3.Error as exc:  # pragma: no cover - close() of an idle connection
            logger.warning("celery-lease: closing %r before fork failed (%s)", self.path, exc)
        return True

    def forget_inherited(self) -> None:
        """In a forked child: drop (without closing) the parent's connection and lock."""
        self.lock = threading.Lock()
        if self.conn is not None:
            _INHERITED.append(self.conn)
        if self.cursor is not None:
            _INHERITED.append(self.cursor)
        self.conn, self.cursor = None, None
        _OPEN.pop(id(self), None)
        self.pid = os.getpid()


def _before_fork() -> None:
    """Take :data:`_CREATING`, then close every open connection under its lock."""
    global _holds_creating, _hook_thread
    forking.generation()  # after a fork without hooks: the copied locks are replaced first
    _hook_thread = threading.get_ident()
    _CREATING.acquire()
    _holds_creating = True
    for connection in list(_ALL):
        connection.close_for_fork()


def _after_fork_in_parent() -> None:
    global _holds_creating, _hook_thread
    _hook_thread = None
    while _HELD_ACROSS_FORK:
        _HELD_ACROSS_FORK.pop().release()
    if _holds_creating:
        _holds_creating = False
        _CREATING.release()


def _after_fork_in_child() -> None:
    """New locks; the connections the parent could not close are parked, never closed here."""
    global _CREATING, _holds_creating, _hook_thread
    _CREATING = threading.RLock()  # the parent's copy is held by the hook, or by a thread
    _holds_creating = False
    _hook_thread = None
    _HELD_ACROSS_FORK.clear()
    pid = os.getpid()
    for connection in list(_ALL):
        if connection.pid != pid:
            connection.forget_inherited()


forking.on_fork_parent(
    name="sqlite stores: connections closed across the fork",
    before=_before_fork,
    after=_after_fork_in_parent,
)
forking.on_fork_child(_after_fork_in_child, name="sqlite stores: new locks, inherited parked")
