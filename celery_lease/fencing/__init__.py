"""Fenced writes: the resource side of a fencing token, so nobody hand-writes the check.

A write with token ``t`` is applied when the stored fence is ``<= t`` (or there is none) and
the fence becomes ``t``; otherwise :class:`StaleTokenError` (``current``: the refusing fence).
Equal tokens are accepted (the same holder writing again, or retrying), so write absolute values.
Without ``token=`` the helpers use the innermost lease of the context. One helper module per
backend (:mod:`.sqlalchemy`, :mod:`.django`, :mod:`.redis`), each importing its driver only
when imported. The rule and its reasons: docs/fencing.md.
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
        token: a positive ``int`` (``self.request.lock_token``); ``None`` (default): the token
            of the innermost lease held in this context.
        lock_key: the lock key of ``token``, for :class:`StaleTokenError`; ``None``: the current
            lease's key when ``token`` is its token, else unknown.

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
