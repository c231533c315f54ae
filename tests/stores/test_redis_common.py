"""The parts the Redis store and its asyncio twin share (``celery_lease.stores._redis_common``):
the store's own URL options, script replies, the slot widths a store remembers and the texts
of messages."""

from __future__ import annotations

import pytest

from celery_lease.stores._redis_common import (
    HELD_MARK,
    WIDTHS_KEPT,
    SlotWidths,
    blpop_slice,
    blpop_waits,
    describe_server,
    refused,
    split_store_options,
)
from celery_lease.stores.base import mask_secrets, secrets_among
from celery_lease.stores.slots import MAX_LIMIT


class TestStoreOptions:
    """The store's own query options never reach redis-py."""

    def test_store_options_are_split_off_and_the_rest_kept(self) -> None:
        """min_replicas and replica_timeout leave the URL; other options stay, in order."""
        url = "redis://h:6379/0?socket_timeout=2&min_replicas=1&replica_timeout=250ms"
        plain, options = split_store_options(url)
        assert plain == "redis://h:6379/0?socket_timeout=2"
        assert options == {"min_replicas": "1", "replica_timeout": "250ms"}

    def test_a_url_without_store_options_is_returned_as_is(self) -> None:
        """Nothing of the store's: the very same URL, no options."""
        url = "redis://:p%40ss@h:6379/0?socket_timeout=2"
        assert split_store_options(url) == (url, {})


class TestReplies:
    """Script replies as both stores read them."""

    def test_an_acquire_or_holder_reply_names_the_holder_or_is_a_token(self) -> None:
        """A reply starting with HELD_MARK is a refusal, in bytes or text; digits are a token."""
        assert refused((HELD_MARK + "owner-1").encode())
        assert refused(HELD_MARK + "owner-1")
        assert not refused(b"1733300000000000")

    @pytest.mark.parametrize(
        ("socket_timeout", "expected"), [(None, 3600.0), (5.0, 4.0), (1.0, 0.5), (0.01, 0.01)]
    )
    def test_blpop_slices_end_before_the_socket_times_out(
        self, socket_timeout: float | None, expected: float
    ) -> None:
        """A blocking pop returns before the client's socket_timeout."""
        assert blpop_slice(socket_timeout) == expected

    def test_a_wait_is_cut_into_slices_until_its_deadline(self) -> None:
        """Each slice is at most the socket's and at least 1 ms; the last one ends the wait."""
        now = [0.0]

        def slices() -> list[float]:
            got = []
            for wait in blpop_waits(10.0, 5.0, lambda: now[0]):
                got.append(wait)
                now[0] += wait
            return got

        assert slices() == [4.0, 4.0, 2.0]


class TestMessages:
    """What a store error says about where the store is, never with a password."""

    def test_servers_are_described_by_scheme_host_port_and_db(self) -> None:
        """redis://, rediss:// and unix:// addresses; an IPv6 host in brackets."""
        assert (
            describe_server({"host": "h", "port": 6380, "db": 2}, ssl=False) == "redis://h:6380/2"
        )
        assert describe_server({"host": "::1", "port": 6379}, ssl=True) == "rediss://[::1]:6379/0"
        assert describe_server({"path": "/tmp/r.sock", "db": 1}, ssl=False) == (
            "unix:///tmp/r.sock?db=1"
        )

    def test_every_password_is_masked_the_longest_first(self) -> None:
        """A password containing another is masked whole; None and empty ones are ignored."""
        secrets = secrets_among(["pw", None, "", "pw-longer", 3])
        assert secrets == ("pw-longer", "pw")
        assert mask_secrets("auth pw-longer and pw", secrets) == "auth *** and ***"


class TestSlotWidths:
    def test_a_key_is_remembered_once_its_width_exceeded_the_limit(self) -> None:
        """A width within the limit of a key not yet remembered is not kept; above it, it is,
        and later widths of that key replace it (also smaller ones)."""
        widths = SlotWidths()
        widths.saw("k", 3, 3)
        assert widths.declared("k", 2) == 2
        widths.saw("k", 5, 3)
        assert (widths.declared("k", 2), widths.declared("k", 7)) == (5, 7)
        widths.saw("k", 2, 4)
        assert widths.declared("k", 1) == 2

    def test_a_width_is_capped_at_max_limit(self) -> None:
        widths = SlotWidths()
        widths.saw("k", MAX_LIMIT * 10, 1)
        assert widths.declared("k", 1) == MAX_LIMIT

    def test_at_most_widths_kept_keys_the_oldest_forgotten_first(self) -> None:
        widths = SlotWidths()
        for i in range(WIDTHS_KEPT + 1):
            widths.saw(f"k{i}", 3, 1)
        assert widths.declared("k0", 1) == 1
        assert widths.declared("k1", 1) == widths.declared(f"k{WIDTHS_KEPT}", 1) == 3
