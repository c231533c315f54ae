"""The solo worker's early acquire and its release before the result write, explored under seeded
schedules with store faults, clock jumps past a third of the ttl and past it, a second process on
the same key, the renewer and the watchdog (``tests.sent_acquire_explorer``).

``SENT_ACQUIRE_EXPLORER_SEEDS`` sets how many seeds CI runs (default 300); a failure prints the
seed and the command that replays it. Long runs: ``python -m tests.sent_acquire_explorer --help``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from celery_lease._celery import compat, early_acquire
from celery_lease._core.lease import LeaseContext
from tests import sent_acquire_explorer as sx

SEEDS = int(os.environ.get("SENT_ACQUIRE_EXPLORER_SEEDS", "300"))


pytestmark = pytest.mark.usefixtures("quiet_core_logs")


def _report(worlds: list[sx.World]) -> str:
    return "\n\n".join(
        "\n".join(w.violations)
        + f"\n{w.story()}\nreplay: python -m tests.sent_acquire_explorer --seed {w.seed} --verbose"
        for w in worlds[:2]
    )


def test_every_seed_keeps_the_invariants() -> None:
    failed = sx.explore(range(SEEDS))
    assert not failed, _report(failed)


def test_a_seed_gives_the_same_schedule_every_time() -> None:
    """Same seed, same timeline (the owner ids' random part aside)."""

    def lines(w: sx.World) -> list[str]:
        return [line.split("  ")[0] for line in w.timeline if " -> " not in line]

    first, again = sx.run_once(11), sx.run_once(11)
    assert lines(first) == lines(again)
    assert len(first.timeline) > 20


def test_the_run_reaches_what_it_explores() -> None:
    """Across the CI seeds: bodies of both processes, the renewer and the watchdog, a grant read
    late (asked again), a deferred release read before the result write, a lease lost in its
    body and reported."""
    seen: set[str] = set()
    for seed in range(60):
        w = sx.run_once(seed)
        text = "\n".join(w.timeline)
        for mark in ("renewer", "watchdog", "flush_deferred", "other: body", "worker: body"):
            if mark in text:
                seen.add(mark)
        if any(b.lost_at_end for b in w.bodies if b.task_id is not None) and w.lost_reported:
            seen.add("lost and reported")
    assert seen == {
        "renewer",
        "watchdog",
        "flush_deferred",
        "other: body",
        "worker: body",
        "lost and reported",
    }


# Planted bugs: each breaks one safety rule of the early acquire or the result write; the
# explorer must report it within a few seeds.


def _take_skips_the_key_check(
    request: Any, key: str, store: Any, ttl: float, wait: float, on_lost: Any
) -> Any:
    mine = early_acquire.parked
    if mine is None or request is None or mine.request_id != getattr(request, "id", None):
        return None
    early_acquire.parked = None
    mine.on_lost = on_lost
    return mine


def _abandon_sent_releases_the_holder(self: LeaseContext, sent: Any) -> None:
    if sent.read is None:
        return
    sent.reply()
    info = self.store.get(self.key)
    if info is not None:
        self.store.release(self.key, info.owner)


def _abandon_sent_keeps_a_failed_try(self: LeaseContext, sent: Any) -> None:
    if sent.read is None:
        return
    reply = sent.reply()
    if type(reply) is int:
        self.store.release(self.key, sent.owner)


def _a_late_grant_is_used(self: LeaseContext, sent: Any) -> Any:
    return sent.reply()


def _no_read_before_the_write(backend: Any, before: Any) -> None:
    return None


def _give_up_only_at_shutdown(task_id: object = None) -> None:
    if task_id is None:
        mine, early_acquire.parked = early_acquire.parked, None
        if mine is not None:
            mine.give_up()


PLANTED: dict[str, tuple[object, str, Callable[..., Any], str]] = {
    "take-skips-the-key-check": (
        early_acquire, "take", _take_skips_the_key_check, "runs under a lease of"
    ),
    "abandon-sent-releases-the-holder": (
        LeaseContext, "abandon_sent", _abandon_sent_releases_the_holder, "never acquired with"
    ),
    "abandon-sent-keeps-a-failed-try": (
        LeaseContext, "abandon_sent", _abandon_sent_keeps_a_failed_try, "never released"
    ),
    "a-late-grant-is-used": (LeaseContext, "_sent_reply", _a_late_grant_is_used, "store holds"),
    "no-read-before-the-result-write": (
        compat, "call_before_result_writes", _no_read_before_the_write, "is still held by its run"
    ),
    "revoke-and-failure-keep-the-try": (
        early_acquire, "give_up", _give_up_only_at_shutdown, "the worker holds"
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_planted_bug_is_caught(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    owner, attribute, planted, message = PLANTED[name]
    monkeypatch.setattr(owner, attribute, planted)
    failed = sx.explore(range(100))
    assert failed, f"{name}: no violation in 100 seeds"
    assert any(message in v for w in failed for v in w.violations), _report(failed)
