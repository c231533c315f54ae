"""Every reach into redis-py's internals, in one place, each headed by the redis-py behaviour
it relies on (read in redis-py 8.2.0): an upgrade that moves one breaks this module and its
tests, not the stores. The stores' counterpart of :mod:`celery_lease._celery.compat`.
"""

from __future__ import annotations

import socket
from typing import cast

from redis._parsers.base import BaseParser
from redis.cluster import RedisCluster


def parse_error(text: str) -> Exception:
    """The exception redis-py raises for the error reply ``text`` (``NOSCRIPT`` ->
    ``NoScriptError``, ...). redis-py 8.2: the classmethod ``BaseParser.parse_error`` over its
    ``EXCEPTION_CLASSES``; no public function maps an error reply to its exception."""
    error: Exception = BaseParser.parse_error(text)  # type: ignore[no-untyped-call]
    return error


def connection_socket(connection: object) -> socket.socket | None:
    """The socket of a connected ``redis.connection.Connection`` (None before ``connect()``),
    which the fast path uses after redis-py's handshake. redis-py 8.2: ``AbstractConnection._sock``
    (no public accessor). Unchecked: under eventlet a TLS socket is a ``GreenSSLSocket``, not an
    instance of the (patched) ``socket.socket``."""
    return cast("socket.socket | None", getattr(connection, "_sock", None))


def client_retries(retry: object) -> int:
    """How many times a ``redis.retry.Retry`` retries a failed command (0 if it cannot tell):
    ``Retry.get_retries()`` (redis-py 8.2), else the private ``_retries`` (redis-py 5)."""
    get_retries = getattr(retry, "get_retries", None)
    retries = get_retries() if callable(get_retries) else getattr(retry, "_retries", 0)
    return retries if isinstance(retries, int) else 0


def request_slot_refresh(client: RedisCluster, failed_node: str | None = None) -> None:
    """Ask the cluster client to read its slot table again, as its command path does after a
    connection error or timeout on ``failed_node`` (``host:port``, queried last) or a
    ``CLUSTERDOWN`` reply. redis-py 8.2: the private
    ``NodesManager._request_refresh(last_failed_node_name=...)``, merged with other requests and
    run by :func:`run_requested_slot_refresh` or the client's next command. redis-py 5 keeps no
    request: nothing to do (the caller runs :func:`run_requested_slot_refresh` itself)."""
    request = getattr(client.nodes_manager, "_request_refresh", None)
    if callable(request):
        request(last_failed_node_name=failed_node)


def run_requested_slot_refresh(client: RedisCluster) -> None:
    """Refresh the slot table after an error (one thread at a time; anything may be raised,
    the caller catches it). redis-py 8.2: the requested refresh if due, through the private
    ``NodesManager._refresh_requested`` and ``_run_requested_refresh(retry)`` as
    ``RedisCluster.execute_command`` runs them: paced 1 s apart, the failed node asked last, the
    table kept on failure. redis-py 5: ``NodesManager.initialize()`` at once, unpaced and
    unlocked, raising ``RedisClusterException`` when no startup node answers."""
    manager = client.nodes_manager
    run = getattr(manager, "_run_requested_refresh", None)
    if callable(run):
        if getattr(manager, "_refresh_requested", False):
            run(getattr(client, "retry", None))
    else:
        manager.initialize()
