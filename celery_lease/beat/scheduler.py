""":class:`LeasedScheduler`: Celery's beat scheduler, sending only while it holds the beat lease.
Built as a subclass of the wrapped scheduler (``LeasedPersistentScheduler``), which keeps its
``tick``, heap and persistence; the leased part hooks ``tick`` (a standby waits for the lease,
and reads the shared last runs on taking it), ``populate_heap`` (last runs raised to the
shared ones, also after a reload), ``reserve`` (the lease checked with the store before each
send), ``apply_async`` (the fencing token header, then the record) and ``close`` (the lease
released)."""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timezone
from typing import Any

from celery.beat import Scheduler
from celery.utils.time import maybe_make_aware

from celery_lease._celery.settings import get_settings
from celery_lease.beat.config import BeatConfig, read_config
from celery_lease.beat.election import Election
from celery_lease.beat.last_runs import LastRuns
from celery_lease.errors import LeaseConfigError, LeaseError

__all__ = ["TOKEN_HEADER", "LeasedScheduler"]

logger = logging.getLogger("celery_lease.beat")

TOKEN_HEADER = "lease_beat_token"
"""The header every message of a leased beat carries: the lease's fencing token
(``self.request.lease_beat_token`` in a task)."""


class NotHolding(Exception):
    """Raised by ``reserve`` when the lease is not this beat's: ``tick`` drops the send."""


class LeasedScheduler(Scheduler):  # type: ignore[misc]
    """A beat scheduler that sends due tasks only while it holds the lease ``lease_beat_key``.

    Use ``celery beat -S celery_lease.beat:LeasedScheduler`` (or ``beat_scheduler``). It wraps
    ``lease_beat_scheduler`` (default ``celery.beat:PersistentScheduler``; ``django`` works).
    A standby takes over within one ``lease_beat_ttl`` of the active beat's death, at once
    after a clean shutdown. ``standby_wait``: seconds one standby ``tick`` waits (default: the
    ttl, at most ``max_interval``).
    """

    standby_wait: float | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> LeasedScheduler:
        if cls is LeasedScheduler:
            app = kwargs["app"] if "app" in kwargs else args[0]
            wrapped = read_config(app).scheduler
            if issubclass(wrapped, LeasedScheduler):
                raise LeaseConfigError(
                    f"lease_beat_scheduler={app.conf.get('lease_beat_scheduler')!r} is the leased"
                    " scheduler itself: name the scheduler it wraps (default"
                    " 'celery.beat:PersistentScheduler')"
                )
            cls = leased_class(wrapped)
        return super().__new__(cls)  # type: ignore[no-any-return]

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        self.lease_config: BeatConfig = read_config(app)
        self.election = Election(app, self.lease_config.key, self.lease_config.ttl)
        self.last_runs: LastRuns | None = None
        self._reserved: dict[str, datetime] = {}
        self._runs: dict[str, datetime] = {}  # the shared last runs, as read and written
        super().__init__(app, *args, **kwargs)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """Send what is due while holding the lease, else wait for it."""
        if self.election.current() is None and not self._take_over():
            return 0.0 if self._standby_wait() > 0 else min(1.0, self.max_interval)
        try:
            return float(super().tick(*args, **kwargs))
        except NotHolding:
            self._heap = None  # tick popped the entry: rebuild the heap, the entry is still due
            return 0.0 if self.election.current() is None else min(1.0, self.max_interval)

    def reserve(self, entry: Any) -> Any:
        """Advance ``entry`` once the store confirmed the lease, else raise ``NotHolding``."""
        if not self.election.verify():
            raise NotHolding(entry.name)
        new_entry = super().reserve(entry)
        if new_entry.last_run_at is not None:
            self._reserved[entry.name] = new_entry.last_run_at
        return new_entry

    def apply_async(
        self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        """Send ``entry``'s task with the header ``lease_beat_token``, then record its run."""
        held = self.election.held
        if held is None:  # only reachable through a direct call of a standby
            raise NotHolding(entry.name)
        # On the entry itself for this send: django-celery-beat's ModelEntry does not copy.
        options = entry.options
        headers = {**((options or {}).get("headers") or {}), TOKEN_HEADER: held.token}
        entry.options = {**(options or {}), "headers": headers}
        try:
            result = super().apply_async(entry, producer=producer, advance=advance, **kwargs)
        finally:
            entry.options = options
        at = self._reserved.pop(entry.name, None)
        if at is not None and self.last_runs is not None:
            self._runs[entry.name] = maybe_make_aware(at)
            try:
                self.last_runs.write(entry.name, self._runs[entry.name].timestamp())
            except (LeaseError, OSError) as exc:
                logger.warning(
                    "celery-lease beat: could not record the run of %r (%s): a beat taking"
                    " over may send it again",
                    entry.name,
                    exc,
                )
        return result

    def populate_heap(self, *args: Any, **kwargs: Any) -> None:
        """Raise each entry's last run to the shared one, then build the heap."""
        schedule = self.schedule
        for name, when in self._runs.items():
            entry = schedule.get(name)
            if entry is None:
                continue
            local = entry.last_run_at
            if local is None or maybe_make_aware(local) < when:
                entry.last_run_at = when.astimezone(maybe_make_aware(entry.default_now()).tzinfo)
        super().populate_heap(*args, **kwargs)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.election.resign()

    @property
    def info(self) -> str:
        config = self.lease_config
        key = get_settings(self.app).key_prefix + config.key
        return (
            f"{super().info}\n    . lease -> {key!r} (ttl {config.ttl:g} s,"
            f" wraps {config.scheduler.__module__}.{config.scheduler.__qualname__})"
        )

    def _standby_wait(self) -> float:
        if self.standby_wait is not None:
            return self.standby_wait
        return float(min(self.lease_config.ttl, self.max_interval))

    def _take_over(self) -> bool:
        held = self.election.take(self._standby_wait())
        if held is None:
            return False
        self.last_runs = LastRuns(held.store, held.key)
        try:
            recorded = self.last_runs.read()
        except (LeaseError, OSError) as exc:
            logger.warning(
                "celery-lease beat: cannot read the last runs (%s): releasing the lease", exc
            )
            self.election.resign()
            return False
        self._runs = {
            name: datetime.fromtimestamp(at, tz=timezone.utc) for name, at in recorded.items()
        }
        self._reserved.clear()
        self._heap = None  # rebuilt from the schedule as it is now
        return True


_classes: dict[type, type[LeasedScheduler]] = {}
_classes_lock = threading.Lock()


def leased_class(wrapped: type[Scheduler]) -> type[LeasedScheduler]:
    """The subclass of :class:`LeasedScheduler` and ``wrapped`` (one per wrapped class)."""
    with _classes_lock:
        cls = _classes.get(wrapped)
        if cls is None:
            name = f"Leased{wrapped.__name__}"
            cls = _classes[wrapped] = type(
                name, (LeasedScheduler, wrapped), {"__module__": __name__, "__qualname__": name}
            )
        return cls
