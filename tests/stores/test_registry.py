"""One table of stores: every reader of a store URL knows exactly the schemes of the table.

``celery_lease.stores.registry.SCHEMES`` maps a URL scheme to its store classes as
``"module:Class"`` strings. ``store_from_url``, ``async_store_from_url`` and the settings check
that refuses a misspelled ``lease_store`` at worker start all read it; the table and the
factories live in ``stores/registry.py``, so the store protocol module (``stores/base.py``)
imports no store: each store imports it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from celery import Celery

from celery_lease import LeaseConfigError
from celery_lease._celery import settings as config
from celery_lease.stores import async_store_from_url, registry, store_from_url

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "celery_lease"


class UrlStore:
    """A stand-in store class served by a scheme of a patched table: it keeps its URL."""

    def __init__(self, url: str) -> None:
        self.url = url


class AsyncUrlStore(UrlStore):
    """A stand-in native async store class, built with ``from_url`` as the real ones are."""

    @classmethod
    def from_url(cls, url: str) -> AsyncUrlStore:
        return cls(url)


STAND_IN = registry.Entry(f"{__name__}:UrlStore", f"{__name__}:AsyncUrlStore", None, None)


def _paths() -> list[str]:
    named = {
        path
        for entry in registry.SCHEMES.values()
        for path in (entry.sync, entry.native_async)
        if path is not None
    }
    return sorted(named)


@pytest.fixture
def apps() -> Iterator[list[Celery]]:
    """Apps a test creates; their cached settings are forgotten afterwards."""
    made: list[Celery] = []
    yield made
    for app in made:
        config.reset(app)
        app.close()


def _settings_error(apps: list[Celery], url: str) -> LeaseConfigError | None:
    """What the settings check (the one a worker runs at start) says of ``lease_store=url``."""
    app = Celery("registry", broker="memory://", set_as_current=False)
    app.conf.lease_store = url
    apps.append(app)
    try:
        config.get_settings(app)
    except LeaseConfigError as exc:
        return exc
    return None


def _patch_table(monkeypatch: pytest.MonkeyPatch, table: Mapping[str, registry.Entry]) -> None:
    monkeypatch.setattr(registry, "SCHEMES", table)


TYPING_COMPAT = "celery_lease.stores._typing_compat"


class TestTheTable:
    @pytest.mark.parametrize("path", _paths())
    def test_every_class_named_is_that_class_of_that_module(self, path: str) -> None:
        """Each ``"module:Class"`` of the table resolves to a class defined in the module it
        names."""
        module_name, _, class_name = path.partition(":")
        cls = registry.resolve(path)
        assert isinstance(cls, type)
        assert (cls.__module__, cls.__name__) == (module_name, class_name)

    @pytest.mark.parametrize("scheme", registry.known_schemes())
    def test_every_scheme_resolves_to_its_classes(self, scheme: str) -> None:
        """sync_class / async_class give the classes the scheme's entry names (None: no native
        async store, the thread adapter serves it)."""
        entry = registry.SCHEMES[scheme]
        assert registry.sync_class(scheme) is registry.resolve(entry.sync)
        native = registry.async_class(scheme)
        if entry.native_async is None:
            assert native is None
        else:
            assert native is registry.resolve(entry.native_async)

    def test_every_extra_named_is_declared(self) -> None:
        """An extra the table names for a driver is one ``pip install 'celery-lease[extra]'``
        can install."""
        tomllib = pytest.importorskip("tomllib")
        declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
            "optional-dependencies"
        ]
        named = {entry.extra for entry in registry.SCHEMES.values()} - {None}
        assert named and named <= set(declared)

    def test_the_store_protocol_imports_no_store(self) -> None:
        """stores/base.py imports, even inside a function, nothing of celery-lease but the typing
        compat module: not the table, not a store (each store imports it)."""
        tree = ast.parse((PACKAGE / "stores" / "base.py").read_text())
        imported: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, ast.dump(node)
                module = node.module or ""
                imported.add(module)
                imported.update(f"{module}.{alias.name}" for alias in node.names)
        ours = {name for name in imported if name.split(".")[0] == "celery_lease"}
        assert ours - {TYPING_COMPAT, f"{TYPING_COMPAT}.is_protocol"} == set()
        stores = {
            f"celery_lease.stores.{path.stem}"
            for path in (PACKAGE / "stores").glob("*.py")
            if path.stem not in ("__init__", "base", "registry")
        }
        named = {path.partition(":")[0] for path in _paths()}
        assert named <= stores | {"celery_lease.stores.django"}


class TestEveryReaderUsesTheTable:
    def test_store_from_url_and_the_settings_check_accept_exactly_the_tables_schemes(
        self, monkeypatch: pytest.MonkeyPatch, apps: list[Celery]
    ) -> None:
        """With a scheme added to the table and one taken out, store_from_url builds a store
        for exactly the table's schemes, and the settings check accepts exactly those."""
        table = {scheme: STAND_IN for scheme in registry.known_schemes() if scheme != "unix"}
        table["valkey"] = STAND_IN
        _patch_table(monkeypatch, table)
        for scheme in table:
            url = f"{scheme}://h/0"
            built = store_from_url(url)
            assert isinstance(built, UrlStore) and built.url == url
            assert _settings_error(apps, url) is None, scheme
        for url in ("unix:///tmp/redis.sock", "reddis://h/0"):
            with pytest.raises(LeaseConfigError, match="unknown scheme"):
                store_from_url(url)
            error = _settings_error(apps, url)
            assert error is not None and "unknown scheme" in str(error)

    def test_a_scheme_added_to_the_table_is_known_everywhere(
        self, monkeypatch: pytest.MonkeyPatch, apps: list[Celery]
    ) -> None:
        """A new scheme is built by async_store_from_url too, and every refusal lists it."""
        added = STAND_IN._replace(example="valkey://")
        _patch_table(monkeypatch, {**registry.SCHEMES, "valkey": added})
        built = async_store_from_url("valkey://h/0")
        assert isinstance(built, AsyncUrlStore) and built.url == "valkey://h/0"
        assert "valkey" in registry.known_schemes()
        with pytest.raises(LeaseConfigError, match="valkey://"):
            store_from_url("nope://h/0")
        with pytest.raises(LeaseConfigError, match="valkey://"):
            async_store_from_url("nope://h/0")
        error = _settings_error(apps, "nope://h/0")
        assert error is not None and "valkey://" in str(error)
