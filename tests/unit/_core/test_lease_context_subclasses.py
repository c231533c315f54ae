"""LeaseContext (public API) subclassed: what ``with`` runs of a subclass's ``enter``."""

from __future__ import annotations

from celery_lease import Lease, MemoryLockStore
from celery_lease._core.acquire_plan import SentTry
from celery_lease._core.lease import LeaseContext
from celery_lease.testing import FakeClock


class StoreOnEntry(LeaseContext):
    """Picks its store when entered, as AppLeaseContext picks the app's: overrides ``enter``
    (the documented enter) and nothing else."""

    chosen: MemoryLockStore | None = None

    def enter(self, sent: SentTry | None = None) -> Lease:
        assert self.chosen is not None
        self.store = self.chosen
        return super().enter(sent)


def test_with_runs_a_subclass_override_of_enter() -> None:
    """A subclass overriding ``enter`` only: ``with`` runs it. Were LeaseContext's own
    ``enter`` run instead, the lease would be taken in the template's store, not the one
    chosen on entry, and the holder of the same key there would not be seen (the key held by
    two at once)."""
    clock = FakeClock(1000.0)
    template_store, chosen = MemoryLockStore(clock=clock), MemoryLockStore(clock=clock)
    other = chosen.acquire("k", "another-holder", 60_000)
    assert other is not None
    context = StoreOnEntry("k", template_store, 30.0, 0.0, None, 0.0, None, None, clock)
    context.chosen = chosen
    entered_as = None
    try:
        with context as held:
            entered_as = held
    except Exception as exc:  # the override ran: the chosen store refuses, as it must
        assert type(exc).__name__ == "LockNotAcquiredError", exc
        return
    assert entered_as is None, (
        "with skipped StoreOnEntry.enter: acquired 'k' in the template's store while"
        f" another holder has it in the chosen one ({entered_as!r})"
    )
