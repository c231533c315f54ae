"""Fixtures of the fault suite: servers that a test may kill, pause or restart, and a fence.

Every server here is a throwaway one of the test's own (never the shared Redis or PostgreSQL):
``own_redis`` is a fresh ``redis-server`` without persistence on a free port, stopped at the end
of the test. PostgreSQL tests use a scratch database (``pg_database_dsn``) on the shared server:
they never stop it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.harness import Agent, Report
from tests.fixtures_redis import RedisServer
from tests.support import free_port, service_missing


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test alone (no persistence): it may be killed or SIGSTOPped."""
    binary = shutil.which("redis-server")
    if binary is None:
        service_missing(
            "redis-server binary on PATH", "apt-get update && apt-get install -y redis-server"
        )
    error: Exception | None = None
    for _ in range(3):  # the free port may be taken before redis-server binds it
        server = RedisServer(binary, tmp_path, free_port())
        try:
            server.start()
        except RuntimeError as exc:
            error = exc
            continue
        break
    else:
        raise RuntimeError(f"could not start redis-server: {error}")
    try:
        yield server
    finally:
        if server.pid is not None:  # a test may have left it stopped
            with contextlib.suppress(ProcessLookupError):
                os.kill(server.pid, signal.SIGCONT)
        server.stop()


@pytest.fixture
def fence_sqlite(tmp_path: Path) -> str:
    """The spec of a fenced resource in a fresh SQLite file."""
    return f"sqlite:///{tmp_path / 'fence.db'}"


@pytest.fixture
def sqlite_store_url(tmp_path: Path) -> str:
    """The URL of a lock store in a fresh SQLite file."""
    return f"sqlite:///{tmp_path / 'leases.db'}"


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[list[Agent]]:
    """A list the test appends its agents to; every one is killed and reaped at the end."""
    started: list[Agent] = []
    yield started
    for agent in started:
        agent.close()


@pytest.fixture
def spawn(agents: list[Agent], tmp_path: Path):  # type: ignore[no-untyped-def]
    """``spawn(store_url, fence=None)`` starts an :class:`Agent` cleaned up after the test."""

    def start(store_url: str, fence: str | None = None) -> Agent:
        agent = Agent(store_url, fence=fence, log=tmp_path / f"agent{len(agents)}.log")
        agents.append(agent)
        return agent

    return start


_REPORTS: list[Report] = []


@pytest.fixture
def exclusion_reports() -> list[Report]:
    """Where a test puts its checker :class:`Report`; the summaries are printed after the run."""
    return _REPORTS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print one line per checker run: ``<store>: N acquisitions, 0 overlaps, ...``."""
    if _REPORTS:
        terminalreporter.section("mutual-exclusion checker")
        for report in _REPORTS:
            terminalreporter.write_line(report.summary())
