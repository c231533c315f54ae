"""Review of the engine's choice to defer a release: each test failed before its fix."""

from __future__ import annotations

import gc
from typing import Any

from celery import Celery
from celery.utils.dispatch import Signal

from celery_lease import LockedTask, deferral, signals

# The engine's own path is traced as a worker runs it, with test_deferred_release's harness.
from tests.unit.test_deferred_release import (  # noqa: F401 (fixtures)
    DeferringStore,
    app,
    log,
    only_our_receivers,
    solo_worker,
    store,
    traced,
)


def _ours(**_: Any) -> None:
    pass


_ours.__module__ = "celery_lease.review_stand_in"  # stands for celery_lease.worker's receiver


class TestOnlyOurs:
    def test_a_receiver_reconnected_under_a_dead_ones_uid_is_seen(self) -> None:
        signal = Signal(name="review_success")
        signal.connect(_ours, weak=False, dispatch_uid="celery_lease.review")

        def first(**_: Any) -> None:
            pass

        signal.connect(first, dispatch_uid="myapp.notify_done")  # weak, the default
        del first
        gc.collect()  # dead, not yet swept from signal.receivers (swept at the next connect)
        assert deferral.only_ours(signal)  # right: the dead one runs no more

        def second(**_: Any) -> None:  # e.g. a reloaded module's handler, same uid
            pass

        signal.connect(second, dispatch_uid="myapp.notify_done")
        assert [r for r in signal._live_receivers(None)] == [_ours, second]
        assert not deferral.only_ours(signal)  # a foreign receiver now runs after the task

    def test_control_a_live_foreign_receiver_is_seen(self) -> None:
        signal = Signal(name="review_success_2")
        signal.connect(_ours, weak=False, dispatch_uid="celery_lease.review")

        def foreign(**_: Any) -> None:
            pass

        signal.connect(foreign, dispatch_uid="myapp.other")
        assert not deferral.only_ours(signal)
        del foreign


class TestLockReleasedReceivers:
    def test_a_lock_released_receiver_finds_the_key_free(
        self,
        app: Celery,  # noqa: F811 (the imported fixture)
        store: DeferringStore,  # noqa: F811
    ) -> None:
        @app.task(base=LockedTask, lock_key="lr:{n}", shared=False)
        def quiet(n: int) -> None:
            return None

        seen: list[object] = []

        def on_released(key: str, **_: Any) -> None:
            seen.append(store.get(key))  # e.g. tell a scheduler the slot is free

        signals.lock_released.connect(on_released, weak=False)
        try:
            traced(app, quiet)(1)
        finally:
            signals.lock_released.disconnect(on_released)
        assert seen == [None]
