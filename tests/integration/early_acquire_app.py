"""The app of ``test_early_acquire_solo``: a solo worker on a Redis broker that is also its lock
store. ``task_prerun`` notes whether the task's key is already held there (read through the
worker's own store, so after every reply sent before it), in ``EA_DIR``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import task_prerun

from celery_lease import LockedTask
from celery_lease._celery.settings import get_store

app = Celery("ea", broker=os.environ.get("EA_BROKER", "memory://"), set_as_current=False)
app.conf.update(
    lease_restart_grace=0,  # a throwaway server
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
)


@app.task(name="ea.keyed", base=LockedTask, lock_key="ea:{n}", shared=False)
def keyed(n: int) -> int:
    return n


@task_prerun.connect(weak=False)
def _note_key_at_prerun(sender: Any = None, args: Any = None, **_: Any) -> None:
    if getattr(sender, "name", None) != "ea.keyed" or not args:
        return
    held = get_store(app).get(f"ea:{args[0]}") is not None
    with open(Path(os.environ["EA_DIR"]) / "prerun", "a") as out:
        out.write(f"{args[0]} {'held' if held else 'free'}\n")
