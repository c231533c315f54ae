"""Fenced writes: the resource side of a fencing token (one module per backend: :mod:`.sqlalchemy`,
:mod:`.django`, :mod:`.redis`). A write with token ``t`` applies when the stored fence is ``<= t``
or absent (equal tokens too: a retry), else :class:`StaleTokenError`. Rule: docs/fencing.md.
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
        token: a positive ``int``; ``None`` (default): the innermost lease's in this context.
        lock_key: the lock key of ``token``, for :class:`StaleTokenError`; ``None``: the current
            lease's key when ``token`` is its token, else unknown.

    Raises:
        LeaseConfigError: a bad ``token`` or ``lock_key``, or no token outside any lease.
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
