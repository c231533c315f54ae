"""What the Redis store tests share: the store's fast connection, a lease's holder and a
command's call count read from the server, and a fake RESP3 server."""

from __future__ import annotations

import socket
import threading
from typing import Any

import redis
import redis.cluster

from celery_lease.stores._redis_fast import FastConnection
from celery_lease.stores.redis import RedisLockStore

CLIENT_ID = b"*2\r\n$6\r\nCLIENT\r\n$2\r\nID\r\n"
"""A packed ``CLIENT ID``: sent on the fast connection itself, it names that connection."""

HELLO_REPLY = b"%2\r\n$6\r\nserver\r\n$5\r\nredis\r\n$5\r\nproto\r\n:3\r\n"
"""A RESP3 server's answer to redis-py's ``HELLO 3``, enough for its handshake."""


def fast_connection(store: RedisLockStore) -> FastConnection:
    """The store's fast connection; fails the test if the store does not take the fast path."""
    fast = store._fast
    assert fast is not None, "this store must take the fast path"
    return fast


def holder(
    client: redis.Redis | redis.cluster.RedisCluster, store: RedisLockStore, key: str
) -> bytes | None:
    """The owner the server's lease hash of ``key`` names, None without a lease."""
    value: Any = client.hget(store.lease_key(key), "owner")
    return None if value is None else bytes(value)


def command_calls(client: redis.Redis, command: str) -> int:
    """How many times the server ran ``command`` (lower case, ``INFO commandstats``)."""
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def read_command(reader: Any) -> list[bytes] | None:
    """One RESP request (an array of bulk strings) from a ``makefile('rb')``, None at EOF."""
    line = reader.readline()
    if not line:
        return None
    assert line[:1] == b"*", line
    parts = []
    for _ in range(int(line[1:])):
        size = int(reader.readline()[1:])
        parts.append(reader.read(size + 2)[:-2])
    return parts


class FakeRedisServer:
    """A TCP server on 127.0.0.1 (:attr:`port`) that reads RESP requests, records them in
    :attr:`commands` and hands each to :meth:`answer`; a connection ends at EOF or when the
    client's socket fails."""

    def __init__(self) -> None:
        self.commands: list[list[bytes]] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def answer(self, conn: socket.socket, state: dict[str, Any], command: list[bytes]) -> None:
        """Write (or withhold) the reply to ``command`` on ``conn``; ``state``: a dict per
        connection, ``{"maint": False}`` at first."""
        raise NotImplementedError

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        state: dict[str, Any] = {"maint": False}
        with conn, conn.makefile("rb") as reader:
            while True:
                try:
                    command = read_command(reader)
                except (OSError, ValueError):
                    return
                if command is None:
                    return
                self.commands.append(command)
                try:
                    self.answer(conn, state, command)
                except OSError:
                    return

    def close(self) -> None:
        self._listener.close()
