"""The parts the Redis store and its asyncio twin share (``celery_lease.stores._redis_common``):
Sentinel URLs, the store's own URL options, script replies and the texts of messages."""

from __future__ import annotations

import pytest

from celery_lease.errors import LeaseConfigError
from celery_lease.stores._redis_common import (
    HELD_MARK,
    SentinelURL,
    blpop_slice,
    describe_sentinel_master,
    describe_server,
    master_address,
    parse_sentinel_url,
    redact_secrets,
    refused,
    secrets_among,
    split_store_options,
)


class TestSentinelURLs:
    """``redis+sentinel://`` URLs, parsed once for both stores."""

    @pytest.mark.parametrize(
        ("url", "expected"),
        [
            (
                "redis+sentinel://s1:26379,s2:26380/mymaster",
                SentinelURL((("s1", 26379), ("s2", 26380)), "mymaster"),
            ),
            (
                "redis+sentinel://user:p%3Aw@s1,[::1]:26381/svc/4?sentinel_password=x&socket_timeout=2",
                SentinelURL(
                    (("s1", 26379), ("::1", 26381)),
                    "svc",
                    db=4,
                    username="user",
                    password="p:w",
                    sentinel_password="x",
                    socket_timeout=2.0,
                ),
            ),
            (
                "redis+sentinel://:only-password@s1:26379/svc/",
                SentinelURL((("s1", 26379),), "svc", password="only-password"),
            ),
        ],
    )
    def test_sentinel_url_parsing(self, url: str, expected: SentinelURL) -> None:
        """Hosts, ports (default 26379), credentials, service, db and options are parsed."""
        assert parse_sentinel_url(url) == expected

    @pytest.mark.parametrize(
        "url",
        [
            "redis+sentinel://s1:26379",
            "redis+sentinel://s1:26379/",
            "redis+sentinel://s1:26379/svc/notadb",
            "redis+sentinel://s1:26379/svc/1/extra",
            "redis+sentinel://s1:port/svc",
            "redis+sentinel://s1,,s2/svc",
            "redis+sentinel://s1/svc?sentinel_pasword=typo",
            "redis+sentinel://s1/svc?socket_timeout=soon",
            "redis://s1/svc",
        ],
    )
    def test_bad_sentinel_urls_are_refused(self, url: str) -> None:
        """Malformed Sentinel URLs raise LeaseConfigError naming the URL."""
        with pytest.raises(LeaseConfigError, match="url="):
            parse_sentinel_url(url)


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

    def test_sentinel_master_reply(self) -> None:
        """GET-MASTER-ADDR-BY-NAME's pair is (host, port); an empty reply is no master."""
        assert master_address([b"10.0.0.2", b"6380"]) == ("10.0.0.2", 6380)
        assert master_address(None) is None

    @pytest.mark.parametrize(
        ("socket_timeout", "expected"), [(None, 3600.0), (5.0, 4.0), (1.0, 0.5), (0.01, 0.01)]
    )
    def test_blpop_slices_end_before_the_socket_times_out(
        self, socket_timeout: float | None, expected: float
    ) -> None:
        """A blocking pop returns before the client's socket_timeout."""
        assert blpop_slice(socket_timeout) == expected


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

    def test_a_sentinel_master_is_described_by_its_sentinels_service_and_master(self) -> None:
        """The Sentinels, the service, the db and the master known (or not yet)."""
        sentinels = [{"host": "s1", "port": 26379}, {"host": "s2", "port": 26380}]
        assert describe_sentinel_master(sentinels, "svc", 3, ("m", 6379)) == (
            "redis+sentinel://s1:26379,s2:26380/svc/3 (master m:6379)"
        )
        assert describe_sentinel_master(sentinels, "svc", 0, None).endswith(
            "(master not known yet)"
        )

    def test_every_password_is_masked_the_longest_first(self) -> None:
        """A password containing another is masked whole; None and empty ones are ignored."""
        secrets = secrets_among(["pw", None, "", "pw-longer", 3])
        assert secrets == ("pw-longer", "pw")
        assert redact_secrets("auth pw-longer and pw", secrets) == "auth *** and ***"
