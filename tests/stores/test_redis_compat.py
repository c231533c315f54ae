"""The reaches into redis-py's internals still find what they rely on in the installed redis-py."""

from __future__ import annotations

import socket

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import PRIMARY, ClusterNode, NodesManager, RedisCluster
from redis.exceptions import NoScriptError, ReadOnlyError, ResponseError
from redis.retry import Retry

from celery_lease.stores._redis_compat import (
    client_retries,
    connection_socket,
    parse_error,
    request_slot_refresh,
    run_requested_slot_refresh,
)
from tests.fixtures_redis import RedisServer
from tests.support import free_port


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


requests_kept = pytest.mark.skipif(
    not hasattr(NodesManager, "_request_refresh"),
    reason="this redis-py keeps no refresh request: the refresh runs whenever asked to",
)


class _ManagerWithoutRequests:
    """A nodes manager as redis-py 5 has it: no refresh request API; counts ``initialize``."""

    def __init__(self, manager: NodesManager) -> None:
        self._manager = manager
        self.initialized = 0

    def __getattr__(self, name: str) -> object:
        if name in ("_request_refresh", "_run_requested_refresh"):
            raise AttributeError(name)
        return getattr(self._manager, name)

    def initialize(self) -> None:
        self.initialized += 1
        self._manager.initialize()


class TestSlotRefresh:
    """A refresh asked for after an error replaces a slot table entry that names a dead node;
    nothing runs without a request, or before the client's minimum interval has passed."""

    SLOT = 1234

    @staticmethod
    def _client(server: RedisServer, refresh_every: float) -> RedisCluster:
        return RedisCluster(
            host="127.0.0.1", port=server.port, topology_refresh_min_interval=refresh_every
        )

    def _stale(self, client: RedisCluster) -> str:
        dead = ClusterNode("127.0.0.1", free_port(), server_type=PRIMARY)
        client.nodes_manager.nodes_cache[dead.name] = dead
        client.nodes_manager.slots_cache[self.SLOT] = [dead]
        return dead.name

    def _serving(self, client: RedisCluster) -> str:
        return str(client.nodes_manager.get_node_from_slot(self.SLOT).name)

    def test_a_requested_refresh_runs_and_replaces_the_table(
        self, redis_cluster_server: RedisServer, redis_cluster_url: str
    ) -> None:
        client = self._client(redis_cluster_server, refresh_every=0)
        try:
            dead = self._stale(client)
            request_slot_refresh(client, dead)
            run_requested_slot_refresh(client)
            assert self._serving(client) == f"127.0.0.1:{redis_cluster_server.port}"
        finally:
            client.close()

    @requests_kept
    def test_nothing_runs_without_a_request(
        self, redis_cluster_server: RedisServer, redis_cluster_url: str
    ) -> None:
        client = self._client(redis_cluster_server, refresh_every=0)
        try:
            dead = self._stale(client)
            run_requested_slot_refresh(client)
            assert self._serving(client) == dead
        finally:
            client.close()

    @requests_kept
    def test_a_request_waits_for_the_minimum_interval(
        self, redis_cluster_server: RedisServer, redis_cluster_url: str
    ) -> None:
        client = self._client(redis_cluster_server, refresh_every=3600)
        try:
            dead = self._stale(client)
            request_slot_refresh(client, dead)
            run_requested_slot_refresh(client)
            assert self._serving(client) == dead
        finally:
            client.close()

    def test_without_the_request_api_a_request_is_nothing_and_a_run_refreshes(
        self, redis_cluster_server: RedisServer, redis_cluster_url: str
    ) -> None:
        """redis-py 5: a request changes nothing; running refreshes the table at once."""
        client = self._client(redis_cluster_server, refresh_every=0)
        manager = _ManagerWithoutRequests(client.nodes_manager)
        client.nodes_manager = manager  # type: ignore[assignment]
        try:
            dead = self._stale(client)
            request_slot_refresh(client, dead)
            assert (manager.initialized, self._serving(client)) == (0, dead)
            run_requested_slot_refresh(client)
            assert manager.initialized == 1
            assert self._serving(client) == f"127.0.0.1:{redis_cluster_server.port}"
        finally:
            client.close()
