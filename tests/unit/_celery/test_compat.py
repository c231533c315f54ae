"""The reaches into Celery's and billiard's internals: each still finds what it relies on in the
installed versions, and no other module of the package makes one."""

from __future__ import annotations

import ast
import gc
import inspect
import weakref
from pathlib import Path
from typing import Any

import billiard.pool
import celery._state
import pytest
from celery import Celery
from celery.backends.base import KeyValueStoreBackend
from celery.concurrency.asynpool import AsynPool
from celery.utils.dispatch import Signal
from celery.worker.request import Request

from celery_lease._celery import compat
from tests.support import CELERY_MINOR, needs_celery_pydantic

PACKAGE = Path(compat.__file__).resolve().parents[1]

INTERNAL_MODULES = ("billiard", "celery._state", "celery.app.base", "celery.worker.state")


def _internal(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in INTERNAL_MODULES)


class TestOneModule:
    def test_no_other_module_imports_celery_or_billiard_internals(self) -> None:
        """billiard, ``celery._state``, ``celery.app.base`` and ``celery.worker.state`` are
        imported by compat only (the check can fail: compat itself is found)."""
        importers = set()
        for path in PACKAGE.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                elif isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                else:
                    continue
                if any(_internal(name) for name in names):
                    importers.add(path.relative_to(PACKAGE).as_posix())
        assert importers == {"_celery/compat.py"}


class TestCeleryState:
    def test_the_task_stack_is_what_current_task_reads(self) -> None:
        """A task pushed on the stack is the current task until it is popped."""
        app = Celery("compat", broker="memory://", set_as_current=False)

        @app.task(shared=False)
        def noop() -> None:
            pass

        assert compat.task_stack is celery._state._task_stack
        compat.task_stack.push(noop)
        try:
            assert compat.get_current_task() is noop
        finally:
            compat.task_stack.pop()
        assert compat.get_current_task() is not noop

    def test_the_current_app_is_celerys(self) -> None:
        assert compat.get_current_app() is celery._state.get_current_app()

    def test_the_ignore_result_helper_is_found_where_celery_has_it(self) -> None:
        """Celery 5.6.3 and later have the per-request rule (in celery.app.trace, from 5.7 in
        celery.app.task); the callers' fallback is for the releases before (5.4 to 5.6.2)."""
        import celery.app.task
        import celery.app.trace

        has = any(
            hasattr(module, "get_actual_ignore_result")
            for module in (celery.app.task, celery.app.trace)
        )
        assert (compat.get_actual_ignore_result is not None) == has
        if CELERY_MINOR >= (5, 7):
            assert has


class TestPydanticWrapper:
    @needs_celery_pydantic
    def test_the_closure_of_celerys_wrapper_is_read(self) -> None:
        """``pydantic=True``: the wrapper is recognised and its free variables read."""
        pytest.importorskip("pydantic")
        app = Celery("compat", broker="memory://", set_as_current=False)

        @app.task(shared=False, pydantic=True)
        def typed(n: int) -> int:
            return n

        run = inspect.getattr_static(type(typed._get_current_object()), "run")
        free = compat.pydantic_wrapper_closure(getattr(run, "__func__", run))
        assert free is not None
        assert {"task_fun", "task_signature"} <= set(free)

    def test_any_other_function_is_not_the_wrapper(self) -> None:
        def wrapper(task_fun: Any) -> Any:
            return task_fun

        assert compat.pydantic_wrapper_closure(wrapper) is None
        assert compat.pydantic_wrapper_closure(len) is None


class TestSignals:
    def test_dead_weak_receivers_are_left_out(self) -> None:
        """Strong receivers as they are, weak ones dereferenced, dead ones skipped."""
        signal = Signal(name="compat_probe")

        def strong(**_: Any) -> None:
            pass

        class Holder:
            def weak(self, **_: Any) -> None:
                pass

        holder = Holder()
        signal.connect(strong, weak=False)
        signal.connect(holder.weak)
        assert set(compat.live_receivers(signal)) == {strong, holder.weak}
        ref = weakref.ref(holder)
        del holder
        gc.collect()
        assert ref() is None
        assert compat.live_receivers(signal) == [strong]

    def test_a_collected_weak_receiver_is_flagged_until_swept(self) -> None:
        signal = Signal(name="compat_probe_dead")

        def weak(**_: Any) -> None:
            pass

        signal.connect(weak)
        flags = [compat.may_have_dead_receivers(signal)]
        del weak
        gc.collect()
        flags.append(compat.may_have_dead_receivers(signal))
        signal.send(sender=None)  # sweeps the dead entry
        flags.append(compat.may_have_dead_receivers(signal))
        assert flags == [False, True, False]
        assert not compat.may_have_dead_receivers(Signal(name="compat_probe_fresh"))


class TestPoolInternals:
    def test_billiards_pool_has_what_the_reaper_wraps(self) -> None:
        """The methods the reaper replaces on the instance exist on billiard's and Celery's
        pools; the exit code of a recycled child is billiard's."""
        assert callable(billiard.pool.Pool._join_exited_workers)
        assert callable(billiard.pool.Pool.mark_as_worker_lost)
        assert callable(AsynPool._event_process_exit)
        assert compat.EX_RECYCLE == billiard.pool.EX_RECYCLE

    def test_replaced_methods_are_read_back(self) -> None:
        """A pool object as the reaper sees it: children, jobs, the wrapped methods."""

        class Job:
            correlation_id = "t1"
            _write_to = type("P", (), {"pid": 12})()
            _scheduled_for = None

            def worker_pids(self) -> list[int]:
                return [11, 0]

        class Pool:
            def __init__(self) -> None:
                self._pool: list[Any] = ["child"]
                self._cache = {1: Job()}

            def _join_exited_workers(self) -> str:
                return "joined"

            def mark_as_worker_lost(self, job: Any, exitcode: int) -> None:
                pass

        pool = Pool()
        assert compat.reapable(pool)
        assert compat.child_processes(pool) == ["child"]
        assert compat.child_processes(object()) is None
        assert compat.join_exited_workers(pool)() == "joined"
        compat.set_join_exited_workers(pool, lambda: "wrapped")
        assert compat.join_exited_workers(pool)() == "wrapped"
        assert compat.event_process_exit(pool) is None
        compat.set_event_process_exit(pool, len)
        assert compat.event_process_exit(pool) is len
        [job] = compat.pool_jobs(pool)
        assert compat.job_pids(job) == {11, 12}
        assert compat.pool_jobs(object()) == []
        assert compat.billiard_pool(type("TaskPool", (), {"_pool": pool})()) is pool
        assert not compat.reapable(object())


class TestWorkerRequests:
    def test_requests_carry_the_attributes_read(self) -> None:
        """celery's Request defines the job reference and the cancelled flag; unset, they read
        as no job and not cancelled."""
        assert Request._apply_result is None
        assert Request._already_cancelled is False

        class Plain:
            pass

        assert compat.request_job(Plain()) is None
        assert compat.request_cancelled(Plain()) is False

    def test_the_backend_reads_a_tasks_meta_uncached(self) -> None:
        assert callable(KeyValueStoreBackend._get_task_meta_for)
        assert compat.task_meta_reader(object()) is None

    def test_the_worker_requests_are_its_active_and_reserved_ones(self) -> None:
        assert isinstance(compat.worker_requests(), list)
