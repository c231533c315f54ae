"""Which worker executions send their release without waiting for its reply, and the order.

A LockedTask whose success publishes nothing (result ignored, no chord, no ``on_success`` /
``after_return`` of the user's, no foreign ``task_success`` / ``task_postrun`` receiver) hands
its release to a store that supports deferral; every other execution releases and waits as
before. Whatever this process publishes afterwards (a callback, a chain step, ``delay()``) is
published only after the deferred replies were read. Each execution here is traced by Celery's
own tracer with a worker's request, as ``fast_trace_task`` runs it in a worker.
"""

from __future__ import annotations

import gc
import uuid
import weakref
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest
from celery import Celery
from celery.app.trace import build_tracer
from celery.backends.base import KeyValueStoreBackend
from celery.signals import after_task_publish, task_postrun, task_success
from celery.utils.dispatch import Signal

from celery_lease import LeaseConfigError, LockedTask, MemoryLockStore, locked
from celery_lease import signals as lease_signals
from celery_lease._celery import compat, deferral
from celery_lease._celery import pool as pool_module
from celery_lease._celery import settings as lease_config
from celery_lease.stores.base import SupportsDeferredRelease


class DeferringStore(MemoryLockStore):
    """A memory store that also offers deferred releases and records every call in ``log``."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log
        self.unread: list[tuple[str, str]] = []
        self.accept = True

    def release(self, key: str, owner: str) -> None:
        self.log.append(f"release {key}")
        super().release(key, owner)

    def release_deferred(self, key: str, owner: str) -> bool:
        if not self.accept:
            return False
        self.log.append(f"deferred {key}")
        self.unread.append((key, owner))
        return True

    def flush_deferred(self) -> None:
        if self.unread:
            self.log.append("flush")
        while self.unread:
            super().release(*self.unread.pop(0))


@pytest.fixture
def log() -> list[str]:
    return []


@pytest.fixture
def store(log: list[str]) -> Iterator[DeferringStore]:
    made = DeferringStore(log)
    yield made
    deferral.deferring.pop(id(made), None)


def _ours(entry: tuple[Any, Any]) -> bool:
    receiver = entry[1]
    if isinstance(receiver, weakref.ReferenceType):
        receiver = receiver()
    return (getattr(receiver, "__module__", None) or "").startswith("celery_lease.")


@pytest.fixture(autouse=True)
def only_our_receivers() -> Iterator[None]:
    """Receivers other test modules connect for good (a lock_released recorder connected at
    import) would each, rightly, make the engine wait: these tests start with celery-lease's
    own receivers only, and connect the foreign ones they mean; all come back afterwards."""
    signals = (task_postrun, task_success, lease_signals.lock_released)
    saved = [list(signal.receivers) for signal in signals]
    for signal in signals:
        signal.receivers[:] = [entry for entry in signal.receivers if _ours(entry)]
        signal.sender_receivers_cache.clear()
    yield
    for signal, receivers in zip(signals, saved, strict=True):
        signal.receivers[:] = receivers
        signal.sender_receivers_cache.clear()


@pytest.fixture(autouse=True)
def solo_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a solo worker's process (one task at a time): see TestPools for the others."""
    monkeypatch.setattr(pool_module, "_pool_label", "solo")


@pytest.fixture
def app(store: DeferringStore) -> Iterator[Celery]:
    made = Celery("deferred", broker="memory://", set_as_current=False)
    made.conf.update(task_ignore_result=True, lease_store=store)
    yield made
    lease_config.reset(made)


def _message(task: Any, task_id: str, args: tuple[Any, ...], **request: Any) -> dict[str, Any]:
    """A delivered message's request for ``task``, as a worker's tracer gets it."""
    return {
        "id": task_id,
        "task": task.name,
        "args": args,
        "kwargs": {},
        "delivery_info": {"exchange": "", "routing_key": "celery"},
        "hostname": "test@host",
        "is_eager": False,
        **request,
    }


def traced(app: Celery, task: Any) -> Callable[..., Any]:
    """Run ``task`` as a worker does: Celery's tracer, a request from a delivered message."""
    trace = build_tracer(task.name, task, app.loader, "test@host", app=app)

    def run(*args: Any, **request: Any) -> Any:
        task_id = str(uuid.uuid4())
        return trace(task_id, args, {}, _message(task, task_id, args, **request))

    return run


def traced_id(app: Celery, task: Any, *args: Any) -> str:
    """:func:`traced` with a task id of the test's, returned."""
    task_id = str(uuid.uuid4())
    trace = build_tracer(task.name, task, app.loader, "test@host", app=app)
    trace(task_id, args, {}, _message(task, task_id, args))
    return task_id


def released(log: list[str]) -> list[str]:
    return [line for line in log if line.startswith(("release", "deferred"))]


class TestWhichExecutionsDefer:
    def test_a_task_that_publishes_nothing_defers(
        self, app: Celery, store: DeferringStore, log: list[str]
    ) -> None:
        """Result ignored, no hooks, no callbacks: the release goes out deferred; the store's
        next flush frees the key."""

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False)
        def quiet(n: int) -> None:
            return None

        traced(app, quiet)(1)
        assert released(log) == ["deferred k:1"]
        assert store.get("k:1") is not None  # not read yet: this fake applies it at the flush
        deferral.flush_deferred_releases()
        assert store.get("k:1") is None

    def test_a_stored_result_waits_for_the_reply(self, app: Celery, log: list[str]) -> None:
        """A task whose result is stored releases and waits: the result must not be visible
        while the key is still held."""

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False, ignore_result=False)
        def stored(n: int) -> None:
            return None

        traced(app, stored)(2)
        assert released(log) == ["release k:2"]

    def test_a_request_asking_for_its_result_waits(self, app: Celery, log: list[str]) -> None:
        """``apply_async(ignore_result=False)`` on an ignoring task: from Celery 5.6.3 the
        request wins and the result is stored (so the release waits); Celery 5.4 to 5.6.2 store
        no result of a task that ignores it, whatever the request says (so it goes out
        deferred)."""

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False)
        def asked(n: int) -> None:
            return None

        traced(app, asked)(3, ignore_result=False)
        stored = compat.get_actual_ignore_result is not None  # the releases with the rule
        assert released(log) == (["release k:3"] if stored else ["deferred k:3"])

    def test_a_request_ignoring_its_result_defers(self, app: Celery, log: list[str]) -> None:
        """``apply_async(ignore_result=True)`` on a task that stores results: nothing is stored,
        on every Celery, so the release goes out deferred."""

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False, ignore_result=False)
        def unasked(n: int) -> None:
            return None

        traced(app, unasked)(4, ignore_result=True)
        assert released(log) == ["deferred k:4"]

    def test_a_chord_member_waits(self, app: Celery, log: list[str]) -> None:
        """A chord header task counts its part in the backend after the body: no deferral."""

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False)
        def part(n: int) -> None:
            return None

        # The memory backend has no chord support: Celery logs that failure after the release.
        traced(app, part)(4, chord={"task": "x", "options": {}, "subtask_type": None})
        assert released(log) == ["release k:4"]

    def test_a_user_on_success_waits(self, app: Celery, log: list[str]) -> None:
        """A task class of the user's with ``on_success`` runs user code after the body."""

        class Notifying(LockedTask):
            abstract = True

            def on_success(self, retval: Any, task_id: str, args: Any, kwargs: Any) -> None:
                log.append("on_success")

        @app.task(base=Notifying, lock_key="k:{n}", shared=False)
        def hooked(n: int) -> None:
            return None

        traced(app, hooked)(5)
        assert released(log) == ["release k:5"]
        assert log[-1] == "on_success"

    @pytest.mark.parametrize("signal", [task_postrun, task_success], ids=["postrun", "success"])
    def test_a_foreign_receiver_makes_it_wait(
        self, app: Celery, log: list[str], signal: Any
    ) -> None:
        """A task_postrun / task_success receiver that is not celery-lease's runs user code
        after the body: no deferral while it is connected, deferral again once it is gone."""

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False)
        def watched(n: int) -> None:
            return None

        def receiver(**_: Any) -> None:
            log.append("receiver")

        run = traced(app, watched)
        signal.connect(receiver, weak=False)
        try:
            run(6)
        finally:
            signal.disconnect(receiver)
        run(7)
        assert released(log) == ["release k:6", "deferred k:7"]

    @pytest.mark.parametrize("signal", [task_postrun, task_success], ids=["postrun", "success"])
    def test_a_receiver_connected_after_deferred_runs_makes_the_next_wait(
        self, app: Celery, log: list[str], signal: Any
    ) -> None:
        """The decision follows the receivers between two executions of one worker process."""

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False)
        def watched(n: int) -> None:
            return None

        def receiver(**_: Any) -> None:
            log.append("receiver")

        run = traced(app, watched)
        run(1)
        signal.connect(receiver, weak=False)
        try:
            run(2)
        finally:
            signal.disconnect(receiver)
        run(3)
        assert released(log) == ["deferred k:1", "release k:2", "deferred k:3"]

    def test_eager_runs_wait(self, app: Celery, log: list[str]) -> None:
        """``apply()`` (eager) returns to the caller, who may go on at once: no deferral."""

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False)
        def eager(n: int) -> None:
            return None

        eager.apply((8,))
        assert released(log) == ["release k:8"]

    def test_a_failure_waits(self, app: Celery, log: list[str]) -> None:
        """Only a success is deferred: a failure may be stored (store_errors_even_if_ignored)."""

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False)
        def failing(n: int) -> None:
            raise ValueError(n)

        traced(app, failing)(9)
        assert released(log) == ["release k:9"]

    def test_a_nested_helper_waits(self, app: Celery, log: list[str]) -> None:
        """A ``@locked`` helper called inside a body releases before the body goes on."""

        @locked(key="inner:{n}")
        def helper(n: int) -> None:
            return None

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False)
        def outer(n: int) -> None:
            helper(n)
            log.append("body goes on")

        traced(app, outer)(10)
        assert log.index("release inner:10") < log.index("body goes on")
        assert released(log)[-1] == "deferred k:10"

    def test_the_setting_turns_it_off(self, app: Celery, log: list[str]) -> None:
        """``lease_defer_release = False``: every release waits for its reply."""
        app.conf.lease_defer_release = False
        lease_config.reset(app)

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False)
        def plain(n: int) -> None:
            return None

        traced(app, plain)(11)
        assert released(log) == ["release k:11"]

    def test_a_bad_setting_is_refused_by_name(self, app: Celery) -> None:
        app.conf.lease_defer_release = "yes"
        lease_config.reset(app)
        with pytest.raises(LeaseConfigError, match=r"lease_defer_release='yes'.*True or False"):
            lease_config.get_settings(app)

    def test_a_store_that_declines_releases_the_usual_way(
        self, app: Celery, store: DeferringStore, log: list[str]
    ) -> None:
        """release_deferred False (the connection is busy): the usual release, waited for."""
        store.accept = False

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False)
        def declined(n: int) -> None:
            return None

        traced(app, declined)(12)
        assert released(log) == ["release k:12"]
        assert store.get("k:12") is None


class TestReceiversChangedBetweenTasks:
    @pytest.mark.parametrize(
        "signal",
        [task_success, task_postrun, lease_signals.lock_released],
        ids=["task_success", "task_postrun", "lock_released"],
    )
    def test_each_change_of_a_receiver_applies_to_the_next_task(
        self, app: Celery, log: list[str], signal: Signal
    ) -> None:
        """A foreign receiver connected, disconnected, or weakly held and collected (not yet
        swept from the list) between two tasks decides the next task's release."""

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False)
        def quiet(n: int) -> None:
            return None

        run = traced(app, quiet)

        def foreign(**_: Any) -> None:
            pass

        run(1)
        signal.connect(foreign, weak=False, dispatch_uid="myapp.strong")
        run(2)
        signal.disconnect(dispatch_uid="myapp.strong")
        run(3)
        signal.connect(foreign, dispatch_uid="myapp.weak")  # weak, the default
        run(4)
        del foreign
        gc.collect()
        run(5)
        assert released(log) == [
            "deferred k:1",
            "release k:2",
            "deferred k:3",
            "release k:4",
            "deferred k:5",
        ]


class RecordingBackend(KeyValueStoreBackend):
    """A key-value result backend in memory, Celery's write path unchanged: each write logs
    ``write`` and whether the lease key ``k:<n>`` of that task was still held in ``store``."""

    def __init__(self, app: Celery, log: list[str], store: DeferringStore, **kwargs: Any) -> None:
        super().__init__(app=app, **kwargs)
        self.log, self.store, self.data = log, store, {}
        self.held_at_write: list[bool] = []

    def get(self, key: Any) -> Any:
        return self.data.get(key)

    def mget(self, keys: Any) -> list[Any]:
        return [self.data.get(key) for key in keys]

    def set(self, key: Any, value: Any) -> None:
        self.log.append("write")
        self.held_at_write.append(any(self.store.list()))
        self.data[key] = value

    def delete(self, key: Any) -> None:
        self.data.pop(key, None)


class UnbuildableBackend(KeyValueStoreBackend):
    """A result backend whose construction fails (a bad option, a missing client library)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("result backend misconfigured")


class OwnWriteBackend(RecordingBackend):
    """A key-value backend whose ``_store_result`` is its own: its write path is not Celery's."""

    def _store_result(self, task_id: Any, result: Any, state: Any, *args: Any, **kw: Any) -> Any:
        self.set(self.get_key_for_task(task_id), self.encode({"result": result}))
        return result


class TestAStoredResultIsWrittenAfterTheReply:
    """With a key-value result backend whose write path is Celery's own, the release of a task
    whose result is stored goes out without waiting, and the reply is read just before the
    result is written (after the backend built the result and read the task's state)."""

    def test_the_reply_is_read_before_the_write(
        self, app: Celery, store: DeferringStore, log: list[str]
    ) -> None:
        backend = RecordingBackend(app, log, store)

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False, ignore_result=False)
        def stored(n: int) -> int:
            return n * 2

        stored.backend = backend
        result_id = traced_id(app, stored, 40)
        assert log == ["deferred k:40", "flush", "write"]
        assert backend.held_at_write == [False]
        assert backend.get_result(result_id) == 80

    def test_a_backend_with_its_own_write_path_waits(
        self, app: Celery, store: DeferringStore, log: list[str]
    ) -> None:
        backend = OwnWriteBackend(app, log, store)

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False, ignore_result=False)
        def stored(n: int) -> int:
            return n

        stored.backend = backend
        traced(app, stored)(41)
        assert log == ["release k:41", "write"]
        assert backend.held_at_write == [False]

    def test_a_failure_is_written_after_a_waited_release(
        self, app: Celery, store: DeferringStore, log: list[str]
    ) -> None:
        backend = RecordingBackend(app, log, store)

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False, ignore_result=False)
        def failing(n: int) -> None:
            raise ValueError(n)

        failing.backend = backend
        traced(app, failing)(42)
        assert log == ["release k:42", "write"]
        assert backend.held_at_write == [False]

    def test_a_backend_that_cannot_be_built_still_lets_the_key_go(
        self, app: Celery, store: DeferringStore, log: list[str]
    ) -> None:
        """The backend is built lazily and fails: the release goes out and waits, as before."""
        app.conf.result_backend = f"{__name__}:UnbuildableBackend"

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False, ignore_result=False)
        def stored(n: int) -> int:
            return n

        with pytest.raises(RuntimeError, match="misconfigured"):  # Celery's, storing the result
            traced(app, stored)(45)
        assert released(log) == ["release k:45"]
        assert store.get("k:45") is None

    def test_a_stand_in_backend_is_not_taken_for_one_that_reads_first(
        self, app: Celery, log: list[str]
    ) -> None:
        """A mock (or a proxy whose ``__getattr__`` answers anything) is not Celery's write
        path, whatever attribute it seems to have."""

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False, ignore_result=False)
        def stored(n: int) -> int:
            return n

        stored.backend = mock.MagicMock()
        traced(app, stored)(46)
        assert released(log) == ["release k:46"]

    @pytest.mark.parametrize("replaced", ["store_result", "_store_result", "mark_as_done"])
    def test_a_write_path_replaced_on_the_instance_waits(
        self, app: Celery, store: DeferringStore, log: list[str], replaced: str
    ) -> None:
        """Instrumentation that replaces a step of the write path on the backend instance
        may write without ``_set_with_state``: the release waits."""
        backend = RecordingBackend(app, log, store)
        setattr(backend, replaced, getattr(backend, replaced))

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False, ignore_result=False)
        def stored(n: int) -> int:
            return n

        stored.backend = backend
        traced(app, stored)(47)
        assert log == ["release k:47", "write"]

    def test_every_write_of_the_backend_reads_the_replies_first(
        self, app: Celery, store: DeferringStore, log: list[str]
    ) -> None:
        """Two tasks on one backend, the second ignoring its result: its release is read
        before the backend's next write, whoever writes."""
        backend = RecordingBackend(app, log, store)

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False, ignore_result=False)
        def stored(n: int) -> int:
            return n

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False)
        def quiet(n: int) -> None:
            return None

        stored.backend = quiet.backend = backend
        traced(app, stored)(43)
        traced(app, quiet)(44)
        backend.store_result("other", 1, "SUCCESS")
        assert log == ["deferred k:43", "flush", "write", "deferred k:44", "flush", "write"]
        assert backend.held_at_write == [False, False]


class TestPools:
    @pytest.mark.parametrize(
        ("pool", "child", "defers"),
        [
            ("solo", False, True),
            ("prefork", True, True),
            ("prefork", False, False),  # the main process runs no task; never here anyway
            ("thread", False, False),
            ("gevent", False, False),
            ("eventlet", False, False),
            ("", False, False),  # outside a worker
        ],
    )
    def test_only_processes_that_run_one_task_at_a_time_defer(
        self,
        app: Celery,
        log: list[str],
        monkeypatch: pytest.MonkeyPatch,
        pool: str,
        child: bool,
        defers: bool,
    ) -> None:
        """Where executions run side by side, the next one may acquire the same key through
        another connection before the server read the release: no deferral there."""
        monkeypatch.setattr(pool_module, "_pool_label", pool)
        monkeypatch.setattr(pool_module, "_pool_child", child)

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False)
        def pooled(n: int) -> None:
            return None

        traced(app, pooled)(30)
        assert released(log) == ["deferred k:30" if defers else "release k:30"]

    def test_a_lock_released_receiver_of_the_users_makes_it_wait(
        self, app: Celery, log: list[str]
    ) -> None:
        """lock_released means "the key is free": a user receiver must find it so."""

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False)
        def told(n: int) -> None:
            return None

        def receiver(**_: Any) -> None:
            log.append("told")

        lease_signals.lock_released.connect(receiver, weak=False)
        try:
            traced(app, told)(31)
        finally:
            lease_signals.lock_released.disconnect(receiver)
        assert released(log) == ["release k:31"]


class TestNothingIsPublishedBeforeTheReply:
    @pytest.fixture
    def published(self, log: list[str]) -> Iterator[None]:
        def note(sender: Any = None, **_: Any) -> None:
            log.append(f"published {sender}")

        after_task_publish.connect(note, weak=False)
        yield
        after_task_publish.disconnect(note)

    def test_a_link_callback_leaves_after_the_flush(
        self, app: Celery, log: list[str], published: None
    ) -> None:
        """The body's callback is published by Celery after the body: the deferred reply is
        read first, so whoever runs the callback finds the key free."""

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False)
        def first(n: int) -> None:
            return None

        @app.task(name="t.callback", shared=False)
        def callback(_: Any) -> None:
            return None

        traced(app, first)(20, callbacks=[callback.s().set(immutable=False)])
        assert log.index("deferred k:20") < log.index("flush") < log.index("published t.callback")

    def test_a_later_delay_leaves_after_the_flush(
        self, app: Celery, log: list[str], published: None
    ) -> None:
        """Anything this process publishes later (a delay() from other code) comes after the
        reply was read."""

        @app.task(base=LockedTask, lock_key="k:{n}", shared=False)
        def again(n: int) -> None:
            return None

        traced(app, again)(21)
        again.delay(21)
        assert log == ["deferred k:21", "flush", "published " + again.name]


def test_the_protocol_is_runtime_checkable(log: list[str]) -> None:
    assert isinstance(DeferringStore(log), SupportsDeferredRelease)
    assert not isinstance(MemoryLockStore(), SupportsDeferredRelease)


# Which receivers count as celery-lease's own ----------------------------------------------------


def _stand_in_receiver(**_: Any) -> None:
    pass


_stand_in_receiver.__module__ = (
    "celery_lease.stand_in"  # stands for celery_lease._celery.worker's receiver
)


class TestOnlyOurs:
    def test_a_receiver_reconnected_under_a_dead_ones_uid_is_seen(self) -> None:
        signal = Signal(name="success_stand_in")
        signal.connect(_stand_in_receiver, weak=False, dispatch_uid="celery_lease.stand_in")

        def first(**_: Any) -> None:
            pass

        signal.connect(first, dispatch_uid="myapp.notify_done")  # weak, the default
        del first
        gc.collect()  # dead, not yet swept from signal.receivers (swept at the next connect)
        assert deferral.only_ours(signal)  # right: the dead one runs no more

        def second(**_: Any) -> None:  # e.g. a reloaded module's handler, same uid
            pass

        signal.connect(second, dispatch_uid="myapp.notify_done")
        assert [r for r in signal._live_receivers(None)] == [_stand_in_receiver, second]
        assert not deferral.only_ours(signal)  # a foreign receiver now runs after the task

    def test_control_a_live_foreign_receiver_is_seen(self) -> None:
        signal = Signal(name="success_stand_in_2")
        signal.connect(_stand_in_receiver, weak=False, dispatch_uid="celery_lease.stand_in")

        def foreign(**_: Any) -> None:
            pass

        signal.connect(foreign, dispatch_uid="myapp.other")
        assert not deferral.only_ours(signal)
        del foreign

    def test_the_answer_follows_every_change_of_the_receivers(self) -> None:
        """Asked again after each change: a connect, a disconnect, a swap that keeps the count
        of receivers, a weak receiver collected (not yet swept from the list)."""
        signal = Signal(name="success_stand_in_3")
        signal.connect(_stand_in_receiver, weak=False, dispatch_uid="celery_lease.stand_in")
        signal.connect(_stand_in_receiver, weak=False, dispatch_uid="celery_lease.stand_in_2")
        answers = [deferral.only_ours(signal)]

        def foreign(**_: Any) -> None:
            pass

        signal.connect(foreign, weak=False, dispatch_uid="myapp.a")
        answers.append(deferral.only_ours(signal))
        signal.disconnect(dispatch_uid="myapp.a")
        answers.append(deferral.only_ours(signal))
        signal.disconnect(dispatch_uid="celery_lease.stand_in_2")
        signal.connect(foreign, weak=False, dispatch_uid="myapp.b")  # as many receivers as before
        answers.append(deferral.only_ours(signal))
        signal.disconnect(dispatch_uid="myapp.b")
        answers.append(deferral.only_ours(signal))

        def weakly_held(**_: Any) -> None:
            pass

        signal.connect(weakly_held, dispatch_uid="myapp.weak")
        answers.append(deferral.only_ours(signal))
        del weakly_held
        gc.collect()
        answers.append(deferral.only_ours(signal))
        assert answers == [True, False, True, False, True, False, True]


class TestLockReleasedReceivers:
    def test_a_lock_released_receiver_finds_the_key_free(
        self,
        app: Celery,
        store: DeferringStore,
    ) -> None:
        @app.task(base=LockedTask, lock_key="lr:{n}", shared=False)
        def quiet(n: int) -> None:
            return None

        seen: list[object] = []

        def on_released(key: str, **_: Any) -> None:
            seen.append(store.get(key))  # e.g. tell a scheduler the slot is free

        lease_signals.lock_released.connect(on_released, weak=False)
        try:
            traced(app, quiet)(1)
        finally:
            lease_signals.lock_released.disconnect(on_released)
        assert seen == [None]


class _SignalChangingWhileRead:
    """A signal whose foreign receiver is taken away while ``only_ours`` reads the list a second
    time, and put back at the read after: a thread disconnecting and reconnecting it."""

    _dead_receivers = False

    def __init__(self) -> None:
        def ours() -> None: ...

        def theirs() -> None: ...

        ours.__module__ = "celery_lease._celery.worker"
        theirs.__module__ = "proj.hooks"
        self.foreign = ("theirs", theirs)
        self.entries: list[tuple[object, object]] = [("ours", ours), self.foreign]
        self.reads = 0

    @property
    def receivers(self) -> list[tuple[object, object]]:
        self.reads += 1
        if self.reads == 2:
            self.entries.remove(self.foreign)
        elif self.reads == 3:
            self.entries.append(self.foreign)
        return self.entries


def test_a_receiver_taken_away_and_put_back_during_the_check_is_seen() -> None:
    """The answer is judged on the snapshot it is kept with, so a foreign receiver connected
    when the signal is asked again is never hidden by an answer kept from a moment without it."""
    signal = _SignalChangingWhileRead()
    answers = [deferral.only_ours(signal) for _ in range(3)]  # type: ignore[arg-type]
    assert signal.entries[-1] == signal.foreign  # connected again
    assert answers[-1] is False


def test_a_task_class_without_a_module_name_still_defers(app: Celery, log: list[str]) -> None:
    """A class whose ``__module__`` is None (made by generated code): the hook check reads it
    as a user's class, and the release still goes out."""
    anonymous = type("Anonymous", (LockedTask,), {"__module__": None})

    @app.task(base=anonymous, lock_key="k:{n}", shared=False)
    def nameless(n: int) -> None:
        return None

    traced(app, nameless)(60)
    assert released(log) == ["deferred k:60"]
