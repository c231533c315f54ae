"""The reaches into redis-py's internals still find what they rely on in the installed redis-py."""

from __future__ import annotations

import socket

import pytest
import redis
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, ReadOnlyError, ResponseError
from redis.retry import Retry

from celery_lease.stores._redis_compat import client_retries, connection_socket, parse_error


class TestParseError:
    @pytest.mark.parametrize(
        ("text", "kind"),
        [
            ("NOSCRIPT No matching script", NoScriptError),
            ("READONLY You can't write against a read only replica.", ReadOnlyError),
            ("WRONGTYPE Operation against a key holding the wrong kind of value", ResponseError),
        ],
    )
    def test_maps_an_error_reply_to_redis_pys_exception(self, text: str, kind: type) -> None:
        error = parse_error(text)
        assert type(error) is kind
        assert str(error) == text.split(" ", 1)[1] or text in str(error)


class TestConnectionSocket:
    def test_none_before_connect(self) -> None:
        assert connection_socket(redis.connection.Connection()) is None

    def test_the_socket_after_connect(self, redis_url: str) -> None:
        pool = redis.ConnectionPool.from_url(redis_url)
        connection = pool.get_connection()
        try:
            assert isinstance(connection_socket(connection), socket.socket)
        finally:
            pool.release(connection)
            pool.disconnect()

    def test_an_object_without_a_socket(self) -> None:
        assert connection_socket(object()) is None

    def test_a_cooperative_pools_socket_is_returned_as_it_is(self) -> None:
        """Under eventlet a TLS socket is not an instance of the patched ``socket.socket``: it
        is handed over all the same."""

        class GreenSSLSocket:  # stands for eventlet.green.ssl.GreenSSLSocket
            pass

        connection = redis.connection.Connection()
        wrapped = GreenSSLSocket()
        connection._sock = wrapped  # type: ignore[assignment]
        assert connection_socket(connection) is wrapped


class TestClientRetries:
    @pytest.mark.parametrize("count", [0, 1, 10])
    def test_reads_the_retry_count(self, count: int) -> None:
        assert client_retries(Retry(NoBackoff(), count)) == count

    def test_an_object_that_cannot_tell_is_zero(self) -> None:
        assert client_retries(object()) == 0
