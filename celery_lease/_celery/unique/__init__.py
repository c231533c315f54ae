"""Unique at enqueue (``lock_unique``): at most one queued copy per key, returned to every
caller.

Behaviour and every case: ``docs/celery.md#unique-at-enqueue``. The design:

- **Queued lease**: ``queued:<key>`` (after ``lease_key_prefix``), owned by
:func:`~celery_lease._core.owners.queued_owner` (names the copy's task id), taken by the
caller *before* publishing for ``queue_ttl`` from the eta; the ``lease_queued`` header carries
key and owner.
- **Hand-over** (:mod:`.handover`, :mod:`.hold`): the worker takes the run lease first;
``"until_done"`` then keeps the queued lease under the same owner (never free in between)
until the run lease is released.
- **Debounce** (:mod:`.debounce`, :mod:`.arrival`): superseding a waiting copy takes its
tombstone ``superseded:<old id>`` first (the right to free its queued lease). A starting copy
claims its own tombstone *before* the run lease: either it was superseded (it ends REVOKED,
never holding the run key) or nobody can supersede it any more.
- **Second delivery of a running copy** (:mod:`.redelivery`): maybe the last message if its
worker dies, so it is re-sent with ``lease_deferred`` a run ttl later, and runs only after
seeing the key free and its copy not done twice, a ttl apart.

Other modules: :mod:`.common`, :mod:`.call`, :mod:`.caller` (``apply_async``'s side),
:mod:`.revoke`. Threads, locks and fork resets: ``docs/internals.md``.
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
