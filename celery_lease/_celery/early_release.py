"""Early release: a running locked task that publishes a message with its own id releases its
lease first.

``retry()``, ``replace()`` and ``apply_async(task_id=self.request.id)`` re-send the running
execution; a ``before_task_publish`` receiver releases its lease before the message goes out,
so the new copy never finds its own lease held. The lease is then lost with reason
``"released"``: the body, if it runs on, reads ``request.lock_lost`` True and ``check()``
raises; ``lock_released`` is sent (once), ``lock_lost`` and ``on_lock_lost`` are not (the
holder let go itself), and no interrupt is fired from the publish (the usual
``raise self.retry()`` must end in RETRY). ``LockedTask.retry(throw=False)`` with
``on_lost="revoke"`` raises the ``Retry`` instead of letting the body run on.

The receiver is connected by :func:`celery_lease._celery.wiring.install`.
The threads, locks and fork resets this module takes part in: ``docs/internals.md``.
"""

from __future__ import annotations

from collections.abc import Mapping

from celery_lease._celery import deferral, execution

__all__ = ["release_before_publish"]


def release_before_publish(
    headers: Mapping[str, object] | None = None, body: object = None, **_: object
) -> None:
    """``before_task_publish``: a running locked task publishes a message with its own id
    (``retry()``, ``replace()``, ``apply_async(task_id=...)``): release its lease first
    (early), so the new message can never find its own lease still held.

    The id is in the headers (task protocol 2) or in the body (``task_protocol = 1``).
    Any deferred release of this process is answered first (see
    :mod:`celery_lease._celery.deferral`).
    """
    if deferral.deferring:
        deferral.flush_deferred_releases()
    runs = execution.active_runs()
    if not runs:
        return
    task_id = headers.get("id") if headers else None
    if task_id is None and isinstance(body, Mapping):
        task_id = body.get("id")
    if task_id is None:
        return
    for run in reversed(runs):
        if run.task_id == task_id:
            run.release_early()
