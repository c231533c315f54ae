"""Fixtures for tests that need a real PostgreSQL (a database created and dropped per session).

- ``pg_database_dsn`` (session): a scratch database ``celery_lease_test_<pid>_<hex>`` created on
  the shared server (``CELERY_LEASE_PG_DSN``, default ``postgresql://postgres@127.0.0.1:5432/
  postgres``) and dropped, with ``FORCE``, at the end of the session.
- ``pg_table`` (function): a table name no other test uses, in that database.
- ``pg_app_role`` (function): a LOGIN role with no privilege beyond PostgreSQL 15's defaults
  (no ``CREATE`` on ``public``), and a DSN for it on the scratch database; dropped after the test.
- ``pg_cluster`` (function): a running THROWAWAY cluster (``initdb`` + ``pg_ctl`` in a temporary
  directory, on a free port) for tests that stop or restart the server. It is created once per
  session and started again before each test that asks for it. ``initdb`` refuses to run as
  root, so as root every server command runs as the ``postgres`` user (``runuser``, else
  ``su``), in a directory owned by that user.

A missing server, binary or user calls :func:`tests.support.service_missing` (fails in CI, skips
locally). Readiness is polled against a deadline, never slept for.
"""

from __future__ import annotations

import glob
import os
import secrets
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.support import free_port, service_missing

SERVER_DSN = os.environ.get("CELERY_LEASE_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
HOW_SERVER = (
    "start PostgreSQL on 127.0.0.1:5432 with trust auth for user postgres, or set "
    "CELERY_LEASE_PG_DSN to a server where that user may CREATE DATABASE"
)
HOW_BINARIES = "apt-get update && apt-get install -y postgresql (initdb and pg_ctl on PATH)"
READY_TIMEOUT = 30.0  # seconds a server gets to accept connections


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError:
        service_missing("the psycopg driver", "pip install -e '.[postgres]'")
    return psycopg


def _with_dbname(dsn: str, dbname: str) -> str:
    """``dsn`` pointing at ``dbname``, in the same form (a URL stays a URL)."""
    if "://" in dsn:
        parts = urlsplit(dsn)
        return urlunsplit(parts._replace(path=f"/{dbname}"))
    from psycopg.conninfo import make_conninfo

    return make_conninfo(dsn, dbname=dbname)


def wait_until_accepting(dsn: str, timeout: float = READY_TIMEOUT) -> None:
    """Poll ``dsn`` until a connection succeeds; raise TimeoutError after ``timeout`` seconds."""
    psycopg = _psycopg()
    deadline = time.monotonic() + timeout
    while True:
        try:
            psycopg.connect(dsn, connect_timeout=2).close()
            return
        except psycopg.OperationalError as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(f"PostgreSQL at {dsn} not ready after {timeout} s") from exc
            time.sleep(0.02)  # poll interval, not a synchronisation


@pytest.fixture(scope="session")
def pg_database_dsn() -> Iterator[str]:
    """The DSN of a scratch database on the shared server, dropped at the end of the session."""
    psycopg = _psycopg()
    try:
        admin = psycopg.connect(SERVER_DSN, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        service_missing(f"PostgreSQL at {SERVER_DSN} ({exc})", HOW_SERVER)
    name = f"celery_lease_test_{os.getpid()}_{secrets.token_hex(4)}"
    ident = psycopg.sql.Identifier(name)
    with admin:
        admin.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(ident))
    try:
        yield _with_dbname(SERVER_DSN, name)
    finally:
        with psycopg.connect(SERVER_DSN, autocommit=True, connect_timeout=3) as admin:
            admin.execute(psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))


@pytest.fixture
def pg_table() -> str:
    """A table name that no other test uses."""
    return f"lease_{secrets.token_hex(6)}"


@dataclass(frozen=True)
class PgRole:
    """A least-privilege login role: ``name``, and ``dsn``, a URL for it on the scratch database."""

    name: str
    dsn: str


def _as_user(dsn: str, user: str) -> str:
    """``dsn`` (a URL) connecting as ``user`` with no password (the server trusts loopback)."""
    parts = urlsplit(dsn)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{user}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


@pytest.fixture
def pg_app_role(pg_database_dsn: str) -> Iterator[PgRole]:
    """A role that may connect and nothing more: no CREATE on ``public`` (PostgreSQL 15 default).

    Tests grant it what they need (``GRANT ... TO`` ``name``). ``CREATE`` on ``public`` is also
    revoked from ``PUBLIC`` in the scratch database, so the role lacks it on older servers too.
    """
    psycopg = _psycopg()
    if "://" not in pg_database_dsn:
        pytest.skip("pg_app_role needs CELERY_LEASE_PG_DSN as a URL")
    name = f"lease_app_{secrets.token_hex(4)}"
    ident = psycopg.sql.Identifier(name)
    with psycopg.connect(pg_database_dsn, autocommit=True, connect_timeout=3) as admin:
        admin.execute(psycopg.sql.SQL("CREATE ROLE {} LOGIN").format(ident))
        admin.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
        (can_create,) = admin.execute(
            "SELECT has_schema_privilege(%s, 'public', 'CREATE')", [name]
        ).fetchone()
        assert can_create is False
    try:
        yield PgRole(name, _as_user(pg_database_dsn, name))
    finally:
        with psycopg.connect(pg_database_dsn, autocommit=True, connect_timeout=3) as admin:
            # End the role's sessions first (a pool may still be closing its connections).
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                [name],
            )
            admin.execute(psycopg.sql.SQL("DROP OWNED BY {}").format(ident))
            admin.execute(psycopg.sql.SQL("DROP ROLE {}").format(ident))


# A throwaway cluster -----------------------------------------------------------------------------


def _find_binary(name: str) -> str | None:
    found = shutil.which(name)
    if found is not None:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


class PgCluster:
    """A PostgreSQL cluster of its own, on 127.0.0.1:``port``, that tests may stop and restart.

    Listens on TCP only (no Unix socket, so it never collides with the shared server), with
    ``fsync`` off: it holds test data only.
    """

    def __init__(self, bindir: Path, root: Path, run_as: str | None) -> None:
        self.bindir = bindir
        self.root = root
        self.data = root / "data"
        self.log = root / "server.log"
        self.run_as = run_as
        self.port = free_port()

    @property
    def dsn(self) -> str:
        """The DSN of the cluster's ``postgres`` database."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *argv: str, timeout: float = 60.0) -> None:
        command = list(argv)
        if self.run_as is not None:
            if shutil.which("runuser"):
                command = ["runuser", "-u", self.run_as, "--", *command]
            else:
                command = ["su", self.run_as, "-s", "/bin/sh", "-c", shlex.join(command)]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, check=False, cwd=self.root
        )
        if done.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(
                f"{shlex.join(command)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
                f"\n--- server log ---\n{log}"
            )

    def init(self) -> None:
        """Create the data directory (trust auth, superuser ``postgres``)."""
        initdb = str(self.bindir / "initdb")
        self._run(initdb, "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8",
                  "--no-sync")  # fmt: skip

    def start(self) -> None:
        """Start the server and return once it accepts connections."""
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' "
            "-c fsync=off -c max_connections=60"
        )
        pg_ctl = str(self.bindir / "pg_ctl")
        self._run(pg_ctl, "-D", str(self.data), "-l", str(self.log), "-o", options, "-w",
                  "-t", str(int(READY_TIMEOUT)), "start")  # fmt: skip
        wait_until_accepting(self.dsn)

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``fast``: sessions are terminated; ``immediate``: like a crash)."""
        pg_ctl = str(self.bindir / "pg_ctl")
        self._run(pg_ctl, "-D", str(self.data), "-m", mode, "-w", "stop")

    def restart(self, mode: str = "fast") -> None:
        """Stop then start the server on the same port."""
        self.stop(mode)
        self.start()

    def is_running(self) -> bool:
        """Whether ``pg_ctl status`` reports a running server."""
        try:
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "status")
        except RuntimeError:
            return False
        return True


@pytest.fixture(scope="session")
def _pg_cluster_session() -> Iterator[PgCluster]:
    initdb, pg_ctl = _find_binary("initdb"), _find_binary("pg_ctl")
    if initdb is None or pg_ctl is None:
        service_missing("PostgreSQL server binaries initdb/pg_ctl", HOW_BINARIES)
    _psycopg()
    bindir = Path(initdb).resolve().parent
    if not (bindir / "pg_ctl").exists():
        bindir = Path(pg_ctl).resolve().parent
    run_as: str | None = None
    owner: Any = None  # a pwd.struct_passwd
    if os.geteuid() == 0:  # initdb refuses to run as root
        import pwd  # POSIX only: imported here so that the suite still imports elsewhere

        run_as = os.environ.get("CELERY_LEASE_PG_USER", "postgres")
        try:
            owner = pwd.getpwnam(run_as)
        except KeyError:
            service_missing(
                f"a non-root user {run_as!r} to run initdb as (we are root)",
                "useradd --system postgres, or set CELERY_LEASE_PG_USER",
            )
    # Not pytest's tmp_path: as root, its parent is private to root and the server user could
    # not enter it.
    root = Path(tempfile.mkdtemp(prefix="celery-lease-pg-", dir="/tmp" if owner else None))
    if owner is not None:
        os.chown(root, owner.pw_uid, owner.pw_gid)
    cluster = PgCluster(bindir, root, run_as)
    try:
        cluster.init()
        cluster.start()
        yield cluster
    finally:
        if cluster.is_running():
            cluster.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def pg_cluster(_pg_cluster_session: PgCluster) -> PgCluster:
    """A running throwaway cluster (started again if an earlier test left it stopped)."""
    if not _pg_cluster_session.is_running():
        _pg_cluster_session.start()
    return _pg_cluster_session
