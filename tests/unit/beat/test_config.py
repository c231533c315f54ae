"""The leased beat's settings: defaults, the wrapped class, and clear errors at beat start."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from celery.beat import PersistentScheduler, Scheduler

from celery_lease import LeaseConfigError
from celery_lease.beat import LeasedScheduler
from tests.unit.beat.conftest import Beat


class TestConfiguration:
    def test_wraps_the_scheduler_named_in_the_setting(self, beats: Callable[[], Beat]) -> None:
        """The scheduler built is a subclass of both the leased one and the one it wraps."""
        scheduler = beats().scheduler
        assert isinstance(scheduler, LeasedScheduler)
        assert type(scheduler).__mro__[2] is Scheduler

    def test_wraps_persistent_scheduler_by_default(self, app: Celery, tmp_path: Any) -> None:
        """Without ``lease_beat_scheduler`` it wraps Celery's ``PersistentScheduler``."""

        scheduler = LeasedScheduler(
            app=app, schedule_filename=str(tmp_path / "schedule"), lazy=True
        )
        assert isinstance(scheduler, PersistentScheduler)

    @pytest.mark.parametrize(
        ("value", "message"),
        [
            ("nowhere.at_all:Scheduler", "lease_beat_scheduler='nowhere.at_all:Scheduler' cannot"),
            ("celery.beat:Service", "lease_beat_scheduler='celery.beat:Service' is <class"),
            ("celery_lease.beat:LeasedScheduler", "is the leased scheduler itself"),
            (42, "lease_beat_scheduler=42 is not allowed"),
            (
                "tests.unit.beat.failing_import:Scheduler",
                "cannot be imported (RuntimeError: Requested setting USE_TZ",
            ),
        ],
    )
    def test_a_bad_scheduler_fails_naming_the_setting(
        self, app: Celery, value: object, message: str
    ) -> None:
        """An unknown scheduler, or one that is no Scheduler, fails when beat starts."""
        app.conf.lease_beat_scheduler = value
        with pytest.raises(LeaseConfigError, match="lease_beat_scheduler") as info:
            LeasedScheduler(app=app, lazy=True)
        assert message in str(info.value)
        assert "default 'celery.beat:PersistentScheduler'" in str(info.value)

    @pytest.mark.parametrize(
        ("value", "message"),
        [(0, "lease_beat_ttl=0"), ("soon", "lease_beat_ttl='soon'"), (0.01, "too short")],
    )
    def test_a_bad_ttl_fails_naming_the_setting(
        self, app: Celery, value: object, message: str
    ) -> None:
        """A ttl that is no duration, zero, or too short fails when beat starts."""
        app.conf.lease_beat_ttl = value
        with pytest.raises(LeaseConfigError, match=message):
            LeasedScheduler(app=app, lazy=True)

    def test_a_bad_key_fails_naming_the_setting(self, app: Celery) -> None:
        """``lease_beat_key`` must be a non-empty string."""
        app.conf.lease_beat_key = ""
        with pytest.raises(LeaseConfigError, match="lease_beat_key=''"):
            LeasedScheduler(app=app, lazy=True)

    def test_a_misspelled_setting_is_an_error(self, app: Celery) -> None:
        """A typo of a beat setting is caught like every ``lease_*`` typo."""
        app.conf.lease_beat_tll = 3
        with pytest.raises(LeaseConfigError, match="lease_beat_ttl"):
            LeasedScheduler(app=app, lazy=True)

    def test_the_key_and_prefix(self, beat_app: Celery, beats: Callable[[], Beat]) -> None:
        """The lease is held on ``lease_key_prefix`` + ``lease_beat_key``."""
        beat_app.conf.update(lease_key_prefix="prod:", lease_beat_key="nightly")
        beat = beats()
        beat.tick()
        assert beat.scheduler.election.held is not None
        assert beat.scheduler.election.held.key == "prod:nightly"
