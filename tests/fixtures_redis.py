"""Fixtures for tests that need a real redis-server (throwaway, on a free port).

``redis_server`` (session) starts ``redis-server`` from PATH without persistence in a temporary
directory, on a free TCP port and a unix socket; ``redis_url`` and ``redis_client`` (function)
hand out that server with its database flushed. ``redis_cluster_url`` (function) does the same
for a one-node Redis Cluster (all 16384 slots on one server, started on first use), enough to
catch cross-slot scripts and cluster-client differences.

For tests that reconfigure, fill, stop or fail over their servers:

- ``redis_server_factory`` (function): ``start(*extra_args, password=None)`` starts a server of
  the test's own (e.g. ``"--maxmemory-policy", "volatile-lru"``), stopped at teardown;
- ``redis_sentinel`` (function): a :class:`SentinelGroup` of one master, one replica and one
  Sentinel (quorum 1) on free ports, for failover tests;
- ``redis_three_masters`` (module): a :class:`ClusterNodes` Redis Cluster of three masters (no
  replicas) built with ``redis-cli --cluster create``; failover tests build a
  :class:`ClusterNodes` with replicas and a short node timeout of their own.

The shared Redis on 6379 is never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import redis

from tests.support import free_port, service_missing

__all__ = [
    "ClusterNodes",
    "RedisServer",
    "SentinelGroup",
    "redis_client",
    "redis_cluster_server",
    "redis_cluster_url",
    "redis_sentinel",
    "redis_server",
    "redis_server_factory",
    "redis_three_masters",
    "redis_url",
]

_START_TIMEOUT = 10.0  # seconds for a fresh redis-server to answer PING
_STOP_TIMEOUT = 5.0  # seconds for SIGTERM before SIGKILL
_SENTINEL_DISCOVERY_TIMEOUT = 25.0  # Sentinel polls each server's INFO every 10 s


class RedisServer:
    """A throwaway ``redis-server`` (``--save "" --appendonly no``) owned by the test session.

    Args:
        binary: path of the redis-server executable.
        directory: where its working files, socket and log go.
        port: the TCP port on 127.0.0.1 it listens on (kept across :meth:`restart`).
        cluster: start a one-node Redis Cluster owning every slot (its cluster bus gets a free
            port of its own: the default, port + 10000, may not exist).
        extra_args: more ``redis-server`` arguments (``"--maxmemory", "2mb"``), after ours.
        password: the ``requirepass`` the server is started with (``None``: no auth); the
            test clients of :meth:`client` use it.
    """

    def __init__(
        self,
        binary: str,
        directory: Path,
        port: int,
        cluster: bool = False,
        extra_args: Sequence[str] = (),
        password: str | None = None,
    ) -> None:
        self.binary = binary
        self.directory = directory
        self.port = port
        self.cluster = cluster
        self.extra_args = tuple(extra_args)
        self.password = password
        self.cluster_port = free_port() if cluster else None
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
        options: dict[str, object] = {
            "socket_timeout": 5.0,
            "socket_connect_timeout": 1.0,
            "password": self.password,
        }
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
                        [
                            "--cluster-enabled",
                            "yes",
                            "--cluster-config-file",
                            "nodes.conf",
                            "--cluster-port",
                            str(self.cluster_port),
                        ]
                        if self.cluster
                        else []
                    ),
                    *(["--requirepass", self.password] if self.password is not None else []),
                    *self.extra_args,
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
                    # Ours, not another test process's server that took the port first (our
                    # own then exits at start-up, and the caller tries another port).
                    if (
                        client.ping()
                        and int(client.info("server")["process_id"]) == self._process.pid
                        and (not self.cluster or self._cluster_ready(client))
                    ):
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
        """Start the server again if a test left it stopped, killed or dying.

        A server SIGKILLed a moment ago may have closed its port while its process has not
        exited yet (``poll()`` still None): one that does not answer PING is ended (SIGCONT
        first, in case it was SIGSTOPped) and started again, never taken for a live one.
        """
        if self._process is not None and self._process.poll() is None and self._answers():
            return
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._process.pid, signal.SIGCONT)
            self.stop()
        self._process = None
        self.start()

    def _answers(self) -> bool:
        client = self.client(socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def log(self) -> str:
        """The server's log so far."""
        path = self.directory / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""


def blocked_clients(server: RedisServer) -> int:
    """How many clients of ``server`` are blocked in a command (waiters on a released key)."""
    client = server.client()
    try:
        return int(client.info("clients")["blocked_clients"])
    finally:
        client.close()


def _redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        service_missing(
            "redis-server binary on PATH", "apt-get update && apt-get install -y redis-server"
        )
    return binary


def _start_in(
    directory: Path,
    cluster: bool = False,
    extra_args: Sequence[str] = (),
    password: str | None = None,
) -> RedisServer:
    """Start a server in ``directory`` on a free port (three tries: the port may be taken)."""
    binary = _redis_binary()
    error: Exception | None = None
    for _ in range(3):  # another process may grab the free port before redis-server binds it
        server = RedisServer(
            binary,
            directory,
            free_port(),
            cluster=cluster,
            extra_args=extra_args,
            password=password,
        )
        try:
            server.start()
        except RuntimeError as exc:
            error = exc
            continue
        return server
    raise RuntimeError(f"could not start redis-server: {error}")


def _start_server(
    tmp_path_factory: pytest.TempPathFactory, name: str, cluster: bool
) -> RedisServer:
    _redis_binary()
    return _start_in(tmp_path_factory.mktemp(name), cluster=cluster)


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


@pytest.fixture
def redis_server_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., RedisServer]]:
    """``start(*extra_args, password=None)``: a redis-server of this test alone, on a free port.

    Each server gets its own temporary directory and is stopped at the end of the test; the
    test may reconfigure, fill or stop it.
    """
    started: list[RedisServer] = []

    def start(*extra_args: str, password: str | None = None) -> RedisServer:
        _redis_binary()
        server = _start_in(
            tmp_path_factory.mktemp("own-redis"), extra_args=extra_args, password=password
        )
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            _stop_server(server)


def _wait(what: str, condition: Callable[[], bool], timeout: float) -> None:
    """Poll ``condition`` every 10 ms until it is true; RuntimeError naming ``what`` after
    ``timeout`` seconds. Redis errors while polling count as "not yet"."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen within {timeout} s")
        time.sleep(0.01)


class SentinelGroup:
    """One master, one replica and one Sentinel on free ports of 127.0.0.1, for failover tests.

    The Sentinel monitors :attr:`SERVICE` with quorum 1, ``down-after-milliseconds`` 1000 and
    ``failover-timeout`` 3000; both servers sync without the diskless delay, so the group is
    ready in well under a second. :meth:`failover` runs ``SENTINEL FAILOVER``: the replica is
    promoted within about 0.2 s and Sentinel names it about 0.5 s later, while the old master
    stays a writable master until Sentinel demotes it about 10 s after that (measured with
    Redis 7.0).

    Args:
        directory: where the three processes keep their files (one subdirectory each).
    """

    SERVICE = "celery-lease-test"
    """The Sentinel service name of the group."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.master: RedisServer | None = None
        self.replica: RedisServer | None = None
        self.sentinel_port = 0
        self._sentinel: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis+sentinel://127.0.0.1:<sentinel port>/<service>`` (db 0)."""
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{self.SERVICE}"

    @property
    def servers(self) -> tuple[RedisServer, RedisServer]:
        """The first master and the first replica (their roles swap on a failover)."""
        assert self.master is not None and self.replica is not None, "start() first"
        return self.master, self.replica

    def start(self) -> None:
        """Start master, replica and Sentinel; return once Sentinel sees the synced replica."""
        sync = ("--repl-diskless-sync-delay", "0")
        (self.directory / "master").mkdir()
        (self.directory / "replica").mkdir()
        (self.directory / "sentinel").mkdir()
        self.master = _start_in(self.directory / "master", extra_args=sync)
        self.replica = _start_in(
            self.directory / "replica",
            extra_args=(*sync, "--replicaof", "127.0.0.1", str(self.master.port)),
        )
        replica = self.servers[1]
        check = replica.client(socket_timeout=0.5)
        try:
            _wait(
                "the replica's first sync",
                lambda: check.info("replication")["master_link_status"] == "up",
                _START_TIMEOUT,
            )
        finally:
            check.close()
        # Started after the sync, so that the master's first INFO already lists the replica:
        # Sentinel asks again only every 10 s.
        self._start_sentinel()
        _wait(
            "Sentinel discovering the replica",
            self._sentinel_sees_replica,
            _SENTINEL_DISCOVERY_TIMEOUT,
        )
        # The link is up a moment before the replica acknowledges writes (it may still be
        # loading the first sync): tests expect a store's first WAIT 1 to be answered.
        writer = self.servers[0].client(socket_timeout=2)
        try:
            _wait(
                "the replica acknowledging a write",
                lambda: writer.set("celery-lease-test:ack", "1") and writer.wait(1, 1000) >= 1,
                _START_TIMEOUT,
            )
            writer.delete("celery-lease-test:ack")
        finally:
            writer.close()

    def _start_sentinel(self) -> None:
        master, _ = self.servers
        directory = self.directory / "sentinel"
        for _ in range(3):  # the free port may be taken before the Sentinel binds it
            self.sentinel_port = free_port()
            config = directory / "sentinel.conf"  # Sentinel rewrites it: it must be writable
            config.write_text(
                f"port {self.sentinel_port}\n"
                "bind 127.0.0.1\n"
                "protected-mode no\n"
                f"dir {directory}\n"
                f"sentinel monitor {self.SERVICE} 127.0.0.1 {master.port} 1\n"
                f"sentinel down-after-milliseconds {self.SERVICE} 1000\n"
                f"sentinel failover-timeout {self.SERVICE} 3000\n"
            )
            log = open(directory / "sentinel.log", "ab")  # noqa: SIM115 - owned by the process
            try:
                self._sentinel = subprocess.Popen(
                    [_redis_binary(), str(config), "--sentinel"],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=directory,
                )
            finally:
                log.close()
            client = self.sentinel_client()
            try:
                _wait("the Sentinel answering PING", client.ping, 10.0)
                return
            except RuntimeError:
                self._stop_sentinel()
            finally:
                client.close()
        raise RuntimeError(f"could not start redis-sentinel:\n{self.sentinel_log()}")

    def _sentinel_sees_replica(self) -> bool:
        client = self.sentinel_client()
        try:
            replicas = client.sentinel_slaves(self.SERVICE)
        finally:
            client.close()
        return any(
            r.get("is_slave") and not r.get("is_sdown") and r.get("master-link-status") == "ok"
            for r in replicas
        )

    def sentinel_client(self) -> redis.Redis:
        """A new client of the Sentinel (short timeouts)."""
        return redis.Redis(
            host="127.0.0.1",
            port=self.sentinel_port,
            socket_timeout=2.0,
            socket_connect_timeout=1.0,
        )

    def master_port(self) -> int:
        """The port of the master the Sentinel names now."""
        client = self.sentinel_client()
        try:
            address = client.sentinel_get_master_addr_by_name(self.SERVICE)
        finally:
            client.close()
        return int(address[1])

    def server(self, port: int) -> RedisServer:
        """The server of the group listening on ``port``."""
        return next(s for s in self.servers if s.port == port)

    def failover(self, timeout: float = _START_TIMEOUT) -> tuple[RedisServer, RedisServer]:
        """``SENTINEL FAILOVER``, then wait until the Sentinel names the replica.

        Returns ``(old master, new master)``. The old master is still a writable master then.
        """
        old = self.server(self.master_port())
        new = next(s for s in self.servers if s is not old)
        client = self.sentinel_client()
        try:
            client.execute_command("SENTINEL", "FAILOVER", self.SERVICE)
        finally:
            client.close()
        _wait(
            "the Sentinel naming the promoted replica",
            lambda: self.master_port() == new.port,
            timeout,
        )
        return old, new

    def sentinel_log(self) -> str:
        """The Sentinel's log so far (``+switch-master`` and friends)."""
        path = self.directory / "sentinel" / "sentinel.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_sentinel(self) -> None:
        """Stop the Sentinel (the servers keep running; nothing fails over any more)."""
        self._stop_sentinel()

    def _stop_sentinel(self) -> None:
        process, self._sentinel = self._sentinel, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def stop(self) -> None:
        """Stop the Sentinel first (no failover during teardown), then both servers."""
        self._stop_sentinel()
        for server in (self.master, self.replica):
            if server is not None:
                _stop_server(server)


@pytest.fixture
def redis_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelGroup]:
    """A started :class:`SentinelGroup` of this test alone, stopped at the end."""
    _redis_binary()
    group = SentinelGroup(tmp_path_factory.mktemp("sentinel-group"))
    try:
        group.start()
        yield group
    finally:
        group.stop()


class ClusterNodes:
    """A Redis Cluster of three masters on free ports of 127.0.0.1, with or without replicas.

    Built with ``redis-server --cluster-enabled yes`` once per node and ``redis-cli --cluster
    create ... --cluster-yes`` (about 2 s). Each node's cluster bus gets a free port of its own.

    Args:
        directory: where the nodes keep their files (one subdirectory each).
        replicas: replicas per master (``--cluster-replicas``); 0: three masters alone.
        node_timeout_ms: the nodes' ``cluster-node-timeout`` (None: Redis's 15 s). A replica
            takes over a dead master about this long after it died (plus its election): a
            failover test sets a short one. Replicas then always try (validity factor 0).
    """

    def __init__(
        self, directory: Path, replicas: int = 0, node_timeout_ms: int | None = None
    ) -> None:
        self.directory = directory
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[RedisServer] = []

    @property
    def seeds(self) -> list[tuple[str, int]]:
        """``(host, port)`` of every node."""
        return [("127.0.0.1", node.port) for node in self.nodes]

    def start(self) -> None:
        """Start the nodes, join them, and wait until every node reports ``cluster_state:ok``."""
        cli = shutil.which("redis-cli")
        if cli is None:
            service_missing("redis-cli binary on PATH", "apt-get install -y redis-tools")
        timeout: tuple[str, ...] = ()
        if self.node_timeout_ms is not None:
            timeout = (
                "--cluster-node-timeout",
                str(self.node_timeout_ms),
                "--cluster-replica-validity-factor",
                "0",
            )
        for index in range(3 * (1 + self.replicas)):
            directory = self.directory / f"node{index}"
            directory.mkdir()
            self.nodes.append(
                _start_in(
                    directory,
                    extra_args=(
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-port",
                        str(free_port()),
                        *timeout,
                    ),
                )
            )
        result = subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"{h}:{p}" for h, p in self.seeds),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed:\n{result.stdout}{result.stderr}"
            )
        for node in self.nodes:
            client = node.client(socket_timeout=0.5)
            try:
                _wait(
                    f"cluster_state:ok on node {node.port}",
                    lambda c=client: (
                        _cluster_info(c).get("cluster_state") == "ok"
                        and _cluster_info(c).get("cluster_known_nodes") == str(len(self.nodes))
                        and _replication_up(c)
                    ),
                    _START_TIMEOUT,
                )
            finally:
                client.close()

    def replicas_of(self, master: RedisServer) -> list[RedisServer]:
        """The nodes replicating ``master`` (asked of each node: ``ROLE``)."""
        found = []
        for node in self.nodes:
            if node is master or node.pid is None:
                continue
            client = node.client(socket_timeout=0.5)
            try:
                role = client.execute_command("ROLE")
            except redis.RedisError:  # a node a test killed or stopped
                continue
            finally:
                client.close()
            if role[0] in (b"slave", "slave") and int(role[2]) == master.port:
                found.append(node)
        return found

    def flush(self) -> None:
        """FLUSHALL on every node."""
        for node in self.nodes:
            client = node.client()
            try:
                client.flushall()
            finally:
                client.close()

    def stop(self) -> None:
        """Stop every node."""
        for node in self.nodes:
            _stop_server(node)


def _replication_up(client: redis.Redis) -> bool:
    """A master, or a replica whose link to its master is up."""
    info = client.info("replication")
    return info.get("role") == "master" or info.get("master_link_status") == "up"


def _cluster_info(client: redis.Redis) -> dict[str, str]:
    info = client.cluster("INFO")
    if isinstance(info, (bytes, str)):
        text = info.decode() if isinstance(info, bytes) else info
        return dict(line.split(":", 1) for line in text.split() if ":" in line)
    return {str(k): str(v) for k, v in info.items()}


@pytest.fixture(scope="module")
def redis_three_masters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterNodes]:
    """A started three-master :class:`ClusterNodes` for the test module, stopped at the end."""
    _redis_binary()
    cluster = ClusterNodes(tmp_path_factory.mktemp("cluster3"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
