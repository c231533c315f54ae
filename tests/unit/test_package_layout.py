"""The package's shape: what each public module exports, exactly, and how modules import each other.

The public surface is the package and the modules below (``celery_lease.errors``, ``.types``, ...):
each one's ``__all__`` is listed here exactly, so adding, removing or renaming a public name is a
visible change of this file. Everything under ``celery_lease._core`` and ``celery_lease._celery``
is private. Import rules between the layers are import-linter contracts (``pyproject.toml``);
the AST checks below cover what import-linter does not: imports made inside functions, and
imports of another module's private names.

The tests mirror the package: every module has a test file of its own name in the mirrored
directory (see :func:`mirrored_tests`), found at run time, so a new module needs its tests.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "celery_lease"
TESTS = PACKAGE.parent / "tests"

# Subpackages whose tests live outside tests/unit: their suites run against real servers.
SERVER_SUITES = {"stores": TESTS / "stores", "fencing": TESTS / "fencing"}

# Modules with no test file of their own, each with the reason. Keep this short.
NO_MIRROR: dict[str, str] = {
    "celery_lease/__init__.py": "re-exports only: its names are EXPORTS above and test_public_api",
    "celery_lease/_core/__init__.py": (
        "a docstring and the one line joining lease() to the async path (every async test uses it)"
    ),
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
    "celery_lease.django": {
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
        "LeaseInfo",
        "LockStore",
        "LoopBinding",
        "SupportsAcquireOrHolder",
        "SupportsBatchRenew",
        "SupportsDeferredRelease",
        "SupportsDeferredRenew",
        "SupportsInspection",
        "SupportsReleaseNotify",
        "conforms",
        "redact_url",
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


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


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


def _imports(module: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, str]]:
    """``(imported module, name)`` for every import statement of ``module``, wherever it is;
    ``name`` is ``""`` when a whole module is imported."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ""
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                if path.name != "__init__.py":
                    parts = parts[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    yield f"{base}.{alias.name}", ""
                else:
                    yield base, alias.name


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        module: {
            target
            for target, _ in _imports(module, path, modules)
            if target in modules and target != module
        }
        for module, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: set[frozenset[str]] = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.add(frozenset(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


# Private attributes read on objects of other libraries by their documented convention: Django's
# model ``_meta`` and ``_default_manager``, and namedtuple's ``_replace``.
CONVENTIONAL_PRIVATE_ATTRIBUTES = {"_meta", "_default_manager", "_replace"}

# The modules whose one job is to reach into other libraries' internals (each entry there names
# the version it was read in); they alone may read other modules' private attributes.
COMPAT_MODULES = {"celery_lease._celery.compat", "celery_lease.stores._redis_compat"}


def _own_names(tree: ast.Module) -> set[str]:
    """Every name a module defines or binds: functions, classes, attributes it assigns (on any
    object), variables, arguments, imports, and ``__slots__`` strings."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.isidentifier()
        ):
            names.add(node.value)
    return names


def private_attribute_reads(source: str) -> list[str]:
    """``obj._name`` reads in ``source`` of a private attribute the module does not define itself
    (``self``/``cls``/``super()`` excluded): reaches into another module's private state."""
    tree = ast.parse(source)
    own = _own_names(tree)
    reads = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") or node.attr in own:
            continue
        if node.attr in CONVENTIONAL_PRIVATE_ATTRIBUTES:
            continue
        value = node.value
        if isinstance(value, ast.Name) and value.id in ("self", "cls"):
            continue
        if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "super":
            continue
        reads.append(f"line {node.lineno}: {ast.unparse(node)}")
    return reads


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
    def test_no_module_imports_another_modules_private_names(self) -> None:
        """``from celery_lease.x import _name`` is a reach into x's privates: none is left."""
        modules = _modules()
        reaches = [
            f"{module} imports {name} from {target}"
            for module, path in sorted(modules.items())
            for target, name in _imports(module, path, modules)
            if target.startswith("celery_lease")
            and name.startswith("_")
            and not name.startswith("__")
        ]
        assert reaches == []

    def test_no_import_cycle(self) -> None:
        """Counting every import statement (inside functions too), no module reaches itself."""
        assert sorted(sorted(group) for group in _cycles(_graph())) == []

    def test_no_module_reads_another_modules_private_attributes(self) -> None:
        """``other._state`` for a ``_state`` the reading module never defines is a reach into
        another module's internals: none is left outside the compat modules."""
        reaches = [
            f"{module} {read}"
            for module, path in sorted(_modules().items())
            if module not in COMPAT_MODULES
            for read in private_attribute_reads(path.read_text())
        ]
        assert reaches == []

    def test_the_private_attribute_scan_finds_a_reach(self) -> None:
        """The check above can fail: a read of a foreign private attribute is found, a module's
        own one, ``self``'s and a conventional one are not."""
        source = (
            "class A:\n"
            "    def __init__(self):\n"
            "        self._mine = 1\n"
            "    def f(self, other, lease, row):\n"
            "        return other._mine, self._x, lease._entry, row._replace(a=1)\n"
        )
        assert private_attribute_reads(source) == ["line 5: lease._entry"]

    def test_the_cycle_finder_finds_a_cycle(self) -> None:
        """The check above can fail: a two-module cycle and a three-module one are found."""
        graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
        assert _cycles(graph) == {frozenset("ab"), frozenset("cde")}


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
            ("stores/_registry.py", ("stores", "test_registry")),
            ("fencing/__init__.py", ("fencing", "test_fencing")),
            ("__init__.py", ("unit", "test_celery_lease")),
        ],
    )
    def test_the_mirrored_place(self, module: str, expected: tuple[str, str]) -> None:
        """The mapping the check above uses, on modules of each kind."""
        directory, prefix = mirrored_tests(PACKAGE / module)
        assert (directory, prefix) == (TESTS / expected[0], expected[1])
