"""A forged lease_queued header frees nothing: not when the copy is revoked, rejected or
started.
"""

from __future__ import annotations

from types import SimpleNamespace

from celery import Celery

from celery_lease._celery import settings as config
from celery_lease._celery import unique as unique_module
from celery_lease._celery.unique import common as unique_common
from celery_lease._core.owners import parse_owner, queued_owner
from tests.unit.conftest import Published, SpyStore
from tests.unit.unique_copies import (
    define_task,
    start_copy,
)


class TestForgedHeader:
    def test_a_revoked_copy_frees_only_a_queued_key(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        """task_revoked with a header naming a key outside the queued namespace frees nothing,
        even when that key's owner happens to carry the same text."""
        task = define_task(app, "r.forged", lock_unique="while_queued")
        owner = queued_owner(task.name, "victim-id", 1)
        store.acquire("k:other", owner, 60_000)  # some lease that is not a queued lease
        request = SimpleNamespace(id="victim-id", **{unique_common.HEADER: ["k:other", owner]})
        unique_module.on_task_revoked(sender=task, request=request)
        assert store.get("k:other") is not None

    def test_a_header_naming_another_copy_is_not_trusted(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        """A message carrying another copy's [queued key, owner] frees nothing when it starts."""
        task = define_task(app, "r.forged-start", lock_unique="while_queued")
        victim = task.delay(1)
        settings = config.get_settings(app)
        forged = SimpleNamespace(
            id="attacker-id",
            is_eager=False,
            **{unique_common.HEADER: published.headers[0][unique_common.HEADER]},
        )
        unique = type(task)._lock_options.unique
        assert start_copy(task, forged, store, "k:1", settings, unique, 30, 0) is None
        unique_module.on_rejected(forged, store, "k:1", settings)
        unique_module.on_task_revoked(sender=task, request=forged)
        info = store.get("queued:k:1")
        assert info is not None and parse_owner(info.owner).task_id == victim.id
