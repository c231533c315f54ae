"""The package's shape: what each public module exports, exactly, and how modules import each other.

The public surface is the package and the modules below (``celery_lease.errors``, ``.types``, ...):
each one's ``__all__`` is listed here exactly, so adding, removing or renaming a public name is a
visible change of this file. Everything under ``celery_lease._core`` and ``celery_lease._celery``
is private. Import rules between the layers are import-linter contracts (``pyproject.toml``);
the AST checks below cover what import-linter does not: imports made inside functions, and
imports of another module's private names.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "celery_lease"

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
        "PrometheusExporter",
        "PrometheusSink",
        "RENEWAL_BUCKETS",
        "WAIT_BUCKETS",
        "port_in_use",
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
        "async_store_from_url",
        "redact_url",
        "store_from_url",
    },
    "celery_lease.stores.memory": {"MemoryLockStore"},
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

    def test_the_cycle_finder_finds_a_cycle(self) -> None:
        """The check above can fail: a two-module cycle and a three-module one are found."""
        graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
        assert _cycles(graph) == {frozenset("ab"), frozenset("cde")}
