"""A beat without a single point of failure: :class:`LeasedScheduler` sends due tasks only while
it holds a renewed lease, so any number of beat processes can run and exactly one sends
(``docs/celery.md#the-leased-scheduler``). Modules: ``config`` (settings), ``last_runs``
(shared last runs), ``election`` (the lease) and ``scheduler``."""

from __future__ import annotations

from celery_lease.beat.scheduler import TOKEN_HEADER, LeasedScheduler

__all__ = ["TOKEN_HEADER", "LeasedScheduler"]
