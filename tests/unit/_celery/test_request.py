"""``celery_lease._celery.request``: the lock attributes on Celery's request ``Context`` always
have a value, ``lock_lost`` reads the lease itself, and no message header can forge a claim."""

from __future__ import annotations

import copy
import pickle
from types import SimpleNamespace

import pytest
from celery.app.task import Context

from celery_lease._celery import request


@pytest.fixture(autouse=True)
def _attributes_defined() -> None:
    """What :func:`celery_lease._celery.wiring.install` does first (defining them again is no
    change)."""
    request.define_attributes()


class TestDefaults:
    def test_a_request_outside_a_locked_execution(self) -> None:
        """A fresh request has every lock attribute, unset: no key, token or lease, not waited,
        not lost, not claimed."""
        fresh = Context()
        assert (fresh.lock_key, fresh.lock_token, fresh.lease) == (None, None, None)
        assert fresh.lock_waited is False and fresh.lock_lost is False
        assert request.is_claimed(fresh) is False

    def test_the_attributes_are_not_message_headers(self) -> None:
        """Defined on the class, they are not in a new request's ``__dict__`` (which retry()
        re-sends as headers)."""
        assert not set(request.FIELDS) & set(Context().__dict__)


class TestLockLost:
    def test_read_from_the_lease(self) -> None:
        """``lock_lost`` follows the lease's own loss record, whenever it is read."""
        held = SimpleNamespace(lost=None)
        running = Context()
        running.__dict__["lease"] = held
        assert running.lock_lost is False
        held.lost = "expired"
        assert running.lock_lost is True

    def test_a_header_cannot_shadow_it(self) -> None:
        """A message header named lock_lost lands in ``__dict__`` and is not what is read."""
        forged = Context({"lock_lost": True})
        assert forged.__dict__["lock_lost"] is True
        assert forged.lock_lost is False


class TestClaimed:
    def test_only_the_marker_object_claims(self) -> None:
        """A header ``_lease_run`` of any JSON value does not claim; CLAIMED does."""
        for value in (True, 1, "1", "CLAIMED", {"x": 1}):
            assert request.is_claimed(Context({"_lease_run": value})) is False
        assert request.is_claimed(Context({"_lease_run": request.CLAIMED})) is True

    def test_the_marker_copies_and_pickles_as_itself(self) -> None:
        """Copying a request (push_request) or pickling it keeps the very same marker."""
        assert copy.copy(request.CLAIMED) is request.CLAIMED
        assert copy.deepcopy(request.CLAIMED) is request.CLAIMED
        assert pickle.loads(pickle.dumps(request.CLAIMED)) is request.CLAIMED


class TestSaveRestore:
    def test_restore_puts_back_values_and_removes_what_was_not_there(self) -> None:
        """An execution's writes are undone: a value set before comes back, an attribute not
        set before is removed (the class default shows again)."""
        ctx = Context({"lock_key": "outer"})
        saved = request.save(ctx)
        ctx.__dict__.update(
            lock_key="inner", lock_token=7, lock_waited=True, _lease_run=request.CLAIMED
        )
        request.restore(ctx, saved)
        assert ctx.lock_key == "outer"
        assert "lock_token" not in ctx.__dict__ and ctx.lock_token is None
        assert ctx.lock_waited is False and request.is_claimed(ctx) is False
