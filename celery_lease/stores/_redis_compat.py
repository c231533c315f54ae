"""Every reach into redis-py's internals, in one place, each headed by the redis-py behaviour
it relies on (read in redis-py 8.2.0): an upgrade that moves one breaks this module and its
tests, not the stores. The stores' counterpart of :mod:`celery_lease._celery.compat`.
"""

from __future__ import annotations

import socket
from typing import cast

from redis._parsers.base import BaseParser
from redis.cluster import RedisCluster

__all__ = [
    "client_retries",
    "connection_socket",
    "parse_error",
    "request_slot_refresh",
    "run_requested_slot_refresh",
]


def parse_error(text: str) -> Exception:
    """The exception redis-py raises for the error reply ``text`` (``NOSCRIPT`` ->
    ``NoScriptError``, ``READONLY`` -> ``ReadOnlyError``, ...).

    redis-py 8.2: ``redis._parsers.base.BaseParser.parse_error``, a classmethod over its
    ``EXCEPTION_CLASSES`` table; no public function maps an error reply to its exception.
    """
    error: Exception = BaseParser.parse_error(text)  # type: ignore[no-untyped-call]
    return error


def connection_socket(connection: object) -> socket.socket | None:
    """The socket of a connected ``redis.connection.Connection`` (None before ``connect()``).

    redis-py 8.2: ``AbstractConnection._sock``, set by ``connect()``; there is no public
    accessor. The fast path reads and writes it directly, after redis-py's own handshake.
    Returned as redis-py set it, unchecked: under eventlet a TLS socket is a ``GreenSSLSocket``,
    which is not an instance of the (patched) ``socket.socket``.
    """
    return cast("socket.socket | None", getattr(connection, "_sock", None))


def client_retries(retry: object) -> int:
    """How many times a ``redis.retry.Retry`` retries a failed command (0 if it cannot tell).

    redis-py 8.2: ``Retry.get_retries()`` (public); older releases (redis-py 5) keep the count in
    the private ``_retries`` only.
    """
    get_retries = getattr(retry, "get_retries", None)
    retries = get_retries() if callable(get_retries) else getattr(retry, "_retries", 0)
    return retries if isinstance(retries, int) else 0


def request_slot_refresh(client: RedisCluster, failed_node: str | None = None) -> None:
    """Ask the cluster client to read its slot table again, as its own command path does after
    a connection error or a timeout on ``failed_node`` (a node name, ``host:port``; queried
    last by the refresh) or a ``CLUSTERDOWN`` reply.

    redis-py 8.2: ``NodesManager._request_refresh(last_failed_node_name=...)``, private; the
    request is merged with the others and run by :func:`run_requested_slot_refresh` or by the
    client's next command. Older releases (redis-py 5) keep no request: nothing to do here
    (their own command path refreshes at its own errors, and the caller runs
    :func:`run_requested_slot_refresh` after an error of its own).
    """
    request = getattr(client.nodes_manager, "_request_refresh", None)
    if callable(request):
        request(last_failed_node_name=failed_node)


def run_requested_slot_refresh(client: RedisCluster) -> None:
    """Refresh the slot table after an error: the requested refresh if due (redis-py 8.2), or
    at once (older releases). Only after an error, on one thread at a time; anything may be
    raised (the caller catches it).

    redis-py 8.2: ``NodesManager._refresh_requested`` and ``_run_requested_refresh(retry)``,
    private, as ``RedisCluster.execute_command`` runs before each attempt; paced at least 1 s
    apart, the failed node asked last, the table in use kept on failure. redis-py 5:
    ``NodesManager.initialize()``, unpaced and unlocked, raising ``RedisClusterException``
    when no startup node answers.
    """
    manager = client.nodes_manager
    run = getattr(manager, "_run_requested_refresh", None)
    if callable(run):
        if getattr(manager, "_refresh_requested", False):
            run(getattr(client, "retry", None))
    else:
        manager.initialize()
