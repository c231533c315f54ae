"""Early release: a running locked task that publishes a message with its own id (``retry()``,
``replace()``, ``apply_async(task_id=...)``) releases its lease first, so the new copy never
finds it held. The lease reads lost (``"released"``); ``lock_released`` is sent, ``lock_lost``
is not, and no interrupt fires (``raise self.retry()`` must end in RETRY)."""

from __future__ import annotations

from collections.abc import Mapping

from celery_lease._celery import deferral, execution


def release_before_publish(
    headers: Mapping[str, object] | None = None, body: object = None, **_: object
) -> None:
    """``before_task_publish``: release the lease of the running execution the message names
    (header, or protocol 1 body), after answering any deferred release."""
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
