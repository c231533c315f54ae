"""The cluster fan-out's threads (``celery_lease.stores._redis_cluster``): node shares run at once
and hand back their results in order, a slot-table refresh runs once at a time, and a second try
is waited for only until its deadline. Batches against real clusters: ``test_redis.py`` and
``tests/faults/test_redis_cluster*.py``."""

from __future__ import annotations

import threading
import time
from typing import Any, cast

import pytest
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_lease.stores._redis_cluster import NodeWorkers, SlotRefresh, before


class TestNodeWorkers:
    def test_results_come_in_job_order_and_the_shares_run_at_once(self) -> None:
        """Every job runs on a thread of its own but the first, all at the same time."""
        barrier = threading.Barrier(3, timeout=10)

        def job(value: int) -> int:
            barrier.wait()  # three jobs meet here only when they run at once
            return value

        assert NodeWorkers().run([lambda: job(1), lambda: job(2), lambda: job(3)]) == [1, 2, 3]

    def test_the_first_error_is_raised_after_every_job_ended(self) -> None:
        """A job that raises does not cut the others short; the first error in job order is
        raised once all have returned."""
        ended = threading.Event()

        def slow() -> int:
            ended.set()
            return 0

        def fails(message: str) -> int:
            raise ValueError(message)

        with pytest.raises(ValueError, match="first"):
            NodeWorkers().run([lambda: fails("first"), slow, lambda: fails("second")])
        assert ended.is_set()

    def test_no_jobs_no_results(self) -> None:
        """An empty batch runs nothing."""
        assert NodeWorkers().run([]) == []

    def test_a_suspect_still_running_when_the_others_ended_is_not_waited_for(self) -> None:
        """A suspect job (a node that timed out before) that has not ended once the others did
        gets ``late(index)`` in its place and goes on alone; the caller's thread ran no suspect."""
        entered, let_go, ended = threading.Event(), threading.Event(), threading.Event()
        ran_on: list[threading.Thread] = []

        def hung() -> str:
            ran_on.append(threading.current_thread())
            entered.set()
            let_go.wait(10)
            ended.set()
            return "late answer"

        try:
            answer = NodeWorkers().run([hung, lambda: "a", lambda: "b"], {0}, lambda i: f"late {i}")
            assert answer == ["late 0", "a", "b"]
            assert entered.wait(10)
            assert ran_on[0] is not threading.current_thread()
        finally:
            let_go.set()
        assert ended.wait(10), "the suspect's job went on alone to its end"

    def test_a_suspect_that_ended_in_time_gives_its_result(self) -> None:
        """A suspect job that ended before the others did answers as any job."""
        answered = threading.Event()

        def suspect() -> str:
            answered.set()
            return "answered"

        def other() -> str:
            assert answered.wait(10)
            return "other"

        assert NodeWorkers().run([suspect, other], {0}, lambda i: "late") == ["answered", "other"]

    def test_a_batch_of_suspects_alone_waits_for_them(self) -> None:
        """With nothing else to wait for, the suspects are waited for: their calls would
        otherwise never be tried."""
        started = threading.Event()

        def slow() -> str:
            assert started.wait(10)
            return "slow"

        def quick() -> str:
            started.set()
            return "quick"

        assert NodeWorkers().run([slow, quick], {0, 1}, lambda i: "late") == ["slow", "quick"]


class TestSlotRefresh:
    def test_a_refresh_asked_for_while_one_runs_joins_it(self) -> None:
        """Two starts while the first refresh runs: one refresh, one event for both."""
        release = threading.Event()
        runs: list[int] = []

        def refresh() -> None:
            runs.append(1)
            release.wait(10)

        slots = SlotRefresh(refresh)
        first = slots.start()
        assert slots.start() is first
        release.set()
        assert first.wait(10)
        second = slots.start()
        assert second is not first and second.wait(10)
        assert len(runs) == 2


class TestBefore:
    def test_a_job_ended_in_time_gives_its_result(self) -> None:
        """``(True, result)``; an error it raised is raised here."""
        assert before(time.monotonic() + 10, lambda: 7) == (True, 7)
        with pytest.raises(KeyError):
            before(time.monotonic() + 10, lambda: {}["missing"])

    def test_a_job_past_the_deadline_goes_on_alone(self) -> None:
        """A deadline already passed: ``(False, None)`` at once, the job still running."""
        release = threading.Event()
        assert before(time.monotonic() - 1, lambda: release.wait(10)) == (False, None)
        release.set()


class _Node:
    def __init__(self, name: str) -> None:
        self.name = name


class _TwoNodes:
    """A cluster client's routing as the fan-out reads it: a key's node is its first letter,
    and that node's client is its name."""

    nodes_manager = None  # no slot refresh to request or run

    def get_node_from_key(self, key: str) -> _Node:
        return _Node(key[0])

    def get_redis_connection(self, node: _Node) -> str:
        return node.name


class TestEveryNodeWaitedFor:
    def test_a_reader_asking_for_every_node_gets_the_answer_of_one_that_timed_out_before(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Node b timed out in one batch and answers the next one after node a: a read that
        waits for every node (``list``) gets b's answers, not a timeout error in their place."""
        from celery_lease.stores import _redis_cluster
        from celery_lease.stores._redis_common import INSPECT

        b_may_answer = threading.Event()
        b_timed_out: list[bool] = []

        def pipelined(node: str, script: object, calls: list[object], **_: object) -> object:
            if node == "b":
                if not b_timed_out:
                    b_timed_out.append(True)
                    raise RedisTimeoutError("injected: node b hung")
                assert b_may_answer.wait(10)
            return [f"{node} answered"] * len(calls), None

        real_start = _redis_cluster._start

        class JoinLetsBAnswer:
            """A share's thread whose join lets node b answer first (b ends while joined)."""

            def __init__(self, thread: threading.Thread | None) -> None:
                self.thread = thread

            def join(self) -> None:
                b_may_answer.set()
                if self.thread is not None:
                    self.thread.join()

        def start(target: Any, name: str) -> JoinLetsBAnswer:
            return JoinLetsBAnswer(real_start(target, name))

        monkeypatch.setattr(_redis_cluster, "pipelined", pipelined)
        monkeypatch.setattr(_redis_cluster, "_start", start)
        fan = _redis_cluster.ClusterFanOut(
            cast(Any, _TwoNodes()), 1.0, lambda *a: None, lambda: "test", str
        )
        calls: Any = [(("a1",), ()), (("b1",), ())]
        try:
            first = fan.eval_many(INSPECT, calls)
            assert isinstance(first[1], RedisTimeoutError)
            b_may_answer.clear()  # the first batch's join set it
            assert fan.eval_many(INSPECT, calls, every_node=True) == [
                "a answered",
                "b answered",
            ]
        finally:
            b_may_answer.set()
