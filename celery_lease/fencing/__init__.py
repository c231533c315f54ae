"""Fenced writes: the resource side of a fencing token, so nobody hand-writes the check.

A lease's token grows with every acquisition of its key. A resource that keeps, next to the
data, the highest token that wrote it (the *fence*) can refuse a write carrying a lower one: the
write of a holder that stalled past its ttl while a newer holder took over and wrote.

::

    from celery_lease.fencing.sqlalchemy import fenced_upsert

    with lease("account:1", store=store) as held:
        fenced_upsert(conn, accounts, where={"id": 1}, values={"balance": 150})
        # INSERT ... ON CONFLICT (id) DO UPDATE SET balance = ..., fence = <token>
        #     WHERE accounts.fence <= <token>; 0 rows: StaleTokenError

The helpers, one module per backend (each imports its driver only when imported itself, so
``import celery_lease.fencing`` needs none of them):

- :mod:`celery_lease.fencing.sqlalchemy`: SQLAlchemy 2, Core and ORM (PostgreSQL and SQLite for
  the upsert; any database for the update of an existing row);
- :mod:`celery_lease.fencing.django`: the Django ORM;
- :mod:`celery_lease.fencing.redis`: ``SET`` and ``HSET`` checked and written by one Lua script.

**The rule, the same everywhere:** a write with token ``t`` is applied when the stored fence is
``<= t`` (or there is no fence yet), and the fence becomes ``t``. A newer holder's write (a
higher token) moves the fence past every older holder's token, so their late writes are refused
with :class:`StaleTokenError`, whose ``current`` is the fence that refused them.

**Equal tokens are accepted**: only one acquisition ever gets a given token of a key, so an equal
fence means this same holder wrote before. Accepting it lets a holder write the same row more
than once under one lease, and retry a write whose reply was lost (the first attempt may have been
applied). Such a retry applies the write twice, so write absolute values (``balance = 150``),
not increments computed by the database (``balance = balance + 50``) unless read under the lease.

**Which token:** the helpers take ``token=`` (and optionally ``lock_key=``, the lock key, for the
error message); without it they use the innermost lease held in the current context
(:func:`celery_lease.get_lock_token`, :func:`celery_lease.current_lease`), which is the task's
own lease inside a :class:`~celery_lease.LockedTask` body. Outside any lease and without a token
they raise :class:`~celery_lease.LeaseConfigError` before touching the resource.

**One row, one lock key:** tokens of different keys are not comparable. Fence a row (or a Redis
key) with the token of one lock key only, e.g. ``account:{id}`` for the row of account ``id``.
"""

from __future__ import annotations

from dataclasses import dataclass

from celery_lease._core.lease import current_lease
from celery_lease.errors import LeaseConfigError, MissingRowError, StaleTokenError

__all__ = ["FencingToken", "MissingRowError", "StaleTokenError", "resolve_token"]


@dataclass(frozen=True)
class FencingToken:
    """The token a fenced write carries, and the lock key it belongs to (``None``: unknown)."""

    token: int
    key: str | None


def resolve_token(token: int | None = None, lock_key: str | None = None) -> FencingToken:
    """The token (and lock key) a fenced write uses: ``token`` if given, else the current lease's.

    Args:
        token: an explicit fencing token (a positive ``int``), e.g. ``self.request.lock_token``;
            ``None`` (default): the token of the innermost lease held in this context.
        lock_key: the lock key ``token`` belongs to, for :class:`StaleTokenError`; ``None``: the
            current lease's key when ``token`` is its token (or omitted), else unknown.

    Raises:
        LeaseConfigError: ``token`` is not a positive int (``bool`` is refused), ``lock_key`` is
            not a non-empty string, or no token was given outside any lease.
    """
    if lock_key is not None and (not isinstance(lock_key, str) or not lock_key):
        raise LeaseConfigError(
            f"lock_key={lock_key!r} must be a non-empty string (the lock key) or None"
        )
    held = current_lease()
    if token is None:
        if held is None:
            raise LeaseConfigError(
                "token=None: a fenced write needs a fencing token; pass token= (e.g."
                " self.request.lock_token) or call it inside `with lease(...)` or a LockedTask"
                " body"
            )
        return FencingToken(held.token, lock_key if lock_key is not None else held.key)
    if isinstance(token, bool) or not isinstance(token, int) or token <= 0:
        raise LeaseConfigError(
            f"token={token!r} must be a positive int (a lease's fencing token) or None"
        )
    if lock_key is None and held is not None and held.token == token:
        lock_key = held.key
    return FencingToken(token, lock_key)
