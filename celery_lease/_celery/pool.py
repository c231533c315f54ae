"""The pool of this process's worker: which one it is, and whether this process is a pool child.

Set by the worker's wiring (:mod:`celery_lease._celery.worker`: ``worker_process_init`` notes a
pool child) and its start-up check (:class:`celery_lease._celery.startup.LeaseCheck` notes the
pool whose check passed); read by the code that behaves differently per pool: the revoke
interrupt (:mod:`celery_lease._celery.interrupt`), deferred release replies
(:mod:`celery_lease._celery.deferral`), the start-up checks and the metrics exporter.

Which process does what under each pool: ``docs/internals.md``.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "IN_PROCESS_POOLS",
    "Autoscale",
    "in_pool_child",
    "pool_label",
    "pool_name",
    "pool_processes",
    "runs_one_task_at_a_time",
    "runs_tasks_in_main_process",
    "set_pool_child",
    "set_pool_label",
]

Autoscale = str | int | Sequence[str | int] | None
"""``--autoscale`` as Celery passes it: ``"10,3"``, ``(10, 3)``, or ``None``."""

_pool_child = False
_pool_label = ""
"""The pool of the worker whose start-up check passed in this process (:func:`set_pool_label`)."""

IN_PROCESS_POOLS = (
    "celery.concurrency.solo",
    "celery.concurrency.thread",
    "celery.concurrency.gevent",
    "celery.concurrency.eventlet",
)
"""Modules of Celery's pools that run every task inside the worker's main process."""


def runs_one_task_at_a_time() -> bool:
    """True in a worker process that runs one task at a time: a solo worker, a prefork child.

    False outside a worker, in the main process of a prefork worker, and under the threads,
    gevent and eventlet pools (and pools of other packages), where executions run side by side.
    """
    return _pool_label == "solo" or (_pool_label == "prefork" and _pool_child)


def in_pool_child() -> bool:
    """True in a prefork pool child process (where terminating the process is like revoke)."""
    return _pool_child


def pool_label() -> str:
    """The pool of this process's worker (``"prefork"``, ``"solo"``...), ``""`` before its check."""
    return _pool_label


def set_pool_child(child: bool) -> None:
    """Remember whether this process is a prefork pool child (at ``worker_process_init``)."""
    global _pool_child
    _pool_child = child


def set_pool_label(label: str) -> None:
    """Remember the pool of the worker whose start-up check passed (by
    :class:`~celery_lease._celery.startup.LeaseCheck`)."""
    global _pool_label
    _pool_label = label


def pool_name(pool_cls: object) -> str:
    """``prefork``, ``thread``... for Celery's pools, else the class's repr."""
    module = str(getattr(pool_cls, "__module__", ""))
    if module.startswith("celery.concurrency."):
        return module.rsplit(".", 1)[-1]
    return repr(pool_cls)


def runs_tasks_in_main_process(pool_cls: object) -> bool:
    """Whether ``pool_cls`` (or a pool class it derives from) is one of :data:`IN_PROCESS_POOLS`."""
    modules = {getattr(cls, "__module__", "") for cls in getattr(pool_cls, "__mro__", (pool_cls,))}
    return bool(modules.intersection(IN_PROCESS_POOLS))


def pool_processes(pool_cls: object, concurrency: int, autoscale: Autoscale = None) -> int:
    """How many processes may run this worker's tasks at once.

    Args:
        pool_cls: the worker's pool class (``WorkController.pool_cls`` once resolved).
        concurrency: ``-c`` (an int; 0 or ``None`` count as 1).
        autoscale: ``--autoscale`` as Celery passes it (``"10,3"`` or ``(10, 3)``), or ``None``.

    Returns:
        1 for a pool that runs tasks in the main process (solo, threads, gevent, eventlet, or a
        subclass of one), else the larger of ``concurrency`` and the autoscale maximum (prefork,
        and any pool this function does not know: counted on the safe side).
    """
    if runs_tasks_in_main_process(pool_cls):
        return 1
    most = int(concurrency or 1)
    if isinstance(autoscale, str):
        autoscale = autoscale.partition(",")[0]
    if isinstance(autoscale, Sequence) and not isinstance(autoscale, str):
        autoscale = autoscale[0] if autoscale else None
    if autoscale:
        most = max(most, int(autoscale))
    return most
