"""Every module logs under the logger name docs/operations.md documents, written out in the module,
so moving or renaming a file cannot silently rename a logger that users filter on."""

from __future__ import annotations

import importlib
import logging
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "celery_lease"

LOGGER_NAMES = {
    "celery_lease._celery.control": "celery_lease.control",
    "celery_lease._celery.deferral": "celery_lease.deferral",
    "celery_lease._celery.early_acquire": "celery_lease.engine",
    "celery_lease._celery.execution": "celery_lease.engine",
    "celery_lease._celery.held_by": "celery_lease.engine",
    "celery_lease._celery.interrupt": "celery_lease.interrupt",
    "celery_lease._celery.on_held": "celery_lease.engine",
    "celery_lease._celery.replace": "celery_lease.engine",
    "celery_lease._celery.reaper": "celery_lease.worker",
    "celery_lease._celery.settings": "celery_lease.config",
    "celery_lease._celery.startup": "celery_lease.worker",
    "celery_lease._celery.unique.common": "celery_lease.unique",
    "celery_lease._celery.worker": "celery_lease.worker",
    "celery_lease._core.aio": "celery_lease.aio",
    "celery_lease._core.dispatch": "celery_lease.dispatch",
    "celery_lease._core.lease": "celery_lease.lease",
    "celery_lease._core.renewer": "celery_lease.renewer",
    "celery_lease.stores.threaded": "celery_lease.aio",
    "celery_lease._forking": "celery_lease.forking",
    "celery_lease.beat.election": "celery_lease.beat",
    "celery_lease.beat.last_runs": "celery_lease.beat",
    "celery_lease.beat.scheduler": "celery_lease.beat",
    "celery_lease.cli": "celery_lease.cli",
    "celery_lease.metrics": "celery_lease.metrics",
    "celery_lease.metrics.prometheus": "celery_lease.metrics.prometheus",
    "celery_lease.signals": "celery_lease.signals",
    "celery_lease.stores._postgres_common": "celery_lease.stores.postgres",
    "celery_lease.stores._redis_cluster": "celery_lease.stores.redis",
    "celery_lease.stores._redis_fast": "celery_lease.stores._redis_fast",
    "celery_lease.stores._redis_sentinel": "celery_lease.stores.redis",
    "celery_lease.stores._sqlite_connections": "celery_lease.stores.sqlite",
    "celery_lease.stores.postgres": "celery_lease.stores.postgres",
    "celery_lease.stores.postgres_async": "celery_lease.stores.postgres_async",
    "celery_lease.stores.redis": "celery_lease.stores.redis",
    "celery_lease.stores.redis_async": "celery_lease.stores.redis_async",
    "celery_lease.stores.sqlite": "celery_lease.stores.sqlite",
}
"""Module -> the name of the logger it logs with."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules_that_log() -> set[str]:
    return {
        _module_name(path)
        for path in PACKAGE.rglob("*.py")
        if re.search(r"getLogger\(", path.read_text(encoding="utf-8"))
    }


class TestLoggerNames:
    @pytest.mark.parametrize("module, name", sorted(LOGGER_NAMES.items()))
    def test_module_logs_under_its_documented_name(self, module: str, name: str) -> None:
        """The module's logger has exactly the name in the table."""
        logger = importlib.import_module(module).logger
        assert isinstance(logger, logging.Logger)
        assert logger.name == name

    def test_every_module_that_logs_is_in_the_table(self) -> None:
        """A module that gets a logger is listed, so its name is pinned too."""
        assert _modules_that_log() == set(LOGGER_NAMES)

    def test_no_module_names_its_logger_after_its_file(self) -> None:
        """No ``getLogger(__name__)``: a file move would rename the logger."""
        offenders = [
            str(path.relative_to(PACKAGE.parent))
            for path in PACKAGE.rglob("*.py")
            if "getLogger(__name__)" in path.read_text(encoding="utf-8")
        ]
        assert offenders == []

    def test_operations_page_lists_every_logger(self) -> None:
        """docs/operations.md names each logger a module uses."""
        page = (PACKAGE.parent / "docs" / "operations.md").read_text(encoding="utf-8")
        missing = sorted(name for name in set(LOGGER_NAMES.values()) if f"`{name}`" not in page)
        assert missing == []
