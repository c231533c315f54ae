"""Unique at enqueue (``lock_unique``): at most one queued copy per key, returned to every
caller, held by the queued lease ``queued:<key>`` (:mod:`.handover`, :mod:`.hold`); debounce
(:mod:`.debounce`, :mod:`.arrival`) and second deliveries (:mod:`.redelivery`). Behaviour:
``docs/celery.md#unique-at-enqueue``.
"""

from celery_lease._celery.unique.arrival import Arrival, leave, on_arrival
from celery_lease._celery.unique.caller import apply_unique, names_holder
from celery_lease._celery.unique.common import queued_key
from celery_lease._celery.unique.handover import on_start
from celery_lease._celery.unique.hold import QueuedHold
from celery_lease._celery.unique.redelivery import on_rejected
from celery_lease._celery.unique.revoke import on_task_revoked

__all__ = [
    "Arrival",
    "QueuedHold",
    "apply_unique",
    "leave",
    "names_holder",
    "on_arrival",
    "on_rejected",
    "on_start",
    "on_task_revoked",
    "queued_key",
]
