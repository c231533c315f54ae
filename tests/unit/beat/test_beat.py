"""The public names of the leased beat add-on."""

from __future__ import annotations

from celery.utils.imports import symbol_by_name

import celery_lease
import celery_lease.beat
from celery_lease.beat import TOKEN_HEADER, LeasedScheduler


def test_celery_beat_finds_the_scheduler_by_its_documented_name() -> None:
    """``celery beat -S celery_lease.beat:LeasedScheduler`` resolves to the class."""
    assert symbol_by_name("celery_lease.beat:LeasedScheduler") is LeasedScheduler


def test_the_header_name() -> None:
    """Messages carry the token under ``lease_beat_token``."""
    assert TOKEN_HEADER == "lease_beat_token"


def test_the_package_does_not_load_the_add_on() -> None:
    """``import celery_lease`` exports no beat name: beat is an add-on imported on its own."""
    assert "LeasedScheduler" not in celery_lease.__all__
    assert celery_lease.beat.__all__ == ["TOKEN_HEADER", "LeasedScheduler"]
