"""Every test of the Celery layer starts from a process as a fresh import leaves it: an
in-process worker sets the owners' node name and Celery's logging set-up lowers the root
logger, and a later test in the same process would read both."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from celery_lease._core import owners


@pytest.fixture(autouse=True)
def _process_defaults_restored() -> Iterator[None]:
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    owners.set_node(None)  # no worker runs in this process between tests
    root.setLevel(level)
    root.handlers[:] = handlers


@pytest.fixture
def quiet_core_logs() -> Iterator[None]:
    """The core's log lines silenced for the test (an explorer's timelines say what they would,
    and thousands of runs, failed releases among them, would log a lot)."""
    logger = logging.getLogger("celery_lease")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)
