"""``lease()``'s arguments checked once: each bad one named, durations in seconds."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from celery_lease import LeaseConfigError, MemoryLockStore
from celery_lease._core.arguments import (
    CANCEL,
    MIN_TTL,
    check_ttl,
    checked_arguments,
    split_async_store,
)
from celery_lease._core.owners import MAX_OWNER_FIELD_CHARS
from celery_lease.clock import SYSTEM_CLOCK
from celery_lease.stores.threaded import ThreadedAsyncStore

STORE = MemoryLockStore()
GOOD: dict[str, Any] = {
    "key": "k",
    "store": STORE,
    "ttl": "30s",
    "wait": 0,
    "max_hold": None,
    "on_lost": None,
    "cancel": None,
    "clock": None,
    "cooldown": 0,
    "holder": None,
}


class TestCheckedArguments:
    def test_durations_become_seconds_and_the_clock_defaults_to_the_system(self) -> None:
        """Strings and numbers are seconds; no clock given is the system clock."""
        args = checked_arguments(**{**GOOD, "wait": "250ms", "max_hold": 60, "cooldown": "1m"})
        store, astore, ttl, wait, max_hold, cooldown, _on_lost, clock = args
        assert (ttl, wait, max_hold, cooldown) == (30.0, 0.25, 60.0, 60.0)
        assert clock is SYSTEM_CLOCK and store is STORE and astore is None

    def test_cancel_string_becomes_the_marker(self) -> None:
        """``on_lost="cancel"`` is kept as CANCEL, a listener that does nothing."""
        args = checked_arguments(**{**GOOD, "on_lost": "cancel"})
        assert args[6] is CANCEL and CANCEL(object()) is None

    @pytest.mark.parametrize(
        "name, value",
        [
            ("key", ""),
            ("store", "memory://"),
            ("ttl", 0.001),
            ("wait", -1),
            ("on_lost", "revoke"),
            ("cancel", object()),
            ("clock", object()),
            ("holder", ""),
            ("holder", "x" * (MAX_OWNER_FIELD_CHARS + 1)),
        ],
    )
    def test_a_bad_argument_is_named(self, name: str, value: object) -> None:
        """The error names the parameter and the value given."""
        with pytest.raises(LeaseConfigError, match=f"{name}="):
            checked_arguments(**{**GOOD, name: value})

    def test_an_event_is_a_good_cancel(self) -> None:
        """A ``threading.Event`` is accepted as ``cancel``."""
        checked_arguments(**{**GOOD, "cancel": threading.Event()})


class TestStores:
    def test_an_async_store_is_split_from_its_twin(self) -> None:
        """An async store is held through itself and renewed through its ``sync`` twin."""
        astore = ThreadedAsyncStore(STORE)
        assert split_async_store(astore) == (astore, STORE)
        assert split_async_store(STORE) == (None, STORE)
        args = checked_arguments(**{**GOOD, "store": astore})
        assert (args[1], args[0]) == (astore, STORE)


def test_a_ttl_too_short_to_hold_is_refused() -> None:
    """A ttl of MIN_TTL or less would be lost on acquire: refused, naming the parameter."""
    with pytest.raises(LeaseConfigError, match=r"lock_ttl=0\.002"):
        check_ttl(MIN_TTL, 0.002, name="lock_ttl")
    check_ttl(MIN_TTL * 2, 0.004, name="lock_ttl")
