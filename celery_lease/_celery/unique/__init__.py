"""Unique at enqueue (``lock_unique``): at most one queued copy per key, returned to every caller.

::

    @app.task(base=LockedTask, lock_key="report:{account_id}", lock_unique="until_done")
    def build_report(account_id): ...

    r1 = build_report.delay(7)
    r2 = build_report.delay(7)      # nothing published: r2.id == r1.id

How it is built, on the three store operations plus ``get`` (:class:`SupportsInspection`):

- **The queued lease** lives on its own key, the task's key with ``queued:`` after the
  ``lease_key_prefix`` (``queued:report:7``), owned by ``queued;t=<task>;i=<task id>;at=<ms>``
  (:func:`~celery_lease._core.owners.queued_owner`): the owner names the copy's task id. The
  caller takes it *before* publishing, for ``queue_ttl`` counted from the copy's eta; the message
  carries the key and the owner in its ``lease_queued`` header. A caller that finds it held
  reads the holder's task id (``get``) and returns that copy's ``AsyncResult``
  (``on_duplicate="existing"``) or raises :class:`~celery_lease.AlreadyQueuedError`
  (``"raise"``); ``lock_duplicate`` is sent either way.
- **The hand-over.** When the copy starts, the worker first takes the run lease on the task's
  key, as for any locked task (it excludes bodies; its tokens are the fencing tokens). Then
  ``"while_queued"`` releases the queued lease (owner-checked), and ``"until_done"`` keeps it
  under the same owner (the key is never free in between), renewed with the run lease's ttl
  (a copy that started half its ``queue_ttl`` or more after its eta takes the key back first:
  its queued lease may have expired in the queue) until the body ended and the run lease was
  released; then it is released before the execution returns (a call made after the result is
  seen enqueues a new copy), or kept for ``lock_cooldown`` after a success (a throttle: calls
  in the cooldown are duplicates of the finished copy). A worker that dies mid-body stops
  renewing it: it frees itself within the run ttl (:mod:`.handover`, :mod:`.hold`).
- **Failed publish** releases the queued lease at once, stores the error as the copy's FAILURE
  (callers handed its ``AsyncResult`` meanwhile see it in ``get()``) and re-raises; also when
  the broker may have taken the message after all (then the run lease still excludes a second
  body, and a late result overwrites the FAILURE; a debounced copy's message then ends without
  its body, see Debounce). **Revoke** releases it when the worker sees the revoke
  (``task_revoked``, also for ``expires``); a purged queue, a lost message or a worker killed
  before the copy started leave it to expire after ``queue_ttl``.
- **Retries** (a running copy publishing its own task id: ``retry()``, ``on_held="retry"``) take
  the queued lease again for their own id before publishing, for ``queue_ttl`` from the retry's
  eta (an ``until_done`` copy holds it already: the key is never free in between), and are never
  duplicates of themselves; acks_late redelivery of a started copy finds its own lease (or a
  free key, taken again).
- **Debounce.** The call is published with ``countdown=debounce``. A call that finds a waiting
  copy supersedes it: it writes a tombstone lease ``superseded:<old id>`` (owner names the new
  id), releases the old copy's queued lease (owner-checked), takes it for itself and publishes
  with an eta ``debounce`` later, capped at ``debounce_max`` after the first call of the chain
  (kept in the owner's ``at``). A debounced copy releases its queued lease when it reaches a
  worker, also under ``"until_done"`` (whose callers then look at the run key too: a running copy
  is the existing one), so a call never supersedes a running body. The tombstone key is the right
  to free the waiting copy's lease: a caller that fails to take it never touches that lease (it is
  the duplicate of the caller that took it, or looks again when that caller's own copy is no
  longer waiting), and a starting copy, *before it takes the run lease* (:func:`on_arrival`),
  takes its own tombstone key for itself for the run lease's ttl plus ``lock_wait``: either a
  superseding call took it first (the copy ends) or none can supersede it any more. It releases
  its queued lease around that claim, in both modes: a call from then on finds the key free and is
  the next copy, or under ``"until_done"`` the duplicate of the copy that holds the run key (never
  of one that may still be refused it: such a copy ends without its body, and a call handed its id
  would lose its work). Once the run lease is held the claim is taken again
  (:meth:`Arrival.confirm`): one that lapsed meanwhile and was taken by a newer call ends the copy
  REVOKED before its body, the run lease released. The claim is freed when the execution ends,
  with or without its body (:meth:`Arrival.leave`): a retry the copy published then waits as any
  copy and a newer call supersedes it (while the body that published it runs, a call is that
  retry's duplicate). Two callers racing: one takes the key, the others return its
  ``AsyncResult``. The superseded copy, when it reaches a worker, finds its tombstone taken and
  ends without its body and without ever holding the run key, REVOKED in the result backend with
  the reason ``"superseded by <new id>"`` (``AsyncResult.get()`` raises ``TaskRevokedError`` at
  once; no errback fires): the newer copy, started a moment later on another slot, never meets the
  run key held by the copy it superseded. A failed publish of the newest call (or a store error
  while superseding) hands the key back to the waiting copy, which then runs, unless a newer call
  superseded the failed one or took the free key (then only that one runs); the failed call's
  own tombstone keeps its message, had the broker taken it, from running, and its final state
  is stored (:mod:`.debounce`). A call that wrote a tombstone and then publishes nothing stores
  its own id REVOKED, ``"superseded by <winner>"``: a racing caller may hold that id.

**A second delivery of a running copy** (acks_late redelivery, a duplicated message: same task
id) meets the run lease held by its own task id. It is not a duplicate of itself, and it may be
the only message left if that copy's worker dies: it stores nothing under the id (no FAILURE
over the running copy), leaves the queued key to the running body, and is re-sent with the same
id, arguments and headers plus ``lease_deferred`` (how often it was re-sent so), ``countdown`` =
the run lease's ttl (the longest a dead holder's run lease outlives it; one message per ttl, no
busy loop), then acked (``Ignore``). A delivery that carries ``lease_deferred`` never applies
``on_held``: it ends without its body when its copy is done (a ready state in the result
backend), and is re-sent again while the run key is held or the backend cannot answer. It runs
the body only when it found the run key free and its copy not done on two arrivals a ttl apart
(its copy's worker died). Without a stored result (``ignore_result``, no backend) a finished
copy cannot be told from a dead one: the body runs again, as acks_late promises (at least
once). Who refused the key, and a failed re-send: :mod:`.redelivery`.

Eager mode (``task_always_eager``) publishes nothing and de-duplicates nothing. ``send_task`` by
name bypasses the task class: no de-duplication at enqueue (the run lease still excludes the
body). A duplicate call that carries callbacks (``link``, ``link_error``, a chain's next steps)
or is a group or chord member (``group_id``, ``chord``: its id is pre-assigned, and the group's
result and the chord's body wait for that id, whatever ``apply_async`` returns) raises
:class:`~celery_lease.AlreadyQueuedError` whatever ``on_duplicate`` says: they are never
dropped silently.

The modules, one job each: :mod:`.common` (header names, keys, clock, quiet writes),
:mod:`.call` (one call, resolved once), :mod:`.caller` (``apply_async``'s side),
:mod:`.debounce` (superseding and handing back), :mod:`.arrival` (a debounced copy's claim),
:mod:`.handover` (the queued key at the body's start), :mod:`.hold` (the key an
``"until_done"`` body keeps), :mod:`.redelivery` (a refused copy, a second delivery) and
:mod:`.revoke` (the ``task_revoked`` receiver, which the Celery layer connects).
The threads, locks and fork resets this package takes part in: ``docs/internals.md``.
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
