"""A beat without a single point of failure: :class:`LeasedScheduler` sends due tasks only while
it holds a renewed lease, so any number of beat processes can run and exactly one sends.
Guide: ``docs/celery.md#the-leased-scheduler``.

Modules: :mod:`~celery_lease.beat.config` (settings), :mod:`~celery_lease.beat.last_runs`
(each entry's last run, shared through the store), :mod:`~celery_lease.beat.election` (hold,
lose, take again) and :mod:`~celery_lease.beat.scheduler` (what Celery's ``Service`` runs).
"""

from __future__ import annotations

from celery_lease.beat.scheduler import TOKEN_HEADER, LeasedScheduler

__all__ = ["TOKEN_HEADER", "LeasedScheduler"]
