"""Redis Sentinel (``celery_lease.stores._redis_sentinel``): ``redis+sentinel://`` URLs, the
master a Sentinel names, and the clients both stores build from a URL."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio
import redis.asyncio.sentinel
from redis.asyncio.retry import Retry as AsyncRetry
from redis.retry import Retry

from celery_lease.errors import LeaseConfigError
from celery_lease.stores._redis_sentinel import (
    Sentinel,
    SentinelURL,
    client_from_url,
    describe_sentinel_master,
    master_address,
    master_of,
    parse_sentinel_url,
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


class TestMasters:
    """What a Sentinel answers, and how a store describes the master."""

    def test_sentinel_master_reply(self) -> None:
        """GET-MASTER-ADDR-BY-NAME's pair is (host, port); an empty reply is no master."""
        assert master_address([b"10.0.0.2", b"6380"]) == ("10.0.0.2", 6380)
        assert master_address(None) is None

    def test_a_sentinel_that_failed_or_knows_no_such_service_is_a_problem(self) -> None:
        """Each Sentinel that names no master adds its reason, named by its address."""

        class _Pool:
            connection_kwargs = {"host": "s1", "port": 26379}

        class _Sentinel:
            connection_pool = _Pool()

        problems: list[str] = []
        assert master_of(_Sentinel(), [b"m", b"6380"], problems) == ("m", 6380)
        assert master_of(_Sentinel(), None, problems) is None
        assert master_of(_Sentinel(), ConnectionError("refused"), problems) is None
        assert problems == ["s1:26379: no such service", "s1:26379: refused"]

    def test_a_sentinel_master_is_described_by_its_sentinels_service_and_master(self) -> None:
        """The Sentinels, the service, the db and the master known (or not yet)."""
        sentinels = [{"host": "s1", "port": 26379}, {"host": "s2", "port": 26380}]
        assert describe_sentinel_master(sentinels, "svc", 3, ("m", 6379)) == (
            "redis+sentinel://s1:26379,s2:26380/svc/3 (master m:6379)"
        )
        assert describe_sentinel_master(sentinels, "svc", 0, None).endswith(
            "(master not known yet)"
        )


class TestClientsFromURLs:
    """Both stores build their clients from a URL here, nothing connects yet."""

    def test_a_sentinel_url_gives_a_master_client_and_the_store_options(self) -> None:
        """The sync classes give a Sentinel-managed master and the URL's store options."""
        client, sentinel, options = client_from_url(
            "redis+sentinel://s1/svc/2?min_replicas=2", redis.Redis, Sentinel, Retry
        )
        assert isinstance(sentinel, Sentinel)
        assert client.connection_pool.service_name == "svc"
        assert options == {"min_replicas": 2}

    def test_the_async_classes_give_an_async_client(self) -> None:
        """The same URL with redis.asyncio's classes gives a redis.asyncio client."""
        client, sentinel, options = client_from_url(
            "redis://h:6380/1?restart_grace=0", redis.asyncio.Redis, None, AsyncRetry
        )
        assert isinstance(client, redis.asyncio.Redis) and sentinel is None
        assert options == {"restart_grace": "0"}

    def test_another_scheme_is_refused_without_its_password(self) -> None:
        """A URL of another scheme names the schemes taken, its password masked."""
        with pytest.raises(LeaseConfigError, match="not a Redis URL") as caught:
            client_from_url("http://u:s3cret@h/", redis.Redis, Sentinel, Retry)
        assert "s3cret" not in str(caught.value)
