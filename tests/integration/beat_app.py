"""The app of the leased-beat tests: one entry every second onto a queue nobody consumes.

Environment: ``BEAT_BROKER`` (a Redis URL), ``BEAT_STORE`` (the lease store URL),
``BEAT_PREFIX`` (``lease_key_prefix``: unique per test), ``BEAT_QUEUE`` (the queue the ticks
go to), ``BEAT_TTL`` (``lease_beat_ttl``, seconds). Each message's first argument is the wall
time it was sent at (``BeatLazyFunc``, evaluated by beat at send time).
"""

from __future__ import annotations

import os
import time

from celery import Celery
from celery.beat import BeatLazyFunc


def sent_at() -> float:
    """The wall time of the send; with ``BEAT_HANG_DIR`` set, a beat whose pid is named by a
    file ``hang-<pid>`` there hangs here (a publish that never returns) until it is killed."""
    hang = os.environ.get("BEAT_HANG_DIR")
    while hang and os.path.exists(os.path.join(hang, f"hang-{os.getpid()}")):
        time.sleep(0.05)
    return time.time()


app = Celery("beat-it", broker=os.environ["BEAT_BROKER"])
app.conf.update(
    lease_store=os.environ["BEAT_STORE"],
    lease_key_prefix=os.environ["BEAT_PREFIX"],
    lease_beat_ttl=float(os.environ.get("BEAT_TTL", "3")),
    lease_restart_grace=0,
    beat_scheduler="celery_lease.beat:LeasedScheduler",
    beat_max_loop_interval=1,
    broker_connection_retry_on_startup=True,
    beat_schedule={
        "every-second": {
            "task": "beat_it.tick",
            "schedule": 1.0,
            "args": (BeatLazyFunc(sent_at),),
            "options": {"queue": os.environ["BEAT_QUEUE"]},
        }
    },
)


@app.task(name="beat_it.tick")
def tick(sent_at: float) -> None:
    """Never run: the tests read the messages on the broker."""
