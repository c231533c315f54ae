"""Fault 2: a holder paused past its ttl resumes after another took over: fencing rejects it."""

from __future__ import annotations

import contextvars
import secrets
import signal
import threading
from typing import Any

import pytest

from celery_lease import lease
from celery_lease.stores.sqlite import SQLiteLockStore
from tests.faults.harness import FencedResource, PausableStore, check, wait_stopped

pytestmark = pytest.mark.slow

TTL = 1.0


def _stores(request: pytest.FixtureRequest, kind: str) -> tuple[str, str]:
    """(store URL, fence spec) of ``kind``: a real SQLite file, or a scratch Postgres database."""
    if kind == "postgres":
        dsn = request.getfixturevalue("pg_database_dsn")
        return dsn, f"{dsn}#fence_{secrets.token_hex(4)}"
    return request.getfixturevalue("sqlite_store_url"), request.getfixturevalue("fence_sqlite")


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_sigstopped_holder_write_is_rejected_after_resume(
    kind: str, request: pytest.FixtureRequest, spawn
) -> None:
    """A holder SIGSTOPped beyond its ttl finds its fenced write rejected and its lease lost."""
    store_url, fence = _stores(request, kind)
    key = f"pause-{request.node.name}"
    paused, other = spawn(store_url, fence), spawn(store_url, fence)
    last = 0
    for _ in range(3):
        first = paused.request("acquire", key, TTL, 0)
        assert first["ev"] == "acquired" and first["token"] > last, first
        assert paused.request("check", key)["lost"] is False
        since_lost = len(paused.events)

        paused.signal(signal.SIGSTOP)  # checked, then stopped before its write: fencing's case
        wait_stopped(paused.pid)
        second = other.request("acquire", key, TTL, 10, timeout=20)
        assert second["ev"] == "acquired" and second["token"] > first["token"], second
        assert other.request("write", key)["accepted"] is True
        paused.signal(signal.SIGCONT)

        late = paused.request("write", key)
        assert late["ev"] == "write" and late["accepted"] is False, late
        assert paused.request("check", key)["lost"] is True
        lost = paused.wait_for(lambda e: e["ev"] == "lost", timeout=5, since=since_lost)
        assert lost["token"] == first["token"]
        assert paused.request("release", key)["ev"] == "released"
        assert other.request("release", key)["ev"] == "released"
        last = second["token"]

    resource = FencedResource(fence)
    writes = resource.log()
    resource.close()
    assert [a for _, _, a, _ in writes] == [True, False] * 3
    assert not check(kind, [], [w for w in writes if w[2]]).stale_accepted


def _take_over(
    store: PausableStore, fence: FencedResource, key: str, ttl: float, first: Any
) -> dict[str, Any]:
    """Another holder (a fresh context, so not re-entrancy) takes ``key`` once it expires."""
    with lease(key, store=store, ttl=ttl, wait=ttl * 10) as second:
        second_ok = fence.write(key, second.token, "second")
        first_ok = fence.write(key, first.token, "first")  # decided before the pause
        return {
            "tokens": (first.token, second.token),
            "second_ok": second_ok,
            "first_ok": first_ok,
            "first_lost": first.lost,
        }


def _paused_rounds(
    store: PausableStore, fence: FencedResource, key: str, rounds: int, ttl: float
) -> list[dict[str, Any]]:
    out = []
    for _ in range(rounds):
        context = lease(key, store=store, ttl=ttl)
        first = context.__enter__()
        try:
            assert not first.lost
            store.pause(first.owner)  # its renewals fail from now on, as in a stopped process
            out.append(contextvars.Context().run(_take_over, store, fence, key, ttl, first))
        finally:
            store.resume(first.owner)
            context.__exit__(None, None, None)
    return out


@pytest.mark.parametrize("fence_kind", ["sqlite", "postgres"])
def test_fifty_paused_rounds_accept_zero_stale_writes(
    fence_kind: str, request: pytest.FixtureRequest, tmp_path
) -> None:
    """Over 50 simulated pauses (threads, real SQLite store), no stale write is accepted."""
    if fence_kind == "postgres":
        dsn = request.getfixturevalue("pg_database_dsn")
        fence = FencedResource(f"{dsn}#fence_{secrets.token_hex(4)}")
    else:
        fence = FencedResource(request.getfixturevalue("fence_sqlite"))
    store = PausableStore(SQLiteLockStore(tmp_path / "leases.db"))
    results: list[dict[str, Any]] = []
    failures: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results.extend(_paused_rounds(store, fence, f"{request.node.name}-{i}", 10, 0.25))
        except BaseException as exc:  # re-raised in the test thread
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]

    assert len(results) == 50
    assert all(r["tokens"][1] > r["tokens"][0] for r in results)
    assert all(r["second_ok"] for r in results)
    assert [r for r in results if r["first_ok"]] == []
    assert all(r["first_lost"] for r in results)
    report = check(fence_kind, [], [w for w in fence.log() if w[2]])
    fence.close()
    assert report.stale_accepted == 0 and report.writes == 50
