"""The request attributes of a locked execution, defined on Celery's ``Context`` class.

:func:`define_attributes` (called by :func:`celery_lease._celery.wiring.install`) adds
``lock_key``, ``lock_token``, ``lock_waited``, ``lock_lost`` and ``lease`` to
:class:`celery.app.task.Context`. Defined on the class, they are
never treated as custom headers (``retry()`` re-sends those) and always have a value; they are
always overwritten when an execution starts, so a message header of the same name cannot forge
them.

``lock_lost`` is a read-only data descriptor: it reads the lease's own loss record
(:attr:`celery_lease.Lease.lost`), so it can never lag behind the renewer, and a message header
named ``lock_lost`` (which Celery stores in the request's ``__dict__``) cannot shadow it. There
is no second copy of the loss state on the request.

``_lease_run`` marks a request a locked execution has claimed. Its value is :data:`CLAIMED`, an
object no message can carry: a header named ``_lease_run`` (any JSON value) does not make a
worker's request look claimed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from celery.app.task import Context

if TYPE_CHECKING:
    from celery_lease._celery.protocols import TaskRequest

__all__ = ["CLAIMED", "FIELDS", "define_attributes", "is_claimed", "restore", "save"]


class _Claimed:
    """The type of :data:`CLAIMED`: one instance, which copies (and pickles) as itself."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<claimed by a locked execution>"

    def __reduce__(self) -> str:
        return "CLAIMED"


CLAIMED = _Claimed()
"""The value of ``request._lease_run`` on a request a locked execution has claimed."""

FIELDS = ("lock_key", "lock_token", "lock_waited", "lease", "_lease_run")
"""The attributes a locked execution writes on a request."""

_MISSING = object()


def is_claimed(request: TaskRequest) -> bool:
    """Whether a locked execution claimed ``request`` (or the request it was copied from).

    ``Task.push_request`` copies the current request's attributes into the one it pushes, so
    a request pushed inside a running execution reads claimed too.
    """
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
    """Whether the lease of this request's execution is lost (False before it is acquired)."""
    held = request.__dict__.get("lease")
    return held is not None and bool(held.lost)


def define_attributes() -> None:
    """Define the lock attributes on Celery's ``Context`` class (again: no change)."""
    Context.lock_key = None
    Context.lock_token = None
    Context.lock_waited = False
    Context.lease = None
    Context._lease_run = None  # CLAIMED on a request a locked execution has claimed
    Context.lock_lost = property(
        _get_lock_lost, doc="True once this execution's lease is lost (read from the lease)."
    )
