"""Each schedule entry's last run, shared through the lease store next to the beat's lease.

A record is a lease: key ``<beat key>:last-run:<entry name>``, owner label ``last-run <unix ms>``;
only the beat lease's holder writes. Reading needs
:class:`~celery_lease.stores.base.SupportsInspection`. See docs/celery.md, "Beat".
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from urllib.parse import quote, unquote

from celery_lease.stores.base import LockStore, SupportsInspection, conforms

logger = logging.getLogger("celery_lease.beat")

# Seconds: the longest a record is kept without a new run (about 13 months: a yearly crontab).
RECORD_TTL = 400 * 24 * 3600.0
# Seconds: the shortest a record is kept without a new run (entries of short periods).
MIN_RECORD_KEEP = 3600.0
_LABEL = "last-run "
_SEPARATOR = ":last-run:"


class LastRuns:
    """The last-run records of one beat lease's schedule (``beat_key``: full key, prefixed)."""

    def __init__(self, store: LockStore, beat_key: str) -> None:
        self.store = store
        self.prefix = beat_key + _SEPARATOR
        self.shared = conforms(store, SupportsInspection)
        self._owners: dict[str, str] = {}  # each record's owner id, as last read or written

    def read(self) -> dict[str, float]:
        """Unix seconds of each entry's last recorded run, by name (empty: store cannot list)."""
        if not self.shared:
            return {}
        found: dict[str, float] = {}
        for info in self.store.list(self.prefix):  # type: ignore[attr-defined]
            at = _parse(info.owner)
            if at is not None and info.key.startswith(self.prefix):
                name = info.key[len(self.prefix) :]
                found[name] = at
                self._owners[name] = info.owner  # the next write replaces it in two calls
        return found

    def write(self, name: str, at: float, keep: float = RECORD_TTL) -> None:
        """Record that entry ``name`` last ran at ``at`` (unix seconds), kept ``keep`` seconds."""
        if not self.shared:
            return
        key = self.prefix + name
        owner = _owner(at)
        ttl_ms = max(1, round(keep * 1000))
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
    """The unix seconds a record's owner id carries, ``None`` for any other owner id."""
    for field in owner.split(";")[1:]:
        name, _, value = field.partition("=")
        label = unquote(value)
        if name == "l" and label.startswith(_LABEL):
            try:
                return int(label[len(_LABEL) :]) / 1000
            except ValueError:
                return None
    return None
