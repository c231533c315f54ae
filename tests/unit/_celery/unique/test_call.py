"""A call's answers: a duplicate that may not be dropped raises, a failed publish is the
copy's FAILURE for every caller handed its id.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery, chord, group

from celery_lease import AlreadyQueuedError
from tests.unit.conftest import Published
from tests.unit.unique_copies import define_task


class TestCanvasMembers:
    """A group or chord member is published under its own pre-assigned id, and Celery ignores
    what its apply_async returns: handed the existing copy's result instead, its id would never
    finish (GroupResult.get() and the chord's body waiting for ever)."""

    def test_a_duplicate_group_member_raises(self, app: Celery, published: Published) -> None:
        """group(t(4), t(4)): the second member is a duplicate of the first and raises, naming
        it; only the first was published."""
        task = define_task(app, "t.group", lock_unique="until_done")
        with pytest.raises(AlreadyQueuedError) as caught:
            group(task.s(4), task.s(4)).apply_async()
        assert published.ids == [caught.value.task_id]

    def test_a_chord_overlapping_a_waiting_one_raises(
        self, app: Celery, published: Published
    ) -> None:
        """Two chords sharing a member key: the second one raises at the shared member instead
        of leaving its body waiting for a member id that is never published."""
        task = define_task(app, "t.chord", lock_unique="while_queued")
        collect = define_task(app, "t.chord.body")
        chord([task.s(1), task.s(2)], collect.s()).apply_async()
        first = list(published.ids)
        assert len(first) == 2
        with pytest.raises(AlreadyQueuedError) as caught:
            chord([task.s(2), task.s(3)], collect.s()).apply_async()
        assert caught.value.task_id == first[1]
        assert published.ids == first

    def test_a_duplicate_last_chain_step_raises(self, app: Celery, published: Published) -> None:
        """Celery's worker publishes a chain's next step with ``chain=chain[:-1]``
        (celery/app/trace.py): the last step carries ``chain=[]`` and the id the chain's result
        waits for. A duplicate of it raises, naming the existing copy, instead of being handed
        that copy's result while the chain's id is never published."""
        task = define_task(app, "t.chain.last", lock_unique="while_queued")
        first = task.delay(4)
        with pytest.raises(AlreadyQueuedError) as caught:
            task.apply_async((4,), task_id="chain-tail", chain=[], parent_id="p", root_id="r")
        assert caught.value.task_id == first.id
        assert published.ids == [first.id]

    def test_a_group_member_that_is_no_duplicate_is_published(
        self, app: Celery, published: Published
    ) -> None:
        """Members on keys of their own are published as usual, each under its own id."""
        task = define_task(app, "t.group.free", lock_unique="until_done")
        result = group(task.s(5), task.s(6)).apply_async()
        assert published.ids == [r.id for r in result.results]


class TestFailedPublishSeenByDuplicates:
    def test_a_duplicate_of_a_copy_whose_publish_failed_does_not_wait_forever(
        self, app: Celery, published: Published, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """B calls while A is publishing and gets A's id; A's publish then fails: B's result
        ends FAILURE (its get() raises) instead of staying PENDING for ever."""
        task = define_task(app, "r.dup-of-failed", lock_unique="until_done")
        seen: list[Any] = []

        def refuse(*args: Any, **kwargs: Any) -> Any:
            seen.append(task.delay(1))  # B, during A's publish
            raise ConnectionError("broker down")

        with monkeypatch.context() as patch:
            patch.setattr(app, "send_task", refuse)
            with pytest.raises(ConnectionError):
                task.delay(1)
        assert seen and published.ids == []
        assert seen[0].state == "FAILURE"
        with pytest.raises(ConnectionError):
            seen[0].get(timeout=5, propagate=True)
