""":class:`LeasedScheduler`: Celery's beat scheduler, sending only while it holds the beat lease.

A subclass is built per wrapped class, so the wrapped scheduler keeps its ``tick``, heap and
persistence; the leased part hooks ``tick``, ``populate_heap``, ``reserve``, ``apply_async`` and
``close``, and notes each message going out (``after_task_publish``) to record its run. See
docs/celery.md, "Beat".
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timezone
from typing import Any

from celery.beat import Scheduler
from celery.signals import after_task_publish
from celery.utils.time import maybe_make_aware

from celery_lease._celery.settings import get_settings
from celery_lease.beat.config import BeatConfig, read_config
from celery_lease.beat.election import Election
from celery_lease.beat.last_runs import MIN_RECORD_KEEP, RECORD_TTL, LastRuns
from celery_lease.errors import LeaseConfigError, LeaseError, StoreUnavailableError

logger = logging.getLogger("celery_lease.beat")

# The header every message of a leased beat carries: the fencing token of its lease (read it in a
# task as ``self.request.lease_beat_token``).
TOKEN_HEADER = "lease_beat_token"


_sending_in_this_thread = threading.local()
"""``scheduler``: the :class:`LeasedScheduler` whose send runs in this thread, else None."""


def _on_published(sender: object = None, headers: object = None, **_: object) -> None:
    scheduler = getattr(_sending_in_this_thread, "scheduler", None)
    if scheduler is not None:
        scheduler._published(sender, headers)


after_task_publish.connect(
    _on_published, weak=False, dispatch_uid="celery_lease.beat.scheduler.published"
)


class NotHolding(Exception):
    """Raised by ``reserve`` when the lease is not this beat's: ``tick`` drops the send."""


class LeasedScheduler(Scheduler):  # type: ignore[misc]
    """A beat scheduler that sends due tasks only while it holds the lease ``lease_beat_key``.

    Use ``celery beat -S celery_lease.beat:LeasedScheduler`` (or ``beat_scheduler``). Settings,
    checked at start (a bad one raises :class:`~celery_lease.LeaseConfigError`):
    ``lease_beat_scheduler`` (the wrapped class or ``"module:Class"``, default
    ``celery.beat:PersistentScheduler``; ``django`` for django-celery-beat), ``lease_beat_key``
    (default ``"celery-beat:<app main name>"``, after ``lease_key_prefix``), ``lease_beat_ttl``
    (default 30 s, renewed every ttl/3: a standby takes over within a ttl plus 1 s of the
    holder's death, at once after a clean shutdown). Each message carries ``lease_beat_token``.

    Attributes:
        standby_wait: seconds one ``tick`` of a standby waits for the lease (default ``None``:
            the ttl, at most the scheduler's ``max_interval``). 0: try once and return.
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
        self._reserved: dict[str, tuple[datetime, float]] = {}  # (run, seconds to keep it)
        self._runs: dict[str, datetime] = {}  # the shared last runs, as read and written
        self._unrecorded: dict[str, tuple[datetime, float]] = {}  # sent, the store refused
        self._sending: tuple[str, str, int] | None = None  # entry, task, token of a send in flight
        super().__init__(app, *args, **kwargs)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One pass: send what is due while holding the lease, else wait for the lease; returns
        the seconds until the next pass is wanted."""
        ttl = self.lease_config.ttl
        self.election.back_within(ttl)  # this tick ends within a ttl, or the lease goes
        if self.election.current() is None and not self._take_over():
            return 0.0 if self._standby_wait() > 0 else min(1.0, self.max_interval)
        self._record_unrecorded()
        try:
            interval = float(super().tick(*args, **kwargs))
        except NotHolding:
            self._heap = None  # tick popped the entry: rebuild the heap, the entry is still due
            interval = 0.0 if self.election.current() is None else min(1.0, self.max_interval)
        # Service sleeps ``interval``, may sync the wrapped scheduler, and ticks again.
        self.election.back_within(max(interval, 0.0) + ttl)
        return interval

    def reserve(self, entry: Any) -> Any:
        """Advance ``entry`` for its send once the store confirmed the lease is this beat's (the
        broker connection is made first); else raise :class:`NotHolding`, advancing nothing."""
        self.producer  # noqa: B018 - connect to the broker before the store is asked, not after
        if not self.election.verify():
            raise NotHolding(entry.name)
        new_entry = super().reserve(entry)
        if new_entry.last_run_at is not None:
            self._reserved[entry.name] = (new_entry.last_run_at, record_keep(new_entry))
        return new_entry

    def apply_async(
        self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        """Send ``entry``'s task with the header ``lease_beat_token``, then record its run."""
        held = self.election.held
        if held is None:  # only reachable through a direct call of a standby
            raise NotHolding(entry.name)
        # Set on the entry itself for this send: django-celery-beat's ModelEntry does not copy.
        options = entry.options
        headers = {**((options or {}).get("headers") or {}), TOKEN_HEADER: held.token}
        entry.options = {**(options or {}), "headers": headers}
        outer = self._sending, getattr(_sending_in_this_thread, "scheduler", None)
        try:
            self._sending = (entry.name, entry.task, held.token)
            _sending_in_this_thread.scheduler = self
            result = super().apply_async(entry, producer=producer, advance=advance, **kwargs)
            self._sent(entry.name)  # returned: sent (also where nothing is published: eager)
        finally:
            self._sending, _sending_in_this_thread.scheduler = outer  # a send around this one
            entry.options = options
        self._record_unrecorded()
        return result

    def _published(self, task: object, headers: object) -> None:
        """``after_task_publish`` in the sending thread: when it is the message of the send in
        flight, its run is to be recorded from now on, even if the send is interrupted before it
        returns (``celery beat`` raises SystemExit from its SIGTERM handler)."""
        sending = self._sending
        if sending is None or not isinstance(headers, dict):
            return
        name, task_name, token = sending
        if task == task_name and headers.get(TOKEN_HEADER) == token:
            self._sent(name)

    def _sent(self, name: str) -> None:
        """Entry ``name``'s reserved run went out: record it (now, or on a later tick)."""
        reserved = self._reserved.pop(name, None)
        if reserved is not None and self.last_runs is not None:
            at, keep = maybe_make_aware(reserved[0]), reserved[1]
            self._runs[name], self._unrecorded[name] = at, (at, keep)

    def _record_unrecorded(self) -> None:
        """Write the runs sent but not recorded; one the store did not answer is retried next
        tick (and at close), one it refuses for good is given up."""
        while self._unrecorded and self.last_runs is not None:
            name, (at, keep) = next(iter(self._unrecorded.items()))
            try:
                self.last_runs.write(name, at.timestamp(), keep)
            except (StoreUnavailableError, OSError) as exc:
                logger.warning(
                    "celery-lease beat: could not record the run of %r (%s): trying again on"
                    " the next tick; a beat taking over before then may send it again",
                    name,
                    exc,
                )
                return
            except LeaseError as exc:
                logger.warning(
                    "celery-lease beat: the store refused the record of %r (%s): a beat taking"
                    " over falls back to its own state for that entry",
                    name,
                    exc,
                )
            del self._unrecorded[name]

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
        """Close the wrapped scheduler, then release the lease."""
        try:
            if self.election.current() is not None:
                self._record_unrecorded()
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
        """Wait for the lease; once taken, bring the schedule up to the shared last runs."""
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
        self._unrecorded.clear()  # runs of an earlier hold: the store's records are newer
        self._heap = None  # rebuilt from the schedule as it is now
        return True


def record_keep(entry: Any) -> float:
    """Seconds to keep the record of ``entry``'s run: twice the time to its next run, clamped to
    [``MIN_RECORD_KEEP``, ``RECORD_TTL``], so a removed entry's record goes after two periods."""
    try:
        next_in = float(entry.is_due()[1])
    except Exception:  # an entry whose next run cannot be computed: keep the record longest
        return RECORD_TTL
    return min(RECORD_TTL, max(MIN_RECORD_KEEP, 2 * next_in))


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
