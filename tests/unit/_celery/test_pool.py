"""The pool of this process's worker: how many processes run tasks, and whether executions of
this process run one at a time."""

from __future__ import annotations

import pytest
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.concurrency.solo import TaskPool as SoloPool
from celery.concurrency.thread import TaskPool as ThreadPool

from celery_lease._celery import pool


class TestPoolProcesses:
    @pytest.mark.parametrize("pool_cls", [SoloPool, ThreadPool])
    def test_a_pool_running_tasks_in_the_main_process_counts_one(self, pool_cls: type) -> None:
        """solo and threads run every task in the main process, whatever ``-c`` says."""
        assert pool.pool_processes(pool_cls, 8) == 1
        assert pool.runs_tasks_in_main_process(pool_cls)

    def test_a_subclass_of_an_in_process_pool_counts_one(self) -> None:
        """A project's own pool derived from solo runs its tasks where solo does."""

        class MyPool(SoloPool):  # type: ignore[misc]
            pass

        assert pool.pool_processes(MyPool, 4) == 1

    @pytest.mark.parametrize(
        ("concurrency", "autoscale", "processes"),
        [(4, None, 4), (0, None, 1), (2, "10,3", 10), (2, (6, 1), 6), (8, "3,1", 8)],
    )
    def test_prefork_counts_concurrency_or_the_autoscale_maximum(
        self, concurrency: int, autoscale: object, processes: int
    ) -> None:
        """prefork: the larger of ``-c`` and the ``--autoscale`` maximum."""
        assert not pool.runs_tasks_in_main_process(PreforkPool)
        assert pool.pool_processes(PreforkPool, concurrency, autoscale) == processes

    def test_pool_names(self) -> None:
        """Celery's pools by their module's last part; any other by its repr."""

        class Other:
            pass

        assert pool.pool_name(PreforkPool) == "prefork"
        assert pool.pool_name(ThreadPool) == "thread"
        assert pool.pool_name(Other) == repr(Other)


class TestOneTaskAtATime:
    @pytest.mark.parametrize(
        ("label", "child", "one"),
        [
            ("solo", False, True),
            ("prefork", True, True),
            ("prefork", False, False),
            ("thread", False, False),
            ("", False, False),
        ],
    )
    def test_only_solo_and_prefork_children_run_one_task_at_a_time(
        self, monkeypatch: pytest.MonkeyPatch, label: str, child: bool, one: bool
    ) -> None:
        """As the pool label and the pool-child flag were set by the worker's hooks."""
        monkeypatch.setattr(pool, "_pool_label", "")
        monkeypatch.setattr(pool, "_pool_child", False)
        pool.set_pool_label(label)
        pool.set_pool_child(child)
        assert (pool.pool_label(), pool.in_pool_child()) == (label, child)
        assert pool.runs_one_task_at_a_time() is one
