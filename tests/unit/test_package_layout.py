"""The package's shape: what each public module exports, exactly, and how modules import each other.

The public surface is the package and the modules below (``celery_lease.errors``, ``.types``, ...):
each one's ``__all__`` is listed here exactly, so adding, removing or renaming a public name is a
visible change of this file. Everything under ``celery_lease._core`` and ``celery_lease._celery``
is private. Import rules between the layers are import-linter contracts (``pyproject.toml``);
the AST checks below (:mod:`tests.unit.layout_checks`, each shown catching its fault in
``test_layout_checks.py``) cover what import-linter does not: imports made inside functions,
late-bound edges (strings naming our modules, ``import_module``), uses of another package's
private names, and modules imported under another name.

The tests mirror the package: every module has a test file of its own name in the mirrored
directory (see :func:`mirrored_tests`), found at run time, so a new module needs its tests.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from tests.unit import layout_checks as checks

PACKAGE = Path(__file__).resolve().parents[2] / "celery_lease"
TESTS = PACKAGE.parent / "tests"

# Subpackages whose tests live outside tests/unit: their suites run against real servers.
SERVER_SUITES = {"stores": TESTS / "stores", "fencing": TESTS / "fencing"}

# Modules with no test file of their own, each with the reason. Keep this short.
NO_MIRROR: dict[str, str] = {
    "celery_lease/__init__.py": "re-exports only: its names are EXPORTS above and test_public_api",
    "celery_lease/_core/__init__.py": "a docstring only",
    "celery_lease/_celery/__init__.py": "a docstring only",
    "celery_lease/stores/__init__.py": "re-exports only: its names are EXPORTS above",
}

EXPORTS: dict[str, set[str]] = {
    "celery_lease": {
        "AlreadyQueuedError",
        "AsyncLockStore",
        "AsyncPostgresLockStore",
        "AsyncRedisLockStore",
        "Clock",
        "Duration",
        "Lease",
        "LeaseConfigError",
        "LeaseContext",
        "LeaseError",
        "LeaseInfo",
        "LockLostError",
        "LockNotAcquiredError",
        "LockStore",
        "LockedTask",
        "MemoryLockStore",
        "PostgresLockStore",
        "RedisLockStore",
        "ReplicaLagError",
        "RestartGraceError",
        "SQLiteLockStore",
        "StoreUnavailableError",
        "SupportsAcquireOrHolder",
        "SupportsBatchRenew",
        "SupportsInspection",
        "SupportsReleaseNotify",
        "SystemClock",
        "ThreadedAsyncStore",
        "async_store_from_url",
        "current_lease",
        "get_lock_token",
        "lease",
        "locked",
        "shutdown",
        "store_from_url",
        "to_seconds",
    },
    "celery_lease.errors": {
        "AlreadyQueuedError",
        "LeaseConfigError",
        "LeaseError",
        "LockLostError",
        "LockNotAcquiredError",
        "MissingRowError",
        "ReplicaLagError",
        "RestartGraceError",
        "StaleTokenError",
        "StoreUnavailableError",
    },
    "celery_lease.types": {"Duration", "OnDuplicate", "OnHeld", "OnLost", "Unique"},
    "celery_lease.signals": {
        "lock_acquired",
        "lock_duplicate",
        "lock_lost",
        "lock_rejected",
        "lock_released",
        "send",
    },
    "celery_lease.testing": {
        "FakeClock",
        "close_lease_stores",
        "drain",
        "lease_clock",
        "lease_store",
        "override_lease_store",
        "use_lease_store",
    },
    "celery_lease.cli": {"lease_group", "main"},
    "celery_lease.fencing": {"FencingToken", "MissingRowError", "StaleTokenError", "resolve_token"},
    "celery_lease.fencing.redis": {
        "FENCED_HSET_SCRIPT",
        "FENCED_SET_SCRIPT",
        "fenced_hset",
        "fenced_set",
    },
    "celery_lease.fencing.sqlalchemy": {"fenced_update", "fenced_upsert"},
    "celery_lease.fencing.django": {"fenced_update", "fenced_upsert"},
    "celery_lease.stores.django": {
        "AsyncDjangoStore",
        "DjangoStore",
        "POSTGRESQL_ENGINES",
        "SCHEME",
        "SQLITE_ENGINES",
        "async_database_store",
        "database_store",
    },
    "celery_lease.metrics": {
        "DEFAULT_PORT",
        "EXPORTERS",
        "MetricsStep",
        "Sink",
        "connect",
        "disconnect",
        "install",
        "installed",
    },
    "celery_lease.metrics.prometheus": {
        "HOLD_BUCKETS",
        "PortsTaken",
        "PrometheusExporter",
        "PrometheusSink",
        "RENEWAL_BUCKETS",
        "WAIT_BUCKETS",
        "first_free_port",
        "port_in_use",
        "remove_dead_dirs",
    },
    "celery_lease.metrics.otel": {"OtelSink"},
    "celery_lease.stores": {
        "AsyncLockStore",
        "LeaseInfo",
        "LockStore",
        "MemoryLockStore",
        "SupportsBatchRenew",
        "SupportsInspection",
        "SupportsReleaseNotify",
        "async_store_from_url",
        "store_from_url",
    },
    "celery_lease.stores.base": {
        "AsyncLockStore",
        "AsyncSupportsOwnedSlotsRelease",
        "AsyncSupportsSlots",
        "LeaseInfo",
        "LockStore",
        "LoopBinding",
        "SupportsAcquireOrHolder",
        "SupportsBatchRenew",
        "SupportsDeferredRelease",
        "SupportsDeferredRenew",
        "SupportsInspection",
        "SupportsReleaseNotify",
        "SupportsReplace",
        "SupportsOwnedSlotsRelease",
        "SupportsSentAcquire",
        "SupportsSlots",
        "conforms",
        "redact_url",
    },
    "celery_lease.stores.slots": {
        "MAX_LIMIT",
        "REPLACED_MARK",
        "SLOT_MARK",
        "counter_key",
        "marked",
        "release_channel",
        "release_owner_slots",
        "slot_key",
        "split_slot",
        "unmarked",
    },
    "celery_lease.stores.memory": {"MemoryLockStore"},
    "celery_lease.stores.threaded": {"ThreadedAsyncStore"},
    "celery_lease.stores.sqlite": {"SQLiteLockStore"},
    "celery_lease.stores.redis": {
        "ACQUIRE_SCRIPT",
        "FORCE_RELEASE_SCRIPT",
        "INSPECT_SCRIPT",
        "RELEASE_SCRIPT",
        "RENEW_CHUNK",
        "RENEW_MANY_SCRIPT",
        "RENEW_SCRIPT",
        "RedisLockStore",
        "SentinelURL",
        "parse_sentinel_url",
    },
    "celery_lease.stores.redis_async": {"AsyncRedisLockStore"},
    "celery_lease.stores.postgres": {
        "DEFAULT_TABLE",
        "PostgresLockStore",
        "SCHEMA_SQL",
        "statements",
    },
    "celery_lease.stores.postgres_async": {"AsyncPostgresLockStore"},
    "celery_lease.clock": {"Clock", "SYSTEM_CLOCK", "SystemClock"},
    "celery_lease.durations": {"Duration", "to_seconds"},
}


def mirrored_tests(module: Path) -> tuple[Path, str]:
    """Where the tests of ``module`` (a file under :data:`PACKAGE`) live: ``(directory, prefix)``;
    at least one ``<prefix>*.py`` must exist in the directory.

    ``celery_lease/<sub>/<name>.py`` -> ``tests/unit/<sub>/test_<name>*.py`` (``<sub>`` may be
    several levels, or none: ``celery_lease/clock.py`` -> ``tests/unit/test_clock*.py``), except
    :data:`SERVER_SUITES`: ``celery_lease/stores/<name>.py`` -> ``tests/stores/test_<name>*.py``.
    A leading underscore is dropped (``_forking.py`` -> ``test_forking*.py``), and a package's
    ``__init__.py`` is tested as the package (``metrics/__init__.py`` ->
    ``tests/unit/metrics/test_metrics*.py``).
    """
    parts = module.relative_to(PACKAGE).parts
    folders, name = parts[:-1], Path(parts[-1]).stem
    if name == "__init__":
        name = folders[-1] if folders else PACKAGE.name
    if folders and folders[0] in SERVER_SUITES:
        directory = SERVER_SUITES[folders[0]].joinpath(*folders[1:])
    else:
        directory = TESTS.joinpath("unit", *folders)
    return directory, f"test_{name.lstrip('_')}"


# Private attributes read on objects of other libraries by their documented convention: Django's
# model ``_meta`` and ``_default_manager``, and namedtuple's ``_replace``.
CONVENTIONAL_PRIVATE_ATTRIBUTES = {"_meta", "_default_manager", "_replace"}

# The modules whose one job is to reach into other libraries' internals (each entry there names
# the version it was read in); they alone may use other packages' private names.
COMPAT_MODULES = {
    "celery_lease._celery.compat",
    "celery_lease.stores._redis_compat",
    "celery_lease.stores._typing_compat",
}

# The faults the checks below still find in the tree, each named exactly: (file, private name),
# (file, the other name a module is imported under) and (file, module a late-bound edge
# reaches). They are in modules being rebuilt (the store table leaves stores/base.py, the
# Celery layer's receivers are wired in one place); an entry that no longer matches a fault
# fails its test, so the lists only shrink, and they end empty.
ALLOWED_PRIVATE_ACCESSES: dict[tuple[str, str], str] = {}
ALLOWED_RENAMED_MODULES: dict[tuple[str, str], str] = {}
ALLOWED_LATE_BOUND_EDGES: dict[tuple[str, str], str] = {
    ("celery_lease/_celery/worker.py", "celery_lease.metrics"): (
        "METRICS_STEP names the metrics bootstep: the Celery layer reaches the add-on above it"
    ),
}


def _late_bound_faults(edges: list[checks.Edge]) -> list[checks.Edge]:
    """The late-bound edges that close a cycle or go up a layer of an import-linter contract."""
    return sorted(
        {e for e in checks.edges_in_cycles(edges) if e.late_bound}
        | {e for stack in _layer_contracts() for e in checks.layer_violations(edges, stack)}
    )


def _layer_contracts() -> list[list[list[str]]]:
    """The layers of each ``type = "layers"`` import-linter contract of ``pyproject.toml``."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on, as lint-imports
    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    contracts = pyproject["tool"]["importlinter"]["contracts"]
    return [checks.layers(c) for c in contracts if c["type"] == "layers"]


class TestExportedMembers:
    @pytest.mark.parametrize("module", sorted(EXPORTS))
    def test_all_is_exactly_the_public_names(self, module: str) -> None:
        """Each public module's ``__all__`` is exactly its listed names, and each one imports."""
        imported = importlib.import_module(module)
        assert set(imported.__all__) == EXPORTS[module]
        assert len(imported.__all__) == len(EXPORTS[module])  # no name twice
        missing = [name for name in imported.__all__ if not hasattr(imported, name)]
        assert missing == []


class TestImports:
    def test_no_module_imports_another_packages_private_names(self) -> None:
        """``from celery_lease.x import _name`` outside x's package is a reach into its
        privates: none is left (inside one package it is the package's own business)."""
        assert [str(found) for found in checks.private_imports(PACKAGE)] == []

    def test_no_import_cycle_counting_late_bound_edges(self) -> None:
        """Counting every import statement (inside functions too), every string naming one of
        our modules and every ``import_module`` of one, no module reaches itself (but through
        the allowed edges)."""
        edges = [e for e in checks.edges(PACKAGE) if not _allowed(e)]
        assert sorted(sorted(group) for group in checks.cycles(checks.graph(edges))) == []

    def test_late_bound_edges_keep_the_layers(self) -> None:
        """The layers import-linter checks for import statements hold for late-bound edges."""
        edges = [e for e in checks.edges(PACKAGE) if not _allowed(e)]
        found = [
            str(e) for stack in _layer_contracts() for e in checks.layer_violations(edges, stack)
        ]
        assert found == []

    def test_every_allowed_late_bound_edge_is_still_a_fault(self) -> None:
        """Each entry of ALLOWED_LATE_BOUND_EDGES names a late-bound edge that closes a cycle or
        goes up a layer today: one that was fixed is removed from the list."""
        faults = {(e.file, e.target) for e in _late_bound_faults(checks.edges(PACKAGE))}
        assert sorted(set(ALLOWED_LATE_BOUND_EDGES) - faults) == []

    def test_no_module_uses_another_packages_private_names(self) -> None:
        """``other._state`` and ``getattr(other, "_state")`` for a ``_state`` its package never
        defines is a reach into another package's internals: none is left outside the compat
        modules (but the allowed ones)."""
        found = [
            str(a) for a in _private_accesses() if (a.file, a.name) not in ALLOWED_PRIVATE_ACCESSES
        ]
        assert found == []

    def test_every_allowed_private_access_is_still_made(self) -> None:
        """Each entry of ALLOWED_PRIVATE_ACCESSES is still found: a fixed one leaves the list."""
        made = {(a.file, a.name) for a in _private_accesses()}
        assert sorted(set(ALLOWED_PRIVATE_ACCESSES) - made) == []

    def test_every_module_is_imported_under_its_own_name(self) -> None:
        """``import settings as config`` gives one module two names: none is left (but the
        allowed ones), and every allowed one is still there."""
        found = {(f.file, f.name): str(f) for f in checks.renamed_module_imports(PACKAGE)}
        assert [text for key, text in found.items() if key not in ALLOWED_RENAMED_MODULES] == []
        assert sorted(set(ALLOWED_RENAMED_MODULES) - set(found)) == []


def _allowed(edge: checks.Edge) -> bool:
    return edge.late_bound and (edge.file, edge.target) in ALLOWED_LATE_BOUND_EDGES


def _private_accesses() -> list[checks.Finding]:
    return checks.private_accesses(
        PACKAGE, exempt=COMPAT_MODULES, conventional=CONVENTIONAL_PRIVATE_ATTRIBUTES
    )


class TestTestsMirrorThePackage:
    def test_every_module_has_tests_of_its_own_name(self) -> None:
        """For each module of the package, found now (a new one counts at once), a test file
        named after it exists in the mirrored directory, unless it is in NO_MIRROR."""
        missing = []
        for module in sorted(PACKAGE.rglob("*.py")):
            if str(module.relative_to(PACKAGE.parent)) in NO_MIRROR:
                continue
            directory, prefix = mirrored_tests(module)
            if not list(directory.glob(f"{prefix}*.py")):
                missing.append(f"{module.relative_to(PACKAGE.parent)}: no {directory}/{prefix}*.py")
        assert missing == []

    def test_every_exemption_is_a_module_of_the_package(self) -> None:
        """An exemption of a module that moved or went away is removed, not kept."""
        stale = [path for path in NO_MIRROR if not (PACKAGE.parent / path).is_file()]
        assert stale == []

    @pytest.mark.parametrize(
        ("module", "expected"),
        [
            ("_core/renewer.py", ("unit/_core", "test_renewer")),
            ("_celery/__init__.py", ("unit/_celery", "test_celery")),
            ("clock.py", ("unit", "test_clock")),
            ("_forking.py", ("unit", "test_forking")),
            ("metrics/__init__.py", ("unit/metrics", "test_metrics")),
            ("metrics/otel.py", ("unit/metrics", "test_otel")),
            ("stores/registry.py", ("stores", "test_registry")),
            ("fencing/__init__.py", ("fencing", "test_fencing")),
            ("__init__.py", ("unit", "test_celery_lease")),
        ],
    )
    def test_the_mirrored_place(self, module: str, expected: tuple[str, str]) -> None:
        """The mapping the check above uses, on modules of each kind."""
        directory, prefix = mirrored_tests(PACKAGE / module)
        assert (directory, prefix) == (TESTS / expected[0], expected[1])
