"""Everything celery-lease hooks into Celery, done in one place by :func:`install`.

- the lock attributes of the request ``Context``
  (:func:`celery_lease._celery.request.define_attributes`);
- the remote-control command ``leases`` (:func:`celery_lease._celery.control.register_command`);
- every receiver in :data:`RECEIVERS`: the worker hooks (:mod:`celery_lease._celery.worker`),
  unique's revoke receiver (:mod:`celery_lease._celery.unique`),
  the early release of a task that re-sends its own id (:mod:`celery_lease._celery.early_release`)
  and the exit flush of deferred releases (:mod:`celery_lease._celery.deferral`), which also runs
  when the process exits (``atexit``: a worker that fails to start sends no ``worker_shutdown``).

When. :mod:`celery_lease._celery.task` calls :func:`install` when it is imported, and everything
that defines a locked task imports it, before the pool forks, so prefork children inherit the
receivers: ``celery worker`` imports the app's task modules (``include``, ``imports``, and
``autodiscover_tasks()``, Django's included, through the ``import_modules`` signal) in
``loader.init_worker()``, the first thing ``WorkController`` does, before it sends
``worker_init``; it reads ``app.steps["worker"]`` after ``worker_init``, and builds every step
(their ``__init__``) before any step starts: before the pool forks. So a task module that defines
a locked task has installed all this before ``worker_init``, whichever module ``-A`` names. The
``celery`` program itself loads :mod:`celery_lease.cli` (the ``celery.commands`` entry point) in
every invocation, ``celery inspect`` included, which registers only the command ``leases``: the
inspect client checks the name against its own registry, and imports only the ``-A`` module,
never the task modules.

Once. A second call returns at once. Every step is idempotent besides (a receiver is connected
with ``weak=False`` under a fixed ``dispatch_uid``, the command and the attributes are set by
name), so two threads calling it at once connect nothing twice, and no lock is needed that a
fork could inherit held; a forked child inherits both the receivers and the flag.

:mod:`celery_lease._celery.deferral` still connects its own flush as well, under the same
``dispatch_uid`` (so it is connected once), and :mod:`celery_lease._celery.unique` its revoke
receiver.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable

from celery.signals import (
    before_task_publish,
    task_failure,
    task_postrun,
    task_prerun,
    task_revoked,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_shutdown,
)
from celery.utils.dispatch import Signal

from celery_lease._celery import control, deferral, early_release, request, unique, worker

__all__ = ["RECEIVERS", "install"]


def _flush_deferred(**_: object) -> None:
    """``worker_process_shutdown`` / ``worker_shutdown``: read this process's deferred release
    replies (:func:`celery_lease._celery.deferral.flush_deferred_releases`)."""
    deferral.flush_deferred_releases()


RECEIVERS: tuple[tuple[Signal, Callable[..., None], str], ...] = (
    (worker_init, worker.on_worker_init, "celery_lease.worker_init"),
    (worker_process_init, worker.on_worker_process_init, "celery_lease.worker_process_init"),
    (worker_shutdown, worker.on_worker_shutdown, "celery_lease.worker_shutdown"),
    (task_prerun, worker.on_task_prerun, "celery_lease.task_prerun"),
    (task_postrun, worker.on_task_postrun, "celery_lease.task_postrun"),
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
"""``(signal, receiver, dispatch_uid)`` of every receiver :func:`install` connects."""

_installed = False


def install() -> None:
    """Hook celery-lease into Celery (once per process: a second call returns at once).

    Defines the request's lock attributes, registers ``celery inspect leases``, connects
    every receiver of :data:`RECEIVERS` (strong references, each under its fixed
    ``dispatch_uid``) and flushes deferred releases when the process exits.
    """
    global _installed
    if _installed:
        return
    request.define_attributes()
    control.register_command()
    for signal, receiver, uid in RECEIVERS:
        signal.connect(receiver, weak=False, dispatch_uid=uid)
    atexit.register(deferral.flush_deferred_releases)
    _installed = True
