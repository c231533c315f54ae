"""A beat without a single point of failure: :class:`LeasedScheduler` sends due tasks only while
it holds a renewed lease, so any number of ``celery beat`` (or ``celery worker -B``) processes can
run and exactly one of them sends.

::

    app.conf.beat_scheduler = "celery_lease.beat:LeasedScheduler"
    app.conf.lease_beat_scheduler = "celery.beat:PersistentScheduler"   # the default

The modules, one job each: :mod:`~celery_lease.beat.config` reads and checks the settings,
:mod:`~celery_lease.beat.last_runs` shares each entry's last run through the lease store,
:mod:`~celery_lease.beat.election` holds, loses and takes the lease again, and
:mod:`~celery_lease.beat.scheduler` is the scheduler Celery's ``Service`` runs.
"""

from __future__ import annotations

from celery_lease.beat.scheduler import TOKEN_HEADER, LeasedScheduler

__all__ = ["TOKEN_HEADER", "LeasedScheduler"]
