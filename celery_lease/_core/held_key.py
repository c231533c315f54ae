"""A key held in a store, renewed by the process's renewer until its holder ends it with one final
action (a release, a cooldown, a keep), fenced against a renewal still in flight: the lease of a
``with`` block (:class:`~celery_lease._core.lease.LeaseContext`) and the queued key of a running
``"until_done"`` copy (the Celery layer).

::

    held = HeldKey(store=store, key=key, owner=owner, ttl=ttl, sent_at=sent_at,
                   max_hold_at=None, on_lost=on_lost)  # Entry's arguments
    held.start(clock)                              # renewed every ttl/3 from here
    settled, final, lapsed = held.stop()           # the holder is done with it
    if final:
        store.release(key, owner)                  # or a keep: store.renew(key, owner, ms)
        if not settled and not held.fence(again):  # a renewal in flight may land after it
            again()
"""

from __future__ import annotations

from collections.abc import Callable

from celery_lease._core.renewer import Entry, Renewer, get_renewer
from celery_lease.clock import Clock

__all__ = ["HeldKey"]


class HeldKey(Entry):
    """A held key (built as the renewer's :class:`~celery_lease._core.renewer.Entry`, whose
    fields it reads) with its holder's steps as methods."""

    __slots__ = ()

    def _renewer(self) -> Renewer:
        renewer = self.renewer
        assert renewer is not None, "HeldKey.start() was not called"
        return renewer

    def start(self, clock: Clock, *, renew_at: float | None = None) -> None:
        """Hand it to the renewer of ``clock`` and its store, which renews it first at
        ``renew_at`` (clock seconds; default a third of its ttl after it was sent). If an
        interrupt cuts this short, it is never renewed, and the interrupt propagates (the
        caller releases the key)."""
        if renew_at is not None:
            self.due = renew_at
        try:
            get_renewer(clock, self.store).add(self)
        except BaseException:
            if self.renewer is not None:
                self.renewer.abandon(self)
            raise

    def stop(self) -> tuple[bool, bool, str | None]:
        """Stop renewing it: ``(settled, final, lapsed)``, see
        :meth:`~celery_lease._core.renewer.Renewer.remove` (``final``: this holder sends the
        final action; ``lapsed``: a loss recorded now, for :meth:`notify`)."""
        renewer = self.renewer
        assert renewer is not None, "HeldKey.start() was not called"
        return renewer.remove(self)

    def fence(self, action: Callable[[], None]) -> bool:
        """Have the renewer run ``action`` (a store call, never user code) right after the
        renewal in flight is answered; False when none is in flight (the caller runs it)."""
        return self._renewer().fence(self, action)

    def abandon(self) -> str | None:
        """Stop renewing it whatever state an interrupted start or stop left; the loss reason
        recorded now (to :meth:`notify`), if any. Idempotent."""
        return None if self.renewer is None else self.renewer.abandon(self)

    def record(self, reason: str) -> bool:
        """Record its loss for ``reason`` unless its end is recorded already (then False)."""
        return self._renewer().record(self, reason)

    def settle(self) -> bool:
        """Wait (bounded) for a renewal in flight to be answered; True when none is left."""
        return self._renewer().settle(self)

    def claim_final(self) -> bool:
        """True exactly once: for whoever sends the final action."""
        return self._renewer().claim_final(self)

    def notify(self, reason: str) -> None:
        """Tell its holder (``on_lost``) of a loss recorded by :meth:`stop`, :meth:`record` or
        :meth:`abandon`."""
        Renewer.notify(self, reason)
