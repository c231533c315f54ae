"""Unique at enqueue (``lock_unique``): at most one queued copy per key, returned to every
caller. Behaviour: ``docs/celery.md#unique-at-enqueue``.

- **Queued lease**: ``queued:<key>`` (after ``lease_key_prefix``), owned by
:func:`~celery_lease._core.owners.queued_owner` (names the copy's task id), taken by the
caller *before* publishing; the ``lease_queued`` header carries key and owner.
``"until_done"`` keeps it from the body's start until the run lease is released, never free in
between (:mod:`.handover`, :mod:`.hold`).
- **Debounce** (:mod:`.debounce`, :mod:`.arrival`): superseding a waiting copy takes its
tombstone ``superseded:<old id>`` first; a starting copy claims its own tombstone *before* the
run lease, so it either ends REVOKED without ever holding the run key or can no longer be
superseded.
- **Second delivery of a running copy** (:mod:`.redelivery`): maybe the last message if its
worker dies, so it is re-sent a run ttl later (``lease_deferred``), and runs only after seeing
the key free and its copy not done twice, a ttl apart.
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
