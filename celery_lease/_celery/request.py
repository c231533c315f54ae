"""The lock attributes of a request, defined on Celery's ``Context`` class: never custom headers
(``retry()`` re-sends those), always overwritten by an execution, so a header cannot forge
them. ``lock_lost`` is a read-only descriptor over the lease's own loss record; ``_lease_run``
is :data:`CLAIMED`, which no message can carry."""

from __future__ import annotations

from typing import TYPE_CHECKING

from celery.app.task import Context

if TYPE_CHECKING:
    from celery_lease._celery.protocols import TaskRequest


class _Claimed:
    """The type of :data:`CLAIMED`: one instance, which copies and pickles as itself."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<claimed by a locked execution>"

    def __reduce__(self) -> str:
        return "CLAIMED"


CLAIMED = _Claimed()
FIELDS = ("lock_key", "lock_token", "lock_slot", "lock_waited", "lease", "_lease_run")
_MISSING = object()


def is_claimed(request: TaskRequest) -> bool:
    """Whether a locked execution claimed ``request`` (pushed requests inherit the mark)."""
    return request.__dict__.get("_lease_run") is CLAIMED


def save(request: TaskRequest) -> tuple[object, ...]:
    """The lock attributes of ``request`` as they are, for :func:`restore`."""
    values = request.__dict__
    return tuple(values.get(name, _MISSING) for name in FIELDS)


def restore(request: TaskRequest, saved: tuple[object, ...]) -> None:
    """Put back the lock attributes :func:`save` returned."""
    values = request.__dict__
    for name, value in zip(FIELDS, saved, strict=True):
        if value is _MISSING:
            values.pop(name, None)
        else:
            values[name] = value


def _get_lock_lost(request: TaskRequest) -> bool:
    held = request.__dict__.get("lease")
    return held is not None and bool(held.lost)


def define_attributes() -> None:
    """Define the lock attributes on Celery's ``Context`` class (idempotent)."""
    Context.lock_key = None
    Context.lock_token = None
    Context.lock_slot = None  # the slot held (0 for a task without limit), None without a lease
    Context.lock_waited = False
    Context.lease = None
    Context._lease_run = None  # CLAIMED on a request a locked execution has claimed
    Context.lock_lost = property(
        _get_lock_lost, doc="True once this execution's lease is lost (read from the lease)."
    )
