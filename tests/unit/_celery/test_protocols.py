"""The structural types of the Celery layer name only what Celery's real objects have, and the
store capability checks answer for real stores and for objects that lack the capability."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest
from celery import Celery
from celery.app.task import Context
from celery.signals import task_success

from celery_lease import LockedTask, MemoryLockStore
from celery_lease._celery import protocols, wiring

wiring.install()  # the lock attributes on Context, as the task layer's import installs them


def _members(protocol: type) -> set[str]:
    """The attributes and methods a protocol class names (its own, not ``Protocol``'s)."""
    names = set(getattr(protocol, "__annotations__", {}))
    names.update(name for name in vars(protocol) if not name.startswith("_"))
    return names


def _missing(obj: object, protocol: type) -> set[str]:
    return {name for name in _members(protocol) if not hasattr(obj, name)}


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("protocols", set_as_current=False)
    app.conf.result_backend = "cache+memory://"
    yield app
    app.close()


class TestCeleryHasWhatTheProtocolsName:
    def test_a_task_has_every_member_of_celery_task(self, app: Celery) -> None:
        """A bound task has the name, app, backend, options and calls CeleryTask names."""

        @app.task(shared=False)
        def add(x: int) -> int:
            return x

        assert _missing(add, protocols.CeleryTask) == set()
        retry = inspect.signature(add.retry).parameters
        assert {"args", "kwargs", "exc", "throw", "eta", "countdown", "max_retries"} <= set(retry)

    def test_a_locked_task_has_every_member_of_unique_task(self, app: Celery) -> None:
        """A LockedTask also has the publish that unique's code calls past its checks."""

        @app.task(shared=False, base=LockedTask, lock_key="k")
        def add(x: int) -> int:
            return x

        assert _missing(add, protocols.UniqueTask) == set()

    def test_a_request_has_every_member_of_task_request(self) -> None:
        """Celery's Context defines every attribute TaskRequest names (as class defaults)."""
        assert _missing(Context(), protocols.TaskRequest) == set()

    def test_the_request_stack_has_a_top(self, app: Celery) -> None:
        """``task.request_stack`` answers ``top``, None outside an execution."""

        @app.task(shared=False)
        def add(x: int) -> int:
            return x

        assert _missing(add.request_stack, protocols.RequestStack) == set()
        assert add.request_stack.top is None

    def test_the_app_and_its_conf_have_every_member_named(self, app: Celery) -> None:
        """The app has ``conf`` and ``steps``; ``app.conf`` reads ``task_always_eager``."""
        assert _missing(app, protocols.CeleryApp) == set()
        assert _missing(app.conf, protocols.AppConf) == set()

    def test_a_result_backend_and_a_result_have_every_member_named(self, app: Celery) -> None:
        """The backend reads and stores states; a result has its id."""
        assert _missing(app.backend, protocols.ResultBackend) == set()
        revoked = inspect.signature(app.backend.mark_as_revoked).parameters
        assert {"reason", "request", "store_result"} <= set(revoked)
        assert _missing(app.AsyncResult("some-id"), protocols.AsyncResultLike) == set()

    def test_a_signature_from_a_request_has_args_kwargs_and_options(self, app: Celery) -> None:
        """``signature_from_request`` gives what a re-send reads."""

        @app.task(shared=False)
        def add(x: int) -> int:
            return x

        request = Context(id="some-id", args=(1,), kwargs={}, delivery_info={})
        signature = add.signature_from_request(request, countdown=1, expires=None, headers={})
        assert _missing(signature, protocols.TaskSignature) == set()

    def test_a_signal_has_receivers(self) -> None:
        """A Celery signal lists its receivers."""
        assert _missing(task_success, protocols.SignalLike) == set()

    def test_the_app_has_a_task_registry(self, app: Celery) -> None:
        """``app.tasks`` maps each task's name to the task."""

        @app.task(shared=False)
        def add(x: int) -> int:
            return x

        assert app.tasks[add.name].name == add.name

    def test_a_request_carries_the_lock_attributes(self) -> None:
        """Once the task layer is imported, Celery's Context defines the lock attributes with
        their unset values, and the retries and hostname TaskRequest reads."""
        context = Context()
        assert (context.lock_key, context.lock_token, context.lock_waited, context.lease) == (
            None,
            None,
            False,
            None,
        )
        assert context._lease_run is None
        assert (context.retries, context.hostname) == (0, None)

    def test_the_task_stack_pushes_and_pops(self) -> None:
        """The stack ``current_task`` reads has ``push`` and ``pop``."""
        from celery import _state

        assert _missing(_state._task_stack, protocols.TaskStack) == set()

    def test_a_worker_has_every_member_of_worker_like(
        self, app: Celery, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A built (not started) worker has its app, node name, pool class, concurrency and
        pool."""
        from celery import _state

        from celery_lease._celery import worker

        monkeypatch.setattr(worker, "_main_pid", None)
        blocks = _state.task_join_will_block()
        try:
            controller = app.WorkController(pool_cls="threads", concurrency=2, without_mingle=True)
        finally:
            _state._set_task_join_will_block(blocks)  # the Pool step sets it for its pool
        assert _missing(controller, protocols.WorkerLike) == set()
        assert controller.concurrency == 2

    def test_a_worker_request_has_every_member_named(self) -> None:
        """Celery's worker Request defines the id, name, child pid and task WorkerRequest
        names (as properties)."""
        from celery.worker.request import Request

        assert _missing(Request, protocols.WorkerRequest) == set()

    def test_billiard_has_every_member_of_its_protocols(self) -> None:
        """billiard's pool (and Celery's AsynPool), a child process and a job have what the
        dead-holder reaper reads."""
        import billiard
        from billiard.pool import ApplyResult, Pool
        from celery.concurrency.asynpool import AsynPool

        assert _missing(Pool, protocols.BilliardPool) == set()
        assert _missing(AsynPool, protocols.BilliardPool) == set()
        assert _missing(ApplyResult, protocols.PoolJob) == set()
        process = billiard.Process()  # not started: no pid, no exit code yet
        assert _missing(process, protocols.PoolProcess) == set()
        assert (process.pid, process.exitcode) == (None, None)

    def test_the_event_loop_has_every_member_named(self) -> None:
        """kombu's Hub watches file descriptors and runs timers."""
        from kombu.asynchronous.hub import Hub

        assert _missing(Hub, protocols.EventLoopHub) == set()

    def test_the_member_check_can_fail(self) -> None:
        """An object without the members is reported missing them."""
        assert _missing(object(), protocols.CeleryApp) == {"conf", "steps", "tasks"}


class _Anything:
    """No store at all."""


class TestCapabilityChecks:
    def test_the_memory_store_is_inspectable_and_defers_nothing(self) -> None:
        """The memory store reads a key's holder but sends nothing without waiting."""
        store = MemoryLockStore()
        assert protocols.is_inspectable(store)
        assert not protocols.can_release_deferred(store)
        assert not protocols.can_renew_deferred(store)

    def test_the_redis_store_can_do_all_three(self) -> None:
        """The Redis store (not connected: a check reads its class) inspects and defers."""
        pytest.importorskip("redis")
        from celery_lease.stores.redis import RedisLockStore

        store = RedisLockStore("redis://127.0.0.1:1/0")
        assert protocols.is_inspectable(store)
        assert protocols.can_release_deferred(store)
        assert protocols.can_renew_deferred(store)

    def test_an_object_that_is_no_store_can_do_none(self) -> None:
        """An object without the methods is refused by every check."""
        thing = _Anything()
        assert not protocols.is_inspectable(thing)
        assert not protocols.can_release_deferred(thing)
        assert not protocols.can_renew_deferred(thing)

    def test_half_a_capability_is_none(self) -> None:
        """``release_deferred`` without ``flush_deferred`` is not a deferred release."""

        class HalfDeferring(MemoryLockStore):
            def release_deferred(self, key: str, owner: str) -> bool:
                return False

        assert not protocols.can_release_deferred(HalfDeferring())
