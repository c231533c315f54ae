"""Structural types of the parts of Celery, billiard, kombu and greenlet we use (Celery 5.7
ships none); ``tests/unit/_celery/test_protocols.py`` checks Celery still has them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, MutableSet, Sequence
from datetime import datetime
from typing import Protocol, TypeGuard

from celery_lease._core.lease import Lease, offers
from celery_lease.stores.base import (
    SupportsDeferredRelease,
    SupportsDeferredRenew,
    SupportsInspection,
    SupportsSentAcquire,
    conforms,
)


class AppConf(Protocol):
    """``app.conf`` (``celery.app.utils.Settings``): settings read by attribute or by ``get``."""

    task_always_eager: bool
    broker_url: object  # a str, a list of them (failover), or None
    broker_transport_options: Mapping[str, object] | None

    def get(self, key: str, default: object = None) -> object: ...  # as configured, any type
    def keys(self) -> Iterable[str]: ...  # Celery's defaults included


class CeleryApp(Protocol):
    """A Celery app (``celery.Celery``)."""

    conf: AppConf
    steps: Mapping[str, MutableSet[type]]  # bootstep classes to add, by blueprint

    @property
    def tasks(self) -> Mapping[str, CeleryTask]: ...  # the registry; reading it finalizes


class TaskRequest(Protocol):
    """A task's request (``celery.app.task.Context``): one execution, or the default request of a
    task called directly (``id`` None, ``called_directly`` True). Unknown message headers are
    attributes too (``lease_queued``: read with ``getattr``)."""

    id: str | None
    is_eager: bool
    called_directly: bool
    headers: Mapping[str, object] | None
    delivery_info: Mapping[str, object] | None
    chord: object
    ignore_result: bool
    retries: int
    hostname: str | None  # the worker's node name (None for a direct call)

    # The lock attributes, defined on ``Context`` by :mod:`celery_lease._celery.request`:
    lock_key: str | None
    lock_token: int | None
    lock_slot: int | None
    lock_waited: bool
    lease: Lease | None
    _lease_run: object  # request.CLAIMED once a locked execution claimed it


class TaskStack(Protocol):
    """The stack of running tasks that ``current_task`` reads (``celery._state._task_stack``)."""

    def push(self, obj: object) -> None: ...
    def pop(self) -> object: ...


class RequestStack(Protocol):
    """``task.request_stack`` (``celery.utils.threads.LocalStack``)."""

    @property
    def top(self) -> TaskRequest | None: ...  # None outside an execution


class AsyncResultLike(Protocol):
    """What publishing a task returns (``celery.result.AsyncResult``)."""

    id: str


class TaskSignature(Protocol):
    """A signature re-sent as it is (``celery.canvas.Signature``)."""

    args: tuple[object, ...]
    kwargs: dict[str, object]
    options: dict[str, object]


class ResultBackend(Protocol):
    """A task's result backend (``celery.backends.base.Backend``)."""

    def get_state(self, task_id: str) -> str:
        """``PENDING`` when nothing is stored; ``NotImplementedError`` on ``DisabledBackend``."""

    def mark_as_failure(
        self, task_id: str, exc: BaseException, *, call_errbacks: bool = True
    ) -> object: ...
    def mark_as_revoked(
        self,
        task_id: str,
        reason: str = "",
        request: TaskRequest | None = None,
        store_result: bool = True,  # False: only announce it
    ) -> object: ...


class CeleryTask(Protocol):
    """A task (``celery.app.task.Task``): one instance per process, reused by every execution."""

    name: str
    app: CeleryApp
    backend: ResultBackend
    send_events: bool
    acks_late: bool
    ignore_result: bool
    store_errors_even_if_ignored: bool
    run: Callable[..., object]  # the body (a bound method; the function of ``@app.task``)

    @property
    def request(self) -> TaskRequest: ...  # outside an execution: a default one, built now
    @property
    def request_stack(self) -> RequestStack | None: ...  # None before the task is bound
    def AsyncResult(self, task_id: str) -> AsyncResultLike: ...  # Celery's name
    def apply_async(
        self,
        args: Sequence[object] | None = None,
        kwargs: Mapping[str, object] | None = None,
        task_id: str | None = None,
        **options: object,
    ) -> AsyncResultLike: ...
    def signature_from_request(
        self,
        request: TaskRequest,
        *,
        countdown: float,
        expires: None,
        headers: Mapping[str, object],
    ) -> TaskSignature: ...  # re-sends ``request`` as ``retry()`` does
    def send_event(self, type_: str, **fields: object) -> None: ...  # when ``send_events``
    def retry(
        self,
        args: Sequence[object] | None = None,
        kwargs: Mapping[str, object] | None = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: datetime | None = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: object,
    ) -> BaseException: ...  # raises ``Retry`` (returns it with ``throw=False``)


class UniqueTask(CeleryTask, Protocol):
    """A task with ``lock_unique`` (a ``LockedTask``): unique publishes its copies through it."""

    def publish_copy(
        self,
        args: Iterable[object] | None,
        kwargs: Mapping[str, object] | None,
        task_id: str | None,
        **options: object,
    ) -> AsyncResultLike: ...  # Celery's ``apply_async``, past ``lock_unique``'s checks


class SignalLike(Protocol):
    """A Celery signal (``celery.utils.dispatch.Signal``) whose receivers are looked at."""

    @property
    def receivers(self) -> Sequence[tuple[object, object]]: ...  # weak ones: ``weakref.ref``


class WorkerLike(Protocol):
    """A worker bootstep's parent (``celery.apps.worker.WorkController``)."""

    app: CeleryApp
    hostname: str
    pool_cls: object  # its name, or a class, as the worker was given it
    concurrency: int
    pool: object  # ``celery.concurrency.base.BasePool``, once the Pool step built it


class WorkerRequest(Protocol):
    """A request the worker tracks (``celery.worker.request.Request``)."""

    id: str
    name: str
    worker_pid: int | None  # the pool child that accepted it (None until one did)
    task: CeleryTask | None


class PoolProcess(Protocol):
    """A child of billiard's pool (``billiard.process.BaseProcess``)."""

    pid: int | None
    exitcode: int | None  # None until ``waitpid()`` returned for it (reaped)


class PoolJob(Protocol):
    """A job of billiard's pool (``billiard.pool.ApplyResult``): one task sent to a child."""

    def worker_pids(self) -> list[int]: ...  # the children that accepted the job
    def ready(self) -> bool: ...


class BilliardPool(Protocol):
    """billiard's ``Pool`` (or celery's ``AsynPool``) as the reaper uses it."""

    # Fails (or requeues) a job whose child died with an exit code (replaced on the instance):
    mark_as_worker_lost: Callable[[PoolJob, int], object]
    # Reaps dead children (read and replaced by :mod:`celery_lease._celery.compat` only):
    _join_exited_workers: Callable[..., object]

    def maintain_pool(self) -> object: ...  # reap dead children and start new ones


class EventLoopHub(Protocol):
    """The worker's event loop (``kombu.asynchronous.hub.Hub``)."""

    def add_reader(self, fd: int, callback: Callable[[], None]) -> object: ...
    def remove_reader(self, fd: int) -> object: ...
    def call_later(self, delay: float, callback: Callable[[], None]) -> object: ...  # seconds


class Greenlet(Protocol):
    """A greenlet (``greenlet.greenlet``): the one a body runs on under gevent or eventlet."""

    def throw(self, exc: BaseException) -> object: ...  # raised at its next switch


class _HubLoop(Protocol):
    def run_callback_threadsafe(self, callback: Callable[[], None]) -> object: ...


class GeventHub(Protocol):
    """gevent's hub of the body's thread (``gevent.get_hub()``)."""

    loop: _HubLoop


def is_inspectable(store: object) -> TypeGuard[SupportsInspection]:
    """Whether ``store`` can read a key's holder (:class:`SupportsInspection`; cached per class)."""
    return conforms(store, SupportsInspection)


def can_release_deferred(store: object) -> TypeGuard[SupportsDeferredRelease]:
    """Whether ``store`` can release without waiting for the reply (asked once per task: what
    :func:`offers` does, inline)."""
    return hasattr(type(store), "release_deferred") and conforms(store, SupportsDeferredRelease)


def can_renew_deferred(store: object) -> TypeGuard[SupportsDeferredRenew]:
    """Whether ``store`` can renew without waiting for the reply."""
    return offers(store, SupportsDeferredRenew, "renew_deferred")


def can_send_acquire(store: object) -> TypeGuard[SupportsSentAcquire]:
    """Whether ``store`` can send an acquire and read its reply later."""
    return offers(store, SupportsSentAcquire, "send_acquire")
