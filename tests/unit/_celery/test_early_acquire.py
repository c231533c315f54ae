"""A solo worker sends a locked task's acquire when the message arrives and reads the reply when
the run enters its lease; a try whose run does not take it is given up owner-checked. An
in-process solo worker (``celery.contrib.testing.worker``) and a store that records its calls."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, Task
from celery.contrib.testing.worker import start_worker
from celery.exceptions import TaskRevokedError
from celery.signals import task_internal_error, task_prerun, task_received, task_revoked
from celery.worker import state as worker_state

from celery_lease import LockedTask, MemoryLockStore
from celery_lease._celery import early_acquire, pool
from celery_lease.clock import Clock

TIMEOUT = 10.0
POLL = 0.01


class RecordingStore(MemoryLockStore):
    """A memory store that can send an acquire (it takes effect when sent, as on a server; its
    answer is handed over when read) and records its calls in ``events``."""

    def __init__(self, clock: Clock | None = None) -> None:
        super().__init__(clock=clock)
        self.events: list[tuple[str, ...]] = []
        self.lock = threading.Lock()

    def note(self, *event: str) -> None:
        with self.lock:
            self.events.append(event)

    def send_acquire(self, key: str, owner: str, ttl_ms: int) -> Callable[[], int | None]:
        self.note("sent", key)
        token = super().acquire(key, owner, ttl_ms)

        def read() -> int | None:
            self.note("read", key)
            return token

        return read

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        self.note("acquire", key)
        return super().acquire(key, owner, ttl_ms)

    def release(self, key: str, owner: str) -> None:
        self.note("release", key)
        super().release(key, owner)

    def take_events(self) -> list[tuple[str, ...]]:
        with self.lock:
            events, self.events = self.events, []
        return events


class PlusOne(Task):  # type: ignore[misc]
    """Runs the task with its argument plus one: the run's key differs from the message's."""

    def __call__(self, a: int) -> Any:
        return super().__call__(a + 1)


@pytest.fixture(scope="module")
def env() -> Iterator[SimpleNamespace]:
    """One app, recording store and solo worker shared by this module's tests."""
    store = RecordingStore()
    app = Celery("early", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.lease_store = store
    app.conf.lease_defer_release = False  # every release is recorded, in order
    app.conf.broker_transport_options = {"polling_interval": POLL}

    def on_received(request: Any = None, **_: Any) -> None:
        store.note("received", request.id)

    def on_prerun(task_id: Any = None, **_: Any) -> None:
        store.note("prerun", task_id)

    @app.task(base=LockedTask, lock_key="k:{a}", shared=False)
    def plain(a: int) -> int:
        store.note("body", str(a))
        return a

    @app.task(base=LockedTask, lock_key="r:{a}", rate_limit="1000/s", shared=False)
    def rate_limited(a: int) -> int:
        return a

    class Failing(LockedTask):  # type: ignore[misc]
        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            raise RuntimeError("before the body")

    @app.task(base=Failing, lock_key="f:{a}", shared=False)
    def failing(a: int) -> int:
        return a

    @app.task(base=LockedTask, lock_key="t:{a}", track_started=True, shared=False)
    def started(a: int) -> int:
        return a

    class Shifted(PlusOne, LockedTask):  # type: ignore[misc]
        pass

    @app.task(base=Shifted, lock_key="s:{a}", shared=False)
    def shifted(a: int) -> int:
        return a

    # Connected before the worker starts: each runs before the worker's own receivers.
    task_received.connect(on_received, weak=False)
    task_prerun.connect(on_prerun, weak=False)
    root = logging.getLogger()  # the worker's logging set-up raises its level: put it back
    level, handlers = root.level, list(root.handlers)
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=TIMEOUT):
            yield SimpleNamespace(
                app=app,
                store=store,
                plain=plain,
                rate_limited=rate_limited,
                failing=failing,
                shifted=shifted,
                started=started,
            )
    finally:
        task_received.disconnect(on_received)
        task_prerun.disconnect(on_prerun)
        app.close()
        root.setLevel(level)
        root.handlers[:] = handlers


def _kinds(events: list[tuple[str, ...]]) -> list[str]:
    return [event[0] for event in events]


class TestInASoloWorker:
    def test_the_acquire_is_sent_at_receipt_and_read_before_the_body(
        self, env: SimpleNamespace
    ) -> None:
        """Sent at ``task_received``, read after Celery's prologue (``task_prerun``), before the
        body; one acquire in all, released after the body."""
        env.store.take_events()
        assert env.plain.delay(1).get(timeout=TIMEOUT, interval=POLL) == 1
        # The worker's task_received receiver runs before or after this module's (connected
        # when the process's first worker started).
        assert _kinds(_without_received(env.store.take_events())) == [
            "sent",
            "prerun",
            "read",
            "body",
            "release",
        ]

    def test_an_eta_request_sends_nothing_early(self, env: SimpleNamespace) -> None:
        """A countdown goes to Celery's timer: acquired when it runs, as before."""
        env.store.take_events()
        assert env.plain.apply_async((2,), countdown=0.01).get(timeout=TIMEOUT, interval=POLL) == 2
        kinds = _kinds(env.store.take_events())
        assert "sent" not in kinds
        assert kinds.index("prerun") < kinds.index("acquire") < kinds.index("body")

    def test_a_rate_limited_task_sends_nothing_early(self, env: SimpleNamespace) -> None:
        env.store.take_events()
        assert env.rate_limited.delay(3).get(timeout=TIMEOUT, interval=POLL) == 3
        kinds = _kinds(env.store.take_events())
        assert "sent" not in kinds and "acquire" in kinds

    def test_a_request_revoked_after_receipt_frees_its_key_at_once(
        self, env: SimpleNamespace
    ) -> None:
        """Revoked between the send and the run: the task never runs, and its try is given up
        (read, then released by its own owner) before ``task_revoked``'s later receivers run."""
        seen: list[Any] = []

        def revoke(request: Any = None, **_: Any) -> None:
            worker_state.revoked.add(request.id)

        def after_revoked(request: Any = None, **_: Any) -> None:
            seen.append(env.store.get("k:4"))

        task_received.connect(revoke, weak=False)  # after the worker's: the acquire was sent
        task_revoked.connect(after_revoked, weak=False)
        env.store.take_events()
        try:
            result = env.plain.delay(4)
            with pytest.raises(TaskRevokedError):
                result.get(timeout=TIMEOUT, interval=POLL)
        finally:
            task_received.disconnect(revoke)
            task_revoked.disconnect(after_revoked)
            worker_state.revoked.discard(result.id)
        assert seen == [None]
        assert _kinds(_without_received(env.store.take_events())) == ["sent", "read", "release"]

    @pytest.mark.filterwarnings("ignore:Exception raised outside body:RuntimeWarning")
    def test_a_request_ended_by_celerys_internal_error_frees_its_key(
        self, env: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The result backend is down: storing STARTED fails in Celery's prologue, and so does
        storing the failure, so no ``task_failure`` is sent; ``task_internal_error`` gives the
        try up (the key is not left held while the worker idles)."""
        ended = threading.Event()

        def down(*_: Any, **__: Any) -> None:
            raise ConnectionError("result backend down")

        def on_internal(**_: Any) -> None:  # connected after the worker's: runs after it
            ended.set()

        backend_class = type(env.app.backend)
        monkeypatch.setattr(backend_class, "store_result", down)
        monkeypatch.setattr(backend_class, "mark_as_failure", down)
        task_internal_error.connect(on_internal, weak=False)
        env.store.take_events()
        try:
            env.started.delay(1)
            assert ended.wait(TIMEOUT)
            kinds = _kinds(_without_received(env.store.take_events()))
            monkeypatch.undo()
            # Solo runs one message at a time: once this one's result is in, Celery is done
            # with the failed request (its RuntimeWarning raised while this test ignores it).
            assert env.plain.delay(50).get(timeout=TIMEOUT, interval=POLL) == 50
        finally:
            task_internal_error.disconnect(on_internal)
        assert kinds == ["sent", "prerun", "read", "release"]
        assert env.store.get("t:1") is None

    def test_a_task_with_its_own_before_start_sends_nothing_early(
        self, env: SimpleNamespace
    ) -> None:
        """``before_start`` may end the request without a signal: acquired by the run."""
        env.store.take_events()
        with pytest.raises(RuntimeError, match="before the body"):
            env.failing.delay(5).get(timeout=TIMEOUT, interval=POLL)
        assert env.store.get("f:5") is None
        assert "sent" not in _kinds(env.store.take_events())

    def test_a_call_before_locked_tasks_sends_nothing_early(self, env: SimpleNamespace) -> None:
        """A ``__call__`` ahead of LockedTask's may answer without the lock (here it changes
        the arguments): the run acquires its own key as usual."""
        env.store.take_events()
        assert env.shifted.delay(6).get(timeout=TIMEOUT, interval=POLL) == 7
        events = env.store.take_events()
        assert [e for e in events if e[0] != "received" and e[0] != "prerun"] == [
            ("acquire", "s:7"),
            ("release", "s:7"),
        ]


def _without_received(events: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    assert [e[0] for e in events].count("received") == 1, events
    return [e for e in events if e[0] != "received"]


@pytest.fixture
def solo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    label = pool.pool_label()
    pool.set_pool_label("solo")
    yield
    early_acquire.give_up()
    pool.set_pool_label(label)


def _request(task: Any, task_id: str, *args: object, **kwargs: object) -> SimpleNamespace:
    """What ``task_received`` carries, as far as the receiver reads it."""
    return SimpleNamespace(task=task, id=task_id, eta=None, args=list(args), kwargs=kwargs)


@pytest.fixture
def app() -> Iterator[Celery]:
    made = Celery("early-unit", set_as_current=False)
    made.conf.lease_store = RecordingStore()
    yield made
    made.close()


def _task(app: Celery, **options: Any) -> Any:
    @app.task(base=LockedTask, shared=False, **options)
    def body(a: int) -> int:
        return a

    return body


@pytest.mark.usefixtures("solo")
class TestWhatIsSentEarly:
    @pytest.mark.parametrize(
        "options",
        [
            {"lock_key": lambda a: f"c:{a}"},
            {"lock_key": "l:{a}", "lock_limit": 2},
            {"lock_key": "p:{a}", "lock_on_held": "replace"},
            {"lock_key": "u:{a}", "lock_unique": "while_queued"},
        ],
        ids=["callable-key", "limit", "replace", "unique"],
    )
    def test_these_tasks_send_nothing(self, app: Celery, options: dict[str, Any]) -> None:
        task = _task(app, **options)
        early_acquire.on_task_received(request=_request(task, "id-1", 1))
        assert app.conf.lease_store.events == []

    def test_a_template_key_is_sent(self, app: Celery) -> None:
        task = _task(app, lock_key="t:{a}")
        early_acquire.on_task_received(request=_request(task, "id-2", 1))
        assert app.conf.lease_store.events == [("sent", "t:1")]

    def test_the_default_key_is_sent(self, app: Celery) -> None:
        task = _task(app)
        early_acquire.on_task_received(request=_request(task, "id-3", 1))
        assert [e[0] for e in app.conf.lease_store.events] == ["sent"]

    def test_a_store_that_cannot_send_builds_no_key(self) -> None:
        """A store without ``send_acquire``: the key (here an argument's property) is not read
        at receipt; the run builds it once, as before."""
        reads: list[int] = []

        class Account:
            @property
            def id(self) -> int:
                reads.append(1)
                return 7

        plain_app = Celery("early-plain", set_as_current=False)
        plain_app.conf.lease_store = MemoryLockStore()
        try:
            task = _task(plain_app, lock_key="a:{a.id}")
            early_acquire.on_task_received(request=_request(task, "id-10", Account()))
        finally:
            plain_app.close()
        assert reads == []

    def test_another_pool_sends_nothing(self, app: Celery) -> None:
        pool.set_pool_label("threads")
        task = _task(app, lock_key="t:{a}")
        early_acquire.on_task_received(request=_request(task, "id-4", 1))
        assert app.conf.lease_store.events == []

    def test_an_eta_sends_nothing(self, app: Celery) -> None:
        task = _task(app, lock_key="t:{a}")
        request = _request(task, "id-5", 1)
        request.eta = "2030-01-01T00:00:00"
        early_acquire.on_task_received(request=request)
        assert app.conf.lease_store.events == []


@pytest.mark.usefixtures("solo")
class TestALeftoverTry:
    def test_the_next_receipt_gives_it_up_before_sending_its_own(self, app: Celery) -> None:
        """Two messages of one key, the first never run: its try is released (by its owner)
        before the second is sent, so the second gets the key."""
        store = app.conf.lease_store
        task = _task(app, lock_key="t:{a}")
        early_acquire.on_task_received(request=_request(task, "id-6", 1))
        first = store.get("t:1")
        early_acquire.on_task_received(request=_request(task, "id-7", 1))
        second = store.get("t:1")
        assert store.events == [
            ("sent", "t:1"),
            ("read", "t:1"),
            ("release", "t:1"),
            ("sent", "t:1"),
        ]
        assert first is not None and second is not None and second.owner != first.owner

    def test_worker_shutdown_gives_it_up(self, app: Celery) -> None:
        store = app.conf.lease_store
        task = _task(app, lock_key="t:{a}")
        early_acquire.on_task_received(request=_request(task, "id-8", 1))
        early_acquire.on_worker_shutdown()
        assert store.get("t:1") is None
        assert store.events[-1] == ("release", "t:1")

    def test_another_requests_run_leaves_it_parked(self, app: Celery) -> None:
        """A run of another request id takes nothing: the try waits for its own run."""
        store = app.conf.lease_store
        task = _task(app, lock_key="t:{a}")
        early_acquire.on_task_received(request=_request(task, "id-9", 1))
        taken = early_acquire.take(
            SimpleNamespace(id="other"), "t:1", store, 30.0, 0.0, lambda held: None
        )
        assert taken is None
        assert store.get("t:1") is not None
        assert store.events == [("sent", "t:1")]

    def test_a_run_asking_for_another_key_gives_it_up(self, app: Celery) -> None:
        """The run built another key than the receipt did: the sent try is released by its
        owner and the run acquires as usual."""
        store = app.conf.lease_store
        task = _task(app, lock_key="t:{a}")
        early_acquire.on_task_received(request=_request(task, "id-12", 1))
        taken = early_acquire.take(
            SimpleNamespace(id="id-12"), "t:2", store, 30.0, 0.0, lambda held: None
        )
        assert taken is None
        assert store.get("t:1") is None
        assert store.events == [("sent", "t:1"), ("read", "t:1"), ("release", "t:1")]

    def test_a_run_on_another_store_gives_it_up(self, app: Celery) -> None:
        """The run resolved another store than the receipt did: the sent try is released by its
        owner and the run acquires as usual."""
        store = app.conf.lease_store
        task = _task(app, lock_key="t:{a}")
        early_acquire.on_task_received(request=_request(task, "id-11", 1))
        other = MemoryLockStore()
        taken = early_acquire.take(
            SimpleNamespace(id="id-11"), "t:1", other, 30.0, 0.0, lambda held: None
        )
        assert taken is None
        assert store.get("t:1") is None
        assert store.events == [("sent", "t:1"), ("read", "t:1"), ("release", "t:1")]

    def test_task_failure_gives_up_only_its_own_requests_try(self, app: Celery) -> None:
        """A request that fails before its run took the try (``task_failure``) frees its key;
        another request's failure leaves it parked."""
        store = app.conf.lease_store
        task = _task(app, lock_key="t:{a}")
        early_acquire.on_task_received(request=_request(task, "id-13", 1))
        early_acquire.on_task_failure(task_id="other")
        assert store.get("t:1") is not None
        early_acquire.on_task_failure(task_id="id-13")
        assert store.get("t:1") is None
        assert store.events == [("sent", "t:1"), ("read", "t:1"), ("release", "t:1")]


@pytest.mark.usefixtures("solo")
class TestASettingsChangeBetweenReceiptAndRun:
    def test_the_run_gives_the_try_up_and_takes_its_own_key(self, app: Celery) -> None:
        """The receipt sent ``t:1``; a new ``lease_key_prefix`` read before the run makes the
        run's key ``p:t:1``: the sent try is released by its owner, the run acquires its own."""
        store = app.conf.lease_store
        task = _task(app, lock_key="t:{a}")
        early_acquire.on_task_received(request=_request(task, "id-14", 1))
        app.config_from_object({"lease_store": store, "lease_key_prefix": "p:"}, force=True)
        assert task.apply(args=(1,), task_id="id-14").get() == 1
        assert store.events == [
            ("sent", "t:1"),
            ("read", "t:1"),
            ("release", "t:1"),
            ("acquire", "p:t:1"),
            ("release", "p:t:1"),
        ]
        assert store.get("t:1") is None and store.get("p:t:1") is None

    def test_an_unchanged_run_takes_the_try(self, app: Celery) -> None:
        """Nothing changed: the run reads the reply of the try sent at receipt (no acquire)."""
        store = app.conf.lease_store
        task = _task(app, lock_key="t:{a}")
        early_acquire.on_task_received(request=_request(task, "id-15", 1))
        assert task.apply(args=(1,), task_id="id-15").get() == 1
        assert store.events == [("sent", "t:1"), ("read", "t:1"), ("release", "t:1")]

    def test_a_run_of_another_request_with_the_same_key_leaves_it_parked(self, app: Celery) -> None:
        """The same key, another request id: the run acquires (refused: the parked try holds
        the key, ``on_held="skip"``), the parked try stays for its own request."""
        store = app.conf.lease_store
        task = _task(app, lock_key="t:{a}", lock_on_held="skip")
        early_acquire.on_task_received(request=_request(task, "id-16", 1))
        assert task.apply(args=(1,), task_id="id-17").get() is None
        assert store.events == [("sent", "t:1"), ("acquire", "t:1")]
        assert early_acquire.parked is not None and early_acquire.parked.request_id == "id-16"
