"""The example's tasks: one for each thing a lease is for.

- :func:`nightly_report`: beat sends it every night; with two beat instances (or a redelivery)
  it arrives twice. ``on_held="skip"`` turns away a duplicate that arrives while it runs, and the
  ``cooldown`` keeps the key taken for an hour after it succeeded, so a *late* duplicate is turned
  away too: it runs once per night.
- :func:`update_balance`: read-modify-write of an account under the lease, with the write fenced
  by the lease's token. If this worker stalls past the ttl and another takes over, the stale
  write is rejected by the database (:class:`~example_project.db.StaleWriteError`) instead of
  overwriting the newer balance.
- :func:`rebuild_cache`: an expensive rebuild. A duplicate waits up to 5 s for the running one,
  and then uses the hand-off: ``self.request.lock_waited`` says another holder had the key just
  before, so the cache it finds is fresh and it need not rebuild it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from datetime import datetime, timezone
from typing import Any

from celery_lease import LockedTask, locked
from example_project import db
from example_project.app import app

__all__ = ["nightly_report", "rebuild_cache", "update_balance"]

logger = logging.getLogger(__name__)


@app.task(bind=True)
@locked(key="nightly-report", on_held="skip", cooldown="1h")
def nightly_report(self: Any) -> dict[str, Any]:
    """Sum up every account into a ``reports`` row, once per night however often it is sent."""
    day = datetime.now(timezone.utc).date().isoformat()
    count, total = db.write_report(day, token=self.request.lock_token)
    logger.info("nightly report for %s: %d accounts, total %d", day, count, total)
    return {"day": day, "accounts": count, "total": total}


@app.task(bind=True, base=LockedTask, lock_key="account:{account_id}")
def update_balance(
    self: Any, account_id: int, amount: int, work_seconds: float = 0.0
) -> dict[str, Any]:
    """Add ``amount`` (cents) to an account: read, compute, write fenced by the lease's token.

    Args:
        account_id: the account.
        amount: cents to add (negative to withdraw).
        work_seconds: slow work between the read and the write (a fraud check, a call to a
            payment provider); the demo uses it to pause a holder in the middle.

    Raises:
        StaleWriteError: the lease was lost and a newer holder wrote first (reported by Celery as
            ``LockLostError``, caused by this error).
    """
    balance = db.get_account(account_id).balance
    if work_seconds:
        time.sleep(work_seconds)
    # No check of self.request.lock_lost here would be enough: the lease can run out between the
    # check and the write. The fence in the UPDATE is checked by the database, atomically; the
    # fenced write carries this task's token (self.request.lock_token) without being passed it.
    account = db.write_balance(account_id, balance + amount)
    return {"account_id": account.id, "balance": account.balance, "fence": account.fence}


@app.task(bind=True)
@locked(key="cache:{name}", wait="5s")
def rebuild_cache(self: Any, name: str, build_seconds: float = 1.0) -> dict[str, Any]:
    """Rebuild the cache ``name``, unless the holder we waited for has just rebuilt it.

    Args:
        name: the cache to rebuild.
        build_seconds: how long the (simulated) expensive computation takes.
    """
    if self.request.lock_waited:
        cached = db.read_cache(name)
        if cached is not None:
            value, built_by = cached
            logger.info("cache %s was rebuilt by the holder we waited for: reused", name)
            return {"name": name, "rebuilt": False, "built_by_token": built_by}
    token = self.request.lock_token
    value = _expensive_computation(name, build_seconds)
    db.write_cache(name, value, token)
    return {"name": name, "rebuilt": True, "built_by_token": token}


def _expensive_computation(name: str, seconds: float) -> str:
    """Stand-in for the real work: takes ``seconds``, returns a JSON document."""
    time.sleep(seconds)
    digest = hashlib.sha256(f"{name}:{time.time()}".encode()).hexdigest()[:12]
    return json.dumps({"name": name, "version": digest})
