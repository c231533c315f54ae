"""Everything celery-lease hooks into Celery (:func:`install`: request attributes, the ``leases``
command, :data:`RECEIVERS`), called when :mod:`celery_lease._celery.task` is imported, so before
the pool forks. Idempotent (fixed ``dispatch_uid``s): no lock a fork could inherit."""

from __future__ import annotations

import atexit
from collections.abc import Callable

from celery.signals import (
    before_task_publish,
    task_failure,
    task_internal_error,
    task_received,
    task_revoked,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_shutdown,
)
from celery.utils.dispatch import Signal

from celery_lease._celery import (
    control,
    deferral,
    early_acquire,
    early_release,
    pool,
    request,
    unique,
    worker,
)
from celery_lease._core import owners


def _flush_deferred(**_: object) -> None:
    deferral.flush_deferred_releases()


# Connected in a solo worker's process only (:func:`_install_in_solo_worker`): Celery sends
# ``task_received`` for every message, and elsewhere nothing listens.
SOLO_RECEIVERS: tuple[tuple[Signal, Callable[..., None], str], ...] = (
    (task_received, early_acquire.on_task_received, "celery_lease.early_acquire.received"),
    (task_revoked, early_acquire.on_task_revoked, "celery_lease.early_acquire.revoked"),
    (task_failure, early_acquire.on_task_failure, "celery_lease.early_acquire.failure"),
    # Celery's own error around the task (a result backend down while storing STARTED, an
    # on_failure that raises): no task_failure follows.
    (
        task_internal_error,
        early_acquire.on_task_failure,
        "celery_lease.early_acquire.internal_error",
    ),
    (worker_shutdown, early_acquire.on_worker_shutdown, "celery_lease.early_acquire.shutdown"),
)


def _install_in_solo_worker(**_: object) -> None:
    """``worker_process_init`` (a solo pool sends it in the worker's process): connect
    :data:`SOLO_RECEIVERS` there."""
    if pool.pool_label() == "solo" and not pool.in_pool_child():
        for signal, receiver, uid in SOLO_RECEIVERS:
            signal.connect(receiver, weak=False, dispatch_uid=uid)


# ``(signal, receiver, dispatch_uid)`` of every receiver :func:`install` connects.
RECEIVERS: tuple[tuple[Signal, Callable[..., None], str], ...] = (
    (worker_init, worker.on_worker_init, "celery_lease.worker_init"),
    (worker_process_init, worker.on_worker_process_init, "celery_lease.worker_process_init"),
    (worker_process_init, _install_in_solo_worker, "celery_lease.early_acquire.install"),
    (worker_shutdown, worker.on_worker_shutdown, "celery_lease.worker_shutdown"),
    (task_failure, worker.on_task_failure, "celery_lease.task_failure"),
    (
        before_task_publish,
        early_release.release_before_publish,
        "celery_lease.release_before_retry",
    ),
    (worker_process_shutdown, _flush_deferred, "celery_lease.flush_deferred_process"),
    (worker_shutdown, _flush_deferred, "celery_lease.flush_deferred"),
    (task_revoked, unique.on_task_revoked, "celery_lease.unique.revoked"),
)

_installed = False


def install() -> None:
    """Hook celery-lease into Celery, once per process (and flush deferred releases at exit)."""
    global _installed
    if _installed:
        return
    request.define_attributes()
    control.register_command()
    for signal, receiver, uid in RECEIVERS:
        signal.connect(receiver, weak=False, dispatch_uid=uid)
    # Owner ids read the running task when made: a task_prerun / task_postrun receiver would
    # make Celery send both signals for every task, plain ones too.
    owners.set_task_source(worker.running_task)
    atexit.register(deferral.flush_deferred_releases)
    _installed = True
