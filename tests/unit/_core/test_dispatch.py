"""The dispatcher (:mod:`celery_lease._core.dispatch`): user callbacks run off the core's
threads."""

from __future__ import annotations

import logging
import sys
import threading

import pytest

from celery_lease._core.dispatch import drain, get_dispatcher
from tests.unit.core_faults import REAL


class TestCallbackErrors:
    """A callback that raises, even a BaseException, is logged and the next one runs."""

    def test_a_dispatched_callback_raising_system_exit_is_logged(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """SystemExit in a callback is logged like any error, and the next callback runs."""
        ran = threading.Event()
        with caplog.at_level(logging.ERROR, logger="celery_lease"):
            get_dispatcher().submit(lambda _: sys.exit(3), None, "callback that exits")
            get_dispatcher().submit(lambda _: ran.set(), None, "next callback")
            assert drain() and ran.wait(REAL)
        assert any("callback that exits" in r.getMessage() for r in caplog.records), caplog.text
