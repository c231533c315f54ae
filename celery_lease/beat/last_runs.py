"""Each schedule entry's last run, shared through the lease store, so a beat taking over neither
repeats nor skips a tick, whatever the wrapped scheduler keeps. A record is a lease (every
store has it): ``<beat key>:last-run:<entry>``, kept :data:`RECORD_TTL`, owned by ``last-run
<unix ms>``, written only by the beat lease's holder right after checking it. Stores without
``SupportsInspection`` keep none."""

from __future__ import annotations

import logging
import os
import secrets
import socket
from urllib.parse import quote, unquote

from celery_lease.stores.base import LockStore, SupportsInspection, conforms

__all__ = ["RECORD_TTL", "LastRuns"]

logger = logging.getLogger("celery_lease.beat")

RECORD_TTL = 400 * 24 * 3600.0
"""Seconds a record is kept without a new run (about 13 months: a yearly crontab's gap)."""

_LABEL = "last-run "
_SEPARATOR = ":last-run:"


class LastRuns:
    """The last-run records of one beat lease (``beat_key``: its full key) in ``store``."""

    def __init__(self, store: LockStore, beat_key: str) -> None:
        self.store = store
        self.prefix = beat_key + _SEPARATOR
        self.shared = conforms(store, SupportsInspection)
        self._owners: dict[str, str] = {}  # the owner id this process last wrote, by entry

    def read(self) -> dict[str, float]:
        """Unix seconds of each entry's last recorded run."""
        if not self.shared:
            return {}
        found: dict[str, float] = {}
        for info in self.store.list(self.prefix):  # type: ignore[attr-defined]
            at = _parse(info.owner)
            if at is not None and info.key.startswith(self.prefix):
                found[info.key[len(self.prefix) :]] = at
        return found

    def write(self, name: str, at: float) -> None:
        """Record that entry ``name`` last ran at ``at`` (unix seconds)."""
        if not self.shared:
            return
        key = self.prefix + name
        owner = _owner(at)
        ttl_ms = round(RECORD_TTL * 1000)
        previous = self._owners.pop(name, None)
        if previous is not None:
            self.store.release(key, previous)
        if self.store.acquire(key, owner, ttl_ms) is None:
            # Another beat's record (written while it held the beat lease): replace it.
            info = self.store.get(key)  # type: ignore[attr-defined]
            if info is not None:
                self.store.release(key, info.owner)
            if self.store.acquire(key, owner, ttl_ms) is None:
                logger.warning("celery-lease beat: could not record the last run of %r", name)
                return
        self._owners[name] = owner


def _owner(at: float) -> str:
    """An owner id (``host/pid/<16 hex>;l=<label>``) whose label carries ``at``."""
    label = quote(f"{_LABEL}{round(at * 1000)}", safe=" ")
    return f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(8)};l={label}"


def _parse(owner: str) -> float | None:
    for field in owner.split(";")[1:]:
        name, _, value = field.partition("=")
        label = unquote(value)
        if name == "l" and label.startswith(_LABEL):
            try:
                return int(label[len(_LABEL) :]) / 1000
            except ValueError:
                return None
    return None
