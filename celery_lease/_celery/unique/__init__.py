"""Unique at enqueue (``lock_unique``): at most one queued copy per key, returned to every caller.

Behaviour, examples and every case (retries, revoke, canvases, debounce):
``docs/celery.md#unique-at-enqueue``. The design, on the store operations plus ``get``:

- **Queued lease**: on ``queued:<key>`` (after ``lease_key_prefix``), owner
:func:`~celery_lease._core.owners.queued_owner` (names the copy's task id), taken by the caller
*before* publishing, for ``queue_ttl`` from the copy's eta; the ``lease_queued`` header carries
key and owner. A caller that finds it held reads the holder's id and returns its ``AsyncResult``
or raises ``AlreadyQueuedError``.
- **Hand-over** (:mod:`.handover`, :mod:`.hold`): the worker takes the run lease first, then
``"while_queued"`` releases the queued lease and ``"until_done"`` keeps it under the same owner
(the key is never free in between), renewed with the run ttl until the run lease is released,
then released (or kept for ``lock_cooldown``).
- **Debounce** (:mod:`.debounce`, :mod:`.arrival`): a call that supersedes a waiting copy first
takes the tombstone key ``superseded:<old id>``; that key is the right to free the old copy's
queued lease. A starting copy claims its own tombstone *before* the run lease, so either a
superseding call took it first (the copy ends REVOKED without ever holding the run key) or nobody
can supersede it any more; the claim is checked again once the run lease is held and freed when
the execution ends.
- **Second delivery of a running copy** (:mod:`.redelivery`): never a duplicate of itself and
maybe the last message if its worker dies, so it is re-sent with ``lease_deferred`` and
``countdown`` = the run ttl (one message per ttl), and runs only after finding the key free and
its copy not done on two arrivals a ttl apart.

Eager mode and ``send_task`` by name de-duplicate nothing; a duplicate carrying callbacks, or a
group or chord member (its id is pre-assigned), always raises ``AlreadyQueuedError``.

Modules: :mod:`.common` (headers, keys, clock, quiet writes), :mod:`.call` (one call, resolved
once), :mod:`.caller` (``apply_async``'s side), :mod:`.debounce`, :mod:`.arrival`,
:mod:`.handover`, :mod:`.hold`, :mod:`.redelivery`, :mod:`.revoke` (the ``task_revoked``
receiver). Threads, locks and fork resets: ``docs/internals.md``.
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
