"""A throwaway ``redis-server`` for one benchmark run: free port, no persistence, temp directory.

::

    with redis_server() as server:
        client = server.client()
        ...

The binary comes from PATH. The server is stopped (SIGTERM, then SIGKILL) and its directory
removed when the block exits, also on error. The shared Redis on 6379 is never touched.
"""

from __future__ import annotations

import collections
import contextlib
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
import redis.connection

__all__ = ["RedisServer", "command_calls", "count_round_trips", "redis_server"]

START_TIMEOUT = 10.0
"""Seconds for a fresh redis-server to answer PING."""

STOP_TIMEOUT = 5.0
"""Seconds to wait after SIGTERM before SIGKILL."""


class RedisServer:
    """A running throwaway server: its port, URL, and a way to make clients."""

    def __init__(self, port: int, directory: Path, process: subprocess.Popen[bytes]) -> None:
        self.port = port
        self.directory = directory
        self.process = process

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: Any) -> redis.Redis:
        """A new ``redis.Redis`` for this server with redis-py's defaults (plus ``kwargs``)."""
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def log(self) -> str:
        """The server's log so far."""
        path = self.directory / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start(binary: str, directory: Path) -> RedisServer:
    port = _free_port()
    with open(directory / "redis.log", "ab") as log:
        # fmt: off
        argv = [
            binary,
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(directory),
            "--daemonize", "no",
            "--protected-mode", "no",
        ]
        # fmt: on
        process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=directory,
        )
    server = RedisServer(port, directory, process)
    probe = server.client(socket_timeout=0.5, socket_connect_timeout=0.5)
    deadline = time.monotonic() + START_TIMEOUT
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"redis-server on port {port} exited:\n{server.log()}")
            with contextlib.suppress(redis.RedisError):
                if probe.ping():
                    return server
            if time.monotonic() > deadline:
                _stop(process)
                raise RuntimeError(f"redis-server on port {port} did not answer PING")
            time.sleep(0.01)
    finally:
        probe.close()


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def redis_server() -> Iterator[RedisServer]:
    """Run ``redis-server --port <free> --save "" --appendonly no`` in a temp dir for the block."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit(
            "redis-server is not on PATH: apt-get update && apt-get install -y redis-server"
        )
    with tempfile.TemporaryDirectory(prefix="celery-lease-bench-") as tmp:
        directory = Path(tmp)
        error: Exception | None = None
        for _ in range(3):  # another process may take the free port before redis-server binds it
            try:
                server = _start(binary, directory)
            except RuntimeError as exc:
                error = exc
                continue
            break
        else:
            raise RuntimeError(f"could not start redis-server: {error}")
        try:
            yield server
        finally:
            _stop(server.process)


def command_calls(client: redis.Redis) -> dict[str, int]:
    """``{command: calls}`` from ``INFO commandstats`` (``INFO`` itself included)."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


@contextlib.contextmanager
def count_round_trips() -> Iterator[collections.Counter[str]]:
    """Count the requests sent, per thread name, while the block runs.

    Patches ``AbstractConnection.send_packed_command``, which every redis-py request goes
    through once (a pipeline sends all its commands in one call), and the Redis store's own
    ``FastConnection.call`` (one request each), so each count is one round trip. Only for
    untimed passes: the patches add their own overhead.
    """
    from celery_lease.stores._redis_fast import BUSY, FastConnection

    counts: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    cls = redis.connection.AbstractConnection
    original = cls.send_packed_command
    original_call = FastConnection.call

    def counted(self: Any, command: Any, check_health: bool = True) -> None:
        with lock:
            counts[threading.current_thread().name] += 1
        original(self, command, check_health)

    def counted_call(self: Any, request: bytes) -> Any:
        reply = original_call(self, request)
        if reply is not BUSY:
            with lock:
                counts[threading.current_thread().name] += 1
        return reply

    cls.send_packed_command = counted  # type: ignore[method-assign]
    FastConnection.call = counted_call  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        cls.send_packed_command = original  # type: ignore[method-assign]
        FastConnection.call = original_call  # type: ignore[method-assign]
