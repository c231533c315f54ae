"""A key held in a store, renewed by the process's renewer until its holder ends it with one final
action (a release, a cooldown, a keep), fenced against a renewal still in flight.

The lease of a ``with`` block (:class:`~celery_lease._core.lease.LeaseContext`) and the queued
key of a running ``"until_done"`` copy (the Celery layer) are both one of these.

::

    held = HeldKey(store, key, owner, ttl, clock=clock, sent_at=sent_at, on_lost=on_lost)
    held.start()                                   # renewed every ttl/3 from here
    settled, final, lapsed = held.stop()           # the holder is done with it
    if final:
        store.release(key, owner)                  # or a cooldown: store.renew(key, owner, ms)
        if not settled and not held.fence(again):  # a renewal in flight may land after it
            again()
"""

from __future__ import annotations

from collections.abc import Callable

from celery_lease._core.renewer import Entry, Renewer, get_renewer
from celery_lease.clock import Clock

__all__ = ["HeldKey"]


class HeldKey:
    """One held key and its renewal.

    Args:
        store: the synchronous store it is held in (the renewer renews through it).
        key, owner: the key and the owner id that holds it.
        ttl: seconds; renewed every ``ttl``/3, its local validity counted from ``sent_at``.
        clock: the clock its renewer runs on.
        sent_at: when the acquire (or renewal) that holds it was sent, in ``clock`` seconds.
        on_lost: ``on_lost(reason)``, called once when a loss is recorded (quick: it runs on
            the thread that recorded it).
        max_hold_at: ``clock`` seconds after which it is no longer renewed (default never).
        token: its fencing token (shown by the renewer's snapshot).
        free_on_loss: release the key owner-checked after an ``"expired"`` or ``"max_hold"``
            loss (default True; False where the owner id is shared by design).
        renew_at: ``clock`` seconds of its first renewal (default ``sent_at`` + ``ttl``/3).
    """

    __slots__ = ("clock", "entry")

    def __init__(
        self,
        store: object,
        key: str,
        owner: str,
        ttl: float,
        *,
        clock: Clock,
        sent_at: float,
        on_lost: Callable[[str], None],
        max_hold_at: float | None = None,
        token: int | None = None,
        free_on_loss: bool = True,
        renew_at: float | None = None,
    ) -> None:
        self.clock = clock
        self.entry = entry = Entry(
            store=store,
            key=key,
            owner=owner,
            ttl=ttl,
            sent_at=sent_at,
            max_hold_at=max_hold_at,
            on_lost=on_lost,
            token=token,
            free_on_loss=free_on_loss,
        )
        if renew_at is not None:
            entry.due = renew_at

    @property
    def renewer(self) -> Renewer:
        renewer = self.entry.renewer
        assert renewer is not None, "HeldKey.start() was not called"
        return renewer

    def start(self) -> None:
        """Hand it to the renewer of its clock and store. If an interrupt cuts this short, it
        is never renewed, and the interrupt propagates (the caller releases the key)."""
        entry = self.entry
        try:
            get_renewer(self.clock, entry.store).add(entry)
        except BaseException:
            if entry.renewer is not None:
                entry.renewer.abandon(entry)
            raise

    def stop(self) -> tuple[bool, bool, str | None]:
        """Stop renewing it: ``(settled, final, lapsed)``, see
        :meth:`~celery_lease._core.renewer.Renewer.remove` (``final``: this holder sends the
        final action; ``lapsed``: a loss recorded now, for :meth:`notify`)."""
        return self.renewer.remove(self.entry)

    def fence(self, action: Callable[[], None]) -> bool:
        """Have the renewer run ``action`` (a store call, never user code) right after the
        renewal in flight is answered; False when none is in flight (the caller runs it)."""
        return self.renewer.fence(self.entry, action)

    def abandon(self) -> str | None:
        """Stop renewing it whatever state an interrupted start or stop left; the loss reason
        recorded now (to :meth:`notify`), if any. Idempotent."""
        renewer = self.entry.renewer
        return None if renewer is None else renewer.abandon(self.entry)

    def record(self, reason: str) -> bool:
        """Record its loss for ``reason`` unless its end is recorded already (then False)."""
        return self.renewer.record(self.entry, reason)

    def settle(self) -> bool:
        """Wait (bounded) for a renewal in flight to be answered; True when none is left."""
        return self.renewer.settle(self.entry)

    def claim_final(self) -> bool:
        """True exactly once: for whoever sends the final action."""
        return self.renewer.claim_final(self.entry)

    def notify(self, reason: str) -> None:
        """Tell its holder (``on_lost``) of a loss recorded by :meth:`stop`, :meth:`record` or
        :meth:`abandon`."""
        Renewer.notify(self.entry, reason)
