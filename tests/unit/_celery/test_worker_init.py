"""``worker_init``: celery-lease's worker steps are installed whatever else fails there."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest

from celery_lease._celery import reaper, startup, worker

NODE = "w1@host"


class TestSocketDirectory:
    def test_an_unwritable_temp_dir_still_installs_the_worker_steps(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``worker_init`` adds the configuration check (and the reaper) although the socket
        directory of ``inspect leases`` cannot be made: Celery swallows a receiver's error, so
        raising there would silently skip the refusal of a bad configuration."""
        from celery_lease._celery import control

        def no_dir(*args: Any, **kwargs: Any) -> str:
            raise PermissionError(13, "Permission denied", "/tmp")

        monkeypatch.setattr(tempfile, "mkdtemp", no_dir)
        monkeypatch.setattr(control, "_dir", None)
        monkeypatch.setattr(control, "_dir_pid", None)
        monkeypatch.setattr(worker, "_main_pid", worker._main_pid)

        class Steps:
            def __init__(self) -> None:
                self.added: list[Any] = []

            def add(self, step: Any) -> None:
                self.added.append(step)

        class App:
            def __init__(self) -> None:
                self.steps = {"worker": Steps()}

        class Sender:
            hostname = NODE
            app = App()

        from celery_lease._core import owners

        monkeypatch.setattr(owners, "_node", owners._node)
        worker.on_worker_init(sender=Sender())
        assert startup.LeaseCheck in Sender.app.steps["worker"].added
        assert reaper.DeadHolders in Sender.app.steps["worker"].added
        assert control.socket_path(1) is None  # no directory: `inspect` says so per child


class TestStepNames:
    def test_the_worker_steps_have_fixed_names(self) -> None:
        """A user's own step may ``require`` ours by name: the names do not follow the module
        the classes live in."""
        assert (startup.LeaseCheck.name, reaper.DeadHolders.name) == (
            "celery_lease.worker.LeaseCheck",
            "celery_lease.worker.DeadHolders",
        )


class TestMetricsStep:
    def test_the_metrics_step_is_added_by_a_name_that_resolves_to_it(self) -> None:
        """``worker_init`` names the metrics bootstep ``module:attribute``; Celery's blueprint
        imports the add-on from that name when it builds the worker."""
        from celery.utils.imports import symbol_by_name

        from celery_lease.metrics import MetricsStep

        assert symbol_by_name(worker.METRICS_STEP) is MetricsStep

    def test_the_step_added_by_name_and_by_install_is_one_step(self) -> None:
        """``install()`` adds the class, ``worker_init`` the name: the worker builds it once."""
        from celery import bootsteps

        from celery_lease.metrics import MetricsStep

        steps = bootsteps.Blueprint(steps={MetricsStep, worker.METRICS_STEP}).claim_steps()
        assert [step for step in steps.values() if step is MetricsStep] == [MetricsStep]
