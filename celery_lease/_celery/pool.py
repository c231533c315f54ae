"""The pool of this process's worker, and whether this process is a pool child: set by
``worker_process_init`` and the start-up check, read by the interrupt, deferral, the checks
and metrics. Which process does what per pool: ``docs/internals.md``."""

from __future__ import annotations

from collections.abc import Sequence

# ``--autoscale`` as Celery passes it: ``"10,3"``, ``(10, 3)``, or ``None``.
Autoscale = str | int | Sequence[str | int] | None
_pool_child = False
_pool_label = ""  # the pool of the worker whose start-up check passed in this process

# Celery's pools that run every task in the worker's main process.
IN_PROCESS_POOLS = (
    "celery.concurrency.solo",
    "celery.concurrency.thread",
    "celery.concurrency.gevent",
    "celery.concurrency.eventlet",
)


def runs_one_task_at_a_time() -> bool:
    """True in a solo worker or a prefork child: one task at a time in this process."""
    return _pool_label == "solo" or (_pool_label == "prefork" and _pool_child)


def in_pool_child() -> bool:
    """True in a prefork child (where terminating the process is like revoke)."""
    return _pool_child


def pool_label() -> str:
    """The pool of this process's worker (``"prefork"``, ``"solo"``...), ``""`` before its check."""
    return _pool_label


def set_pool_child(child: bool) -> None:
    global _pool_child
    _pool_child = child


def set_pool_label(label: str) -> None:
    global _pool_label
    _pool_label = label


def pool_name(pool_cls: object) -> str:
    """``prefork``, ``thread``... for Celery's pools, else the class's repr."""
    module = str(getattr(pool_cls, "__module__", ""))
    if module.startswith("celery.concurrency."):
        return module.rsplit(".", 1)[-1]
    return repr(pool_cls)


def runs_tasks_in_main_process(pool_cls: object) -> bool:
    """Whether ``pool_cls`` (or a base of it) is one of :data:`IN_PROCESS_POOLS`."""
    modules = {getattr(cls, "__module__", "") for cls in getattr(pool_cls, "__mro__", (pool_cls,))}
    return bool(modules.intersection(IN_PROCESS_POOLS))


def pool_processes(pool_cls: object, concurrency: int, autoscale: Autoscale = None) -> int:
    """How many processes may run this worker's tasks at once: 1 in process, else the larger
    of ``concurrency`` (0 or ``None``: 1) and the ``--autoscale`` maximum (unknown: safe side)."""
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
