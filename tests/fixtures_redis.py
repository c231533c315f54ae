"""Fixtures for tests that need a real redis-server (throwaway, on a free port).

``redis_server`` (session) starts ``redis-server`` from PATH without persistence in a temporary
directory, on a free TCP port and a unix socket; ``redis_url`` and ``redis_client`` (function)
hand out that server with its database flushed. ``redis_cluster_url`` (function) does the same
for a one-node Redis Cluster (all 16384 slots on one server, started on first use), enough to
catch cross-slot scripts and cluster-client differences. The shared Redis on 6379 is never
touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support import free_port, service_missing

__all__ = [
    "RedisServer",
    "redis_client",
    "redis_cluster_server",
    "redis_cluster_url",
    "redis_server",
    "redis_url",
]

_START_TIMEOUT = 10.0  # seconds for a fresh redis-server to answer PING
_STOP_TIMEOUT = 5.0  # seconds for SIGTERM before SIGKILL


class RedisServer:
    """A throwaway ``redis-server`` (``--save "" --appendonly no``) owned by the test session.

    Args:
        binary: path of the redis-server executable.
        directory: where its working files, socket and log go.
        port: the TCP port on 127.0.0.1 it listens on (kept across :meth:`restart`).
        cluster: start a one-node Redis Cluster owning every slot.
    """

    def __init__(self, binary: str, directory: Path, port: int, cluster: bool = False) -> None:
        self.binary = binary
        self.directory = directory
        self.port = port
        self.cluster = cluster
        self.unix_socket = str(directory / "redis.sock")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        """``unix://<socket path>?db=0``."""
        return f"unix://{self.unix_socket}?db=0"

    @property
    def pid(self) -> int | None:
        """The server's process id, or ``None`` while it is stopped."""
        return None if self._process is None else self._process.pid

    def client(self, **kwargs: object) -> redis.Redis:
        """A new client for this server (short timeouts, for the tests' own checks)."""
        options: dict[str, object] = {"socket_timeout": 5.0, "socket_connect_timeout": 1.0}
        options.update(kwargs)
        return redis.Redis(host="127.0.0.1", port=self.port, **options)  # type: ignore[arg-type]

    def start(self) -> None:
        """Start an empty server on :attr:`port` and wait until it answers PING."""
        if self._process is not None:
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        log = open(self.directory / "redis.log", "ab")  # noqa: SIM115 - owned by the process
        try:
            self._process = subprocess.Popen(
                [
                    self.binary,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--unixsocket",
                    self.unix_socket,
                    "--unixsocketperm",
                    "700",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.directory),
                    "--daemonize",
                    "no",
                    "--protected-mode",
                    "no",
                    *(
                        ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
                        if self.cluster
                        else []
                    ),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.directory,
            )
        finally:
            log.close()
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT
        client = self.client(socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while True:
                assert self._process is not None
                if self._process.poll() is not None:
                    self._process = None
                    raise RuntimeError(
                        f"redis-server on port {self.port} exited at start-up:\n{self.log()}"
                    )
                try:
                    if client.ping() and (not self.cluster or self._cluster_ready(client)):
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} did not answer PING")
                time.sleep(0.01)
        finally:
            client.close()

    @staticmethod
    def _cluster_ready(client: redis.Redis) -> bool:
        info = client.cluster("INFO")
        if isinstance(info, (bytes, str)):
            text = info.decode() if isinstance(info, bytes) else info
            info = dict(line.split(":", 1) for line in text.split() if ":" in line)
        if str(info.get("cluster_slots_assigned")) == "0":
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        return str(info.get("cluster_state")) == "ok"

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL); its data is gone (no persistence)."""
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def restart(self) -> None:
        """Stop the server and start an empty one on the same port."""
        self.stop()
        self.start()

    def ensure_running(self) -> None:
        """Start the server again if a test left it stopped."""
        if self._process is None or self._process.poll() is not None:
            self._process = None
            self.start()

    def log(self) -> str:
        """The server's log so far."""
        path = self.directory / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _start_server(
    tmp_path_factory: pytest.TempPathFactory, name: str, cluster: bool
) -> RedisServer:
    binary = shutil.which("redis-server")
    if binary is None:
        service_missing(
            "redis-server binary on PATH", "apt-get update && apt-get install -y redis-server"
        )
    directory = tmp_path_factory.mktemp(name)
    error: Exception | None = None
    for _ in range(3):  # another process may grab the free port before redis-server binds it
        server = RedisServer(binary, directory, free_port(), cluster=cluster)
        try:
            server.start()
        except RuntimeError as exc:
            error = exc
            continue
        break
    else:
        raise RuntimeError(f"could not start redis-server: {error}")
    return server


def _stop_server(server: RedisServer) -> None:
    server.stop()
    if os.path.exists(server.unix_socket):
        os.unlink(server.unix_socket)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A throwaway redis-server for the whole session, stopped at the end."""
    server = _start_server(tmp_path_factory, "redis", cluster=False)
    try:
        yield server
    finally:
        _stop_server(server)


@pytest.fixture(scope="session")
def redis_cluster_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A throwaway one-node Redis Cluster for the whole session, stopped at the end."""
    server = _start_server(tmp_path_factory, "redis-cluster", cluster=True)
    try:
        yield server
    finally:
        _stop_server(server)


@pytest.fixture
def redis_cluster_url(redis_cluster_server: RedisServer) -> str:
    """The URL of the one-node cluster, flushed for this test (use it with RedisCluster)."""
    redis_cluster_server.ensure_running()
    client = redis_cluster_server.client()
    try:
        client.flushall()
    finally:
        client.close()
    return redis_cluster_server.url


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The URL of the throwaway server, its database flushed for this test."""
    redis_server.ensure_running()
    client = redis_server.client()
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url


@pytest.fixture
def redis_client(redis_server: RedisServer, redis_url: str) -> Iterator[redis.Redis]:
    """A client of the throwaway server, its database flushed for this test."""
    client = redis_server.client()
    try:
        yield client
    finally:
        client.close()
