"""A task's definition as its executions read it: ``ttl`` and ``wait`` from the task's
options, else the app's settings, else the built-in defaults."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_lease import LeaseConfigError, LockedTask, locked
from celery_lease._celery import settings as config
from celery_lease._celery import spec as spec_module
from celery_lease._celery.spec import Spec, options_of
from celery_lease._core.options import LockOptions


def _key(args: tuple[Any, ...], kwargs: Any) -> str:
    return "k"


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("spec", broker="memory://", set_as_current=False)
    yield app
    config.reset(app)


class TestDurations:
    def test_built_in_defaults_without_option_or_setting(self, app: Celery) -> None:
        """Neither the task nor the app says: 30 s ttl, no wait."""
        spec = Spec(LockOptions(), _key)
        assert spec.durations(config.get_settings(app)) == (config.BUILTIN_TTL, config.BUILTIN_WAIT)

    def test_the_setting_applies_where_the_task_sets_nothing(self, app: Celery) -> None:
        """``lease_default_ttl`` and ``lease_default_wait`` fill in; the task's own option wins."""
        app.conf.lease_default_ttl = 60
        app.conf.lease_default_wait = 5
        settings = config.get_settings(app)
        assert Spec(LockOptions(), _key).durations(settings) == (60.0, 5.0)
        assert Spec(LockOptions(ttl=10.0), _key).durations(settings) == (10.0, 5.0)

    def test_new_settings_are_read_again(self, app: Celery) -> None:
        """Worked out once per settings object: settings read anew after a reset apply."""
        spec = Spec(LockOptions(), _key)
        assert spec.durations(config.get_settings(app))[0] == config.BUILTIN_TTL
        app.conf.lease_default_ttl = 90
        config.reset(app)
        assert spec.durations(config.get_settings(app))[0] == 90.0

    def test_a_default_ttl_too_short_for_renewal_is_refused(self, app: Celery) -> None:
        """As ``lease()`` checks its ttl: a ``lease_default_ttl`` under the minimum fails."""
        app.conf.lease_default_ttl = 0.001
        with pytest.raises(LeaseConfigError):
            Spec(LockOptions(), _key).durations(config.get_settings(app))


class TestOptionsOf:
    def test_a_locked_task_class_and_a_locked_body_carry_their_options(self) -> None:
        class Report(LockedTask):  # type: ignore[misc]
            name = "spec.report"
            lock_key = "report"
            lock_ttl = 42

            def run(self) -> None:
                pass

        @locked(key="body", ttl=7)
        def body() -> None:
            pass

        class_options, body_options = options_of(Report), options_of(body)
        assert class_options is not None and class_options.ttl == 42
        assert body_options is not None and body_options.ttl == 7

    @pytest.mark.parametrize("carrier", [object(), object, None, "x"])
    def test_anything_else_carries_none(self, carrier: object) -> None:
        assert options_of(carrier) is None


class TestSpecOfTask:
    """:data:`spec.spec_of_task` (registered by the task module): what the early acquire asks."""

    def test_a_locked_task_gives_its_spec(self, app: Celery) -> None:
        @app.task(base=LockedTask, lock_key="s:{a}", shared=False)
        def body(a: int) -> int:
            return a

        task = app.tasks[body.name]
        spec = spec_module.spec_of_task(task)
        assert spec is not None and spec is task._lock_get_spec()
        assert spec_module.spec_of_task(body) is spec  # through the task's proxy too

    def test_a_plain_task_and_other_objects_give_none(self, app: Celery) -> None:
        @app.task(shared=False)
        def plain(a: int) -> int:
            return a

        assert spec_module.spec_of_task(app.tasks[plain.name]) is None
        assert spec_module.spec_of_task(object()) is None

    def test_a_call_before_locked_tasks_gives_none(self, app: Celery) -> None:
        """A ``__call__`` before LockedTask's may answer without the lock: no spec."""

        class Answers(LockedTask):  # type: ignore[misc]
            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                return super().__call__(*args, **kwargs)

        @app.task(base=Answers, lock_key="c:{a}", shared=False)
        def body(a: int) -> int:
            return a

        assert spec_module.spec_of_task(app.tasks[body.name]) is None
