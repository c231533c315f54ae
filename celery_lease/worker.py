"""Worker hooks: per-process state is rebuilt in every pool process, settings checked at start-up.

Connected when :mod:`celery_lease.task` is imported (before the pool forks, so prefork children
inherit the receivers):

- ``worker_init`` (main process): remember the main process id and validate the ``lease_*``
  settings of the app, so a bad setting fails at start-up rather than at the first task;
- ``worker_process_init`` (each prefork child; the main process under solo): forget stores and
  caches inherited from the parent (``os.register_at_fork`` already does this for every fork;
  the signal also covers pools that start processes otherwise) and note whether this process
  is a pool child.

A child that dies holding a lease (hard time limit, ``SIGKILL``, ``revoke(terminate=True)``) is
not released by the main process: its key frees itself when its ttl runs out, at the latest one
ttl after the last renewal. Releasing on the child's behalf would need the child's owner id in
the main process; nothing here ever releases a lease for another owner.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from celery.signals import worker_init, worker_process_init

__all__ = ["in_pool_child", "on_process_reset", "reset_process_state"]

logger = logging.getLogger(__name__)

_main_pid: int | None = None
_pool_child = False
_resets: list[Callable[[], None]] = []


def on_process_reset(callback: Callable[[], None]) -> None:
    """Run ``callback()`` in every new pool process (and in every forked child)."""
    _resets.append(callback)
    os.register_at_fork(after_in_child=callback)


def reset_process_state() -> None:
    """Forget every per-process cache (stores resolved from settings and URLs)."""
    from celery_lease import config

    config.reset()
    for callback in _resets:
        callback()


def in_pool_child() -> bool:
    """True in a prefork pool child process (where terminating the process is like revoke)."""
    return _pool_child


def _on_worker_init(sender: Any = None, **_: Any) -> None:
    global _main_pid
    _main_pid = os.getpid()
    app = getattr(sender, "app", None)
    if app is not None:
        from celery_lease import config

        config.get_settings(app)  # validate now: a typo fails at start-up


def _on_worker_process_init(**_: Any) -> None:
    global _pool_child
    _pool_child = _main_pid is not None and os.getpid() != _main_pid
    reset_process_state()


worker_init.connect(_on_worker_init, weak=False, dispatch_uid="celery_lease.worker_init")
worker_process_init.connect(
    _on_worker_process_init, weak=False, dispatch_uid="celery_lease.worker_process_init"
)
