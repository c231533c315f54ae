"""The documented public surface imports, and the layering rules hold."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import celery_lease

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
"""The ``lint-imports`` of this interpreter's environment, found beside ``sys.executable`` (not on
``PATH``): a run with a venv's python that is not activated checks with that venv's packages."""

CONTRACT = {
    # the core
    "LockStore",
    "MemoryLockStore",
    "SQLiteLockStore",
    "RedisLockStore",
    "store_from_url",
    "lease",
    "Lease",
    "get_lock_token",
    "current_lease",
    "LeaseError",
    "LockNotAcquiredError",
    "LockLostError",
    "StoreUnavailableError",
    "ReplicaLagError",
    "RestartGraceError",
    # Celery
    "LockedTask",
    "locked",
    # stopping the background threads
    "shutdown",
    # asyncio
    "AsyncLockStore",
    "async_store_from_url",
    "ThreadedAsyncStore",
    "AsyncRedisLockStore",
    "AsyncPostgresLockStore",
}


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60
    )


class TestExports:
    def test_all_is_sorted_and_complete(self) -> None:
        """__all__ is sorted and lists every contract name."""
        assert list(celery_lease.__all__) == sorted(celery_lease.__all__)
        assert set(celery_lease.__all__) >= CONTRACT

    def test_every_exported_name_resolves(self) -> None:
        """Each name in __all__ can be fetched from the package."""
        for name in celery_lease.__all__:
            assert getattr(celery_lease, name) is not None, name

    def test_testing_module(self) -> None:
        """FakeClock is importable from celery_lease.testing."""
        from celery_lease.testing import FakeClock

        clock = FakeClock(5.0)
        clock.advance(1.5)
        assert clock.monotonic() == 6.5


class TestLayering:
    def test_core_does_not_import_celery(self) -> None:
        """Importing the package and using the core loads neither celery nor kombu."""
        result = run_python(
            """
            import sys
            import celery_lease
            from celery_lease import lease, MemoryLockStore
            with lease("k", store=MemoryLockStore()) as held:
                pass
            import celery_lease._core.keys
            bad = sorted(m for m in sys.modules if m.split(".")[0] in ("celery", "kombu"))
            print(bad)
            """
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "[]"

    def test_import_linter_contracts_hold(self) -> None:
        """The import-linter contracts in pyproject.toml (the layers, core without Celery, the
        stores) are kept, checked by :data:`LINT_IMPORTS`."""
        result = subprocess.run(
            [str(LINT_IMPORTS), "--no-cache"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stdout + result.stderr

    def test_missing_extra_names_the_extra(self) -> None:
        """Without redis installed, RedisLockStore fails only on use, naming the extra."""
        result = run_python(
            """
            import sys
            sys.modules["redis"] = None  # as if the extra were not installed
            import celery_lease
            try:
                celery_lease.RedisLockStore
            except ImportError as exc:
                print(exc)
            """
        )
        assert result.returncode == 0, result.stderr
        assert "pip install 'celery-lease[redis]'" in result.stdout

    def test_missing_extra_of_an_async_store_names_the_extra(self) -> None:
        """Without redis / psycopg, the native async stores fail only on use, naming the extra;
        the thread adapter and async_store_from_url need neither."""
        result = run_python(
            """
            import sys
            sys.modules["redis"] = None  # as if the extras were not installed
            sys.modules["psycopg"] = None
            import celery_lease
            from celery_lease import ThreadedAsyncStore, async_store_from_url
            for name in ("AsyncRedisLockStore", "AsyncPostgresLockStore"):
                try:
                    getattr(celery_lease, name)
                except ImportError as exc:
                    print(exc)
            print(type(async_store_from_url("memory://")).__name__)
            """
        )
        assert result.returncode == 0, result.stderr
        assert "pip install 'celery-lease[redis]'" in result.stdout
        assert "pip install 'celery-lease[postgres]'" in result.stdout
        assert "ThreadedAsyncStore" in result.stdout
