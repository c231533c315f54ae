"""A key held in a store, renewed by the process's renewer until its holder ends it with one final
action (a release, a cooldown, a keep), fenced against a renewal still in flight: the lease of a
``with`` block and the queued key of a running ``"until_done"`` copy. ::

    held.start(clock)                              # renewed every ttl/3 from here
    settled, final, lapsed = held.stop()
    if final:
        store.release(key, owner)                  # or a keep: store.renew(key, owner, ms)
        if not settled and not held.fence(again):  # a renewal in flight may land after it
            again()
"""

from __future__ import annotations

from collections.abc import Callable

from celery_lease._core.renewer import Entry, Renewer, get_renewer
from celery_lease.clock import Clock


class HeldKey(Entry):
    """A held key: the renewer's :class:`~celery_lease._core.renewer.Entry`, with its holder's
    steps."""

    __slots__ = ()

    def _renewer(self) -> Renewer:
        renewer = self.renewer
        assert renewer is not None, "HeldKey.start() was not called"
        return renewer

    def start(self, clock: Clock, *, renew_at: float | None = None) -> None:
        """Hand it to the renewer of ``clock`` and its store, renewing first at ``renew_at``
        (clock seconds; default a third of its ttl after it was sent). Cut short by an
        interrupt, it is never renewed (the caller releases the key)."""
        if renew_at is not None:
            self.due = renew_at
        try:
            get_renewer(clock, self.store).add(self)
        except BaseException:
            if self.renewer is not None:
                self.renewer.abandon(self)
            raise

    def stop(self) -> tuple[bool, bool, str | None]:
        """Stop renewing it: ``(settled, final, lapsed)`` (:meth:`Renewer.remove`)."""
        renewer = self.renewer
        assert renewer is not None, "HeldKey.start() was not called"
        return renewer.remove(self)

    def fence(self, action: Callable[[], None]) -> bool:
        """Run ``action`` right after the renewal in flight; False when none is (run it now)."""
        return self._renewer().fence(self, action)

    def abandon(self) -> str | None:
        """Stop renewing it whatever state an interrupt left; the loss recorded now, if any."""
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
        """Tell its holder (``on_lost``) of a loss recorded by this holder's steps."""
        Renewer.notify(self, reason)
