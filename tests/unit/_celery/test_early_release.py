"""Early release: a running locked task that publishes its own id lets go of its lease first."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.signals import before_task_publish

from celery_lease import LockedTask, MemoryLockStore
from celery_lease._celery import early_release  # noqa: F401  # connects the receiver
from celery_lease._celery import settings as config


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("early", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.lease_store = MemoryLockStore()
    yield app
    config.reset(app)


def _publish(task_id: str | None, protocol: int = 2) -> None:
    """What Celery sends before a message goes out (task protocol 2: the id in the headers)."""
    if protocol == 2:
        before_task_publish.send(sender="t", headers={"id": task_id}, body=((), {}, {}))
    else:
        before_task_publish.send(sender="t", headers={}, body={"id": task_id})


class TestEarlyRelease:
    @pytest.mark.parametrize("protocol", [1, 2])
    def test_publishing_its_own_id_frees_the_key_first(self, app: Celery, protocol: int) -> None:
        """The lease is released before the message goes out and reads lost ("released")."""
        store = app.conf.lease_store
        seen: list[Any] = []

        @app.task(bind=True, base=LockedTask, lock_key="k", shared=False)
        def resends(self: Any) -> None:
            assert store.get("k") is not None
            _publish(self.request.id, protocol)
            seen.append((store.get("k"), self.request.lock_lost, self.request.lease.lost_reason))

        resends.apply()
        assert seen == [(None, True, "released")]

    def test_another_tasks_id_leaves_the_lease_held(self, app: Celery) -> None:
        store = app.conf.lease_store
        seen: list[Any] = []

        @app.task(bind=True, base=LockedTask, lock_key="k", shared=False)
        def publishes_other(self: Any) -> None:
            _publish("someone-else")
            seen.append((store.get("k") is not None, self.request.lock_lost))

        publishes_other.apply()
        assert seen == [(True, False)]
        assert store.get("k") is None  # released at the end, as usual
