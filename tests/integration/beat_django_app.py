"""The app of the django-celery-beat test: as :mod:`tests.integration.beat_app`, with
django-celery-beat's ``DatabaseScheduler`` wrapped (its entries live in the database, where a
``BeatLazyFunc`` cannot go), so each send is recorded by ``after_task_publish`` instead: the
wall time and the message's ``lease_beat_token``, pushed onto the Redis list ``<queue>:sent``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import django
import redis
from celery import Celery
from celery.signals import after_task_publish

django.setup()  # DJANGO_SETTINGS_MODULE: tests.integration.beat_django_settings

QUEUE = os.environ["BEAT_QUEUE"]

app = Celery("beat-it", broker=os.environ["BEAT_BROKER"])
app.conf.update(
    lease_store=os.environ["BEAT_STORE"],
    lease_key_prefix=os.environ["BEAT_PREFIX"],
    lease_beat_ttl=float(os.environ.get("BEAT_TTL", "3")),
    lease_beat_scheduler="django_celery_beat.schedulers:DatabaseScheduler",
    lease_restart_grace=0,
    beat_scheduler="celery_lease.beat:LeasedScheduler",
    beat_max_loop_interval=1,
    broker_connection_retry_on_startup=True,
    beat_schedule={
        "every-second": {"task": "beat_it.tick", "schedule": 1.0, "options": {"queue": QUEUE}}
    },
)
_recorder = redis.Redis.from_url(os.environ["BEAT_BROKER"])


@after_task_publish.connect
def record(headers: Any = None, **_: Any) -> None:
    """Push ``[wall time, lease_beat_token]`` of every send onto ``<queue>:sent``."""
    if headers and "lease_beat_token" in headers:
        _recorder.rpush(f"{QUEUE}:sent", json.dumps([time.time(), headers["lease_beat_token"]]))


@app.task(name="beat_it.tick")
def tick() -> None:
    """Never run: the test reads what beat recorded."""
