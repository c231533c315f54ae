"""Fixtures for the fencing helpers: a real lease store, and the paused-holder takeover.

:func:`takeover` is the story every backend's test tells: an old holder takes a key and pauses,
its lease is taken from it (``force_release``, as an expiry would), a new holder acquires the
key (a higher token) and writes, then the old holder wakes up and writes too. Both writes run
inside their own ``with lease(...)`` and pass no token: the helpers use the current lease's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from celery_lease import SQLiteLockStore, lease
from celery_lease.fencing import StaleTokenError

JOIN_TIMEOUT = 30.0  # seconds a test thread may take to finish before the test fails
POLL_TIMEOUT = 15.0  # seconds a polled server-side condition may take to appear


@pytest.fixture
def lease_store(tmp_path: Path) -> Iterator[SQLiteLockStore]:
    """A real lease store (an SQLite file of its own) for the test."""
    store = SQLiteLockStore(tmp_path / "leases.sqlite3")
    try:
        yield store
    finally:
        store.close()


@dataclass(frozen=True)
class Takeover:
    """What happened: both holders' tokens, the old write's error (``None``: it went through)."""

    old_token: int
    new_token: int
    old_error: StaleTokenError | None


def takeover(
    store: SQLiteLockStore,
    key: str,
    write: Callable[[str], object],
    *,
    in_thread: Callable[[], None] = lambda: None,
) -> Takeover:
    """Old holder acquires ``key`` and pauses; a new holder takes over and runs ``write("new")``;
    then the old holder runs ``write("old")``. ``in_thread`` runs at the end of the old holder's
    thread (e.g. to close its per-thread Django connection)."""
    acquired, resume = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def old_holder() -> None:
        try:
            with lease(key, store=store, ttl=60) as held:
                seen["old_token"] = held.token
                acquired.set()
                if not resume.wait(JOIN_TIMEOUT):
                    raise TimeoutError("the old holder was never resumed")
                try:
                    write("old")
                except StaleTokenError as exc:
                    seen["error"] = exc
        except BaseException as exc:  # reported to the test below
            seen["crash"] = exc
        finally:
            acquired.set()
            in_thread()

    thread = threading.Thread(target=old_holder, name="old-holder")
    thread.start()
    try:
        assert acquired.wait(JOIN_TIMEOUT), "the old holder never acquired the key"
        assert "crash" not in seen, seen
        assert store.force_release(key) is not None  # its lease ends as if it had expired
        with lease(key, store=store, ttl=60) as held:
            new_token = held.token
            write("new")
    finally:
        resume.set()
        thread.join(JOIN_TIMEOUT)
    assert not thread.is_alive(), "the old holder did not finish"
    if "crash" in seen:
        raise AssertionError(f"the old holder failed: {seen['crash']!r}") from seen["crash"]  # type: ignore[arg-type]
    old_token = seen["old_token"]
    assert isinstance(old_token, int) and new_token > old_token
    error = seen.get("error")
    assert error is None or isinstance(error, StaleTokenError)
    return Takeover(old_token, new_token, error)


def poll(predicate: Callable[[], bool], what: str, timeout: float = POLL_TIMEOUT) -> None:
    """Poll a server-side condition (e.g. a backend waiting on a lock) until it holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)  # poll interval, not a synchronisation


class Outcome:
    """The result or the error of a call made in a thread."""

    def __init__(self) -> None:
        self.result: object = None
        self.error: BaseException | None = None
        self.done = threading.Event()


def in_thread(
    call: Callable[[], object], after: Callable[[], None] = lambda: None
) -> tuple[threading.Thread, Outcome]:
    """Start ``call()`` in a thread; its outcome is recorded, ``after()`` runs at its end."""
    outcome = Outcome()

    def run() -> None:
        try:
            outcome.result = call()
        except BaseException as exc:
            outcome.error = exc
        finally:
            after()
            outcome.done.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome
