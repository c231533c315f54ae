"""The keys and the header check every side of unique shares."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from celery_lease._celery.unique.common import HEADER, header_owner, queued_key, superseded_key
from celery_lease._core.owners import make_owner, queued_owner


class TestKeys:
    def test_the_queued_key_goes_after_the_prefix(self) -> None:
        assert queued_key("app:report:7", "app:") == "app:queued:report:7"

    def test_the_tombstone_key_names_the_task_id(self) -> None:
        assert superseded_key("id-1", "app:").startswith("app:")
        assert superseded_key("id-1", "app:").endswith("id-1")
        assert superseded_key("id-1", "") != superseded_key("id-2", "")


class TestHeaderOwner:
    OWNER = queued_owner("t", "id-1", 1000)

    def request(self, header: object) -> SimpleNamespace:
        return SimpleNamespace(id="id-1", **{HEADER: header})

    def test_the_copys_own_header_names_its_owner(self) -> None:
        request = self.request(["queued:k", self.OWNER])
        assert header_owner(request, "id-1", "queued:k") == self.OWNER
        assert header_owner(request, "id-1", None) == self.OWNER

    @pytest.mark.parametrize(
        ("header", "task_id", "qkey"),
        [
            (["queued:k", OWNER], "id-2", "queued:k"),  # another copy's owner
            (["queued:other", OWNER], "id-1", "queued:k"),  # another key
            (["queued:k", make_owner()], "id-1", "queued:k"),  # not a queued owner
            ("queued:k", "id-1", "queued:k"),  # not a pair
            (["queued:k", OWNER, "x"], "id-1", "queued:k"),
            (["queued:k", OWNER], None, "queued:k"),  # no task id
        ],
    )
    def test_a_header_that_is_not_the_copys_own_names_nothing(
        self, header: object, task_id: str | None, qkey: str
    ) -> None:
        assert header_owner(self.request(header), task_id, qkey) is None
