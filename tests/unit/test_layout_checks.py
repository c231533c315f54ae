"""Each check of the package's shape catches the fault it is for, planted in a small package.

The checks (:mod:`tests.unit.layout_checks`) run on ``celery_lease`` in
``test_package_layout.py``, where they find nothing: these tests show that they can find
something, and that what the tree does by name or by string is seen, not only import statements.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.unit import layout_checks as checks

REPOSITORY = Path(__file__).resolve().parents[2]


def plant(tmp_path: Path, files: dict[str, str]) -> Path:
    """A package ``pkg`` in ``tmp_path`` of ``files`` (path under ``pkg`` -> source); every
    folder gets an ``__init__.py``. Returns the package's root."""
    root = tmp_path / "pkg"
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()
    return root


def accesses(root: Path, **options: set[str]) -> list[str]:
    return [f"{a.file}:{a.line}: {a.name}" for a in checks.private_accesses(root, **options)]


def late_bound(root: Path) -> list[tuple[str, str, str]]:
    return [(e.source, e.target, e.how) for e in checks.edges(root) if e.late_bound]


def cycles(root: Path) -> list[list[str]]:
    return sorted(sorted(group) for group in checks.cycles(checks.graph(checks.edges(root))))


CONTEXT = """
    class Context:
        __slots__ = ("_slot",)

        _table = {}

        def __init__(self):
            self._state = 1

        def _step(self):
            return self._state, self._slot, Context._table
    """


class TestPrivateAccesses:
    def test_getattr_and_its_siblings_with_a_private_name(self, tmp_path: Path) -> None:
        """``getattr/hasattr/setattr/delattr(obj, "_name")`` is a private access like
        ``obj._name``."""
        root = plant(
            tmp_path,
            {
                "_celery/task.py": """
                    def f(ctx):
                        getattr(ctx, "_state", None)
                        hasattr(ctx, "_state")
                        setattr(ctx, "_state", 2)
                        delattr(ctx, "_state")
                        return getattr(ctx, "name"), getattr(ctx, "__dict__")
                    """,
                "_core/context.py": CONTEXT,
            },
        )
        assert accesses(root) == [f"pkg/_celery/task.py:{line}: _state" for line in (3, 4, 5, 6)]

    def test_a_parameter_or_a_string_of_the_name_excuses_nothing(self, tmp_path: Path) -> None:
        """A module that binds ``_entry`` as a parameter or holds the string ``"_entry"`` does
        not define it: its ``lease._entry`` is still a reach."""
        root = plant(
            tmp_path,
            {
                "unique.py": """
                    FIELD = "_entry"

                    def hold(lease, _entry=None):
                        return lease._entry
                    """,
            },
        )
        assert accesses(root) == ["pkg/unique.py:5: _entry"]

    def test_privacy_is_scoped_by_package(self, tmp_path: Path) -> None:
        """A module of the package that defines a private name may use it; a module of another
        package (a sibling, the parent) may not, written or read."""
        source = """
            def read(ctx):
                ctx._state = 2
                return ctx._step(), ctx._slot, ctx._table
            """
        root = plant(
            tmp_path,
            {
                "_core/context.py": CONTEXT,
                "_core/driver.py": source,
                "_celery/task.py": source,
                "cli.py": source,
            },
        )
        uses = [(3, "_state"), (4, "_slot"), (4, "_step"), (4, "_table")]
        assert accesses(root) == [
            f"pkg/{reader}:{line}: {name}"
            for reader in ("_celery/task.py", "cli.py")
            for line, name in uses
        ]

    def test_self_cls_super_conventional_names_and_exempt_modules(self, tmp_path: Path) -> None:
        """Reads on ``self``, ``cls`` and ``super()``, dunders, the conventional names and the
        exempt modules are not reported; module-level private names serve their package."""
        root = plant(
            tmp_path,
            {
                "a.py": """
                    import other

                    _cache = {}

                    class A(other.Base):
                        @classmethod
                        def make(cls):
                            return cls._made, super()._hidden, cls.__name__

                        def f(self, model, row):
                            return self._x, model._meta, row._replace(a=1), other.__doc__
                    """,
                "b.py": "from pkg import a\n\nSIZE = len(a._cache)\n",
                "compat.py": "import other\n\nVALUE = other._internal\n",
            },
        )
        assert accesses(root, conventional={"_meta", "_replace"}, exempt={"pkg.compat"}) == []
        assert accesses(root, conventional={"_meta", "_replace"}) == ["pkg/compat.py:3: _internal"]

    def test_a_private_name_imported_from_another_package(self, tmp_path: Path) -> None:
        """``from pkg._core.x import _name`` is a reach from ``pkg._celery``, not from
        ``pkg._core``."""
        importer = "from pkg._core.context import _helper\nfrom ..context import Public\n"
        root = plant(
            tmp_path,
            {
                "_core/context.py": "def _helper(): ...\n\nclass Public: ...\n",
                "_core/driver.py": "from pkg._core.context import _helper\n",
                "_celery/task.py": importer.replace("..context", "pkg._core.context"),
            },
        )
        found = [str(a) for a in checks.private_imports(root)]
        assert found == ["pkg/_celery/task.py:1: from pkg._core.context import _helper"]


class TestRenamedModules:
    def test_a_module_imported_under_another_name(self, tmp_path: Path) -> None:
        """``settings as config`` is found, in every import form; ``_forking as forking``, a
        name imported from a module and another library's module renamed are not."""
        root = plant(
            tmp_path,
            {
                "_celery/settings.py": "def get(): ...\n",
                "_celery/task.py": """
                    import json as jsonlib
                    import pkg._celery.settings as conf
                    from pkg import _forking as forking
                    from pkg._celery import settings as config
                    from pkg._celery.settings import get as read

                    def later():
                        from . import settings as cfg
                    """,
                "_forking.py": "",
            },
        )
        found = [str(f) for f in checks.renamed_module_imports(root)]
        assert found == [
            "pkg/_celery/task.py:3: pkg._celery.settings as conf",
            "pkg/_celery/task.py:5: pkg._celery.settings as config",
            "pkg/_celery/task.py:9: pkg._celery.settings as cfg",
        ]


class TestLateBoundEdges:
    def test_a_string_naming_a_module_closes_a_cycle(self, tmp_path: Path) -> None:
        """A ``"pkg.x:Name"`` table read by ``importlib`` is an edge: the protocol module that
        imports the table, and the store that imports the protocol, form a cycle."""
        root = plant(
            tmp_path,
            {
                "stores/base.py": "from pkg.stores import table\n",
                "stores/table.py": 'MEMORY = "pkg.stores.memory:MemoryStore"\n',
                "stores/memory.py": "from pkg.stores.base import table\n\nclass MemoryStore: ...\n",
            },
        )
        statements = [e for e in checks.edges(root) if not e.late_bound]
        assert checks.cycles(checks.graph(statements)) == set()
        assert late_bound(root) == [("pkg.stores.table", "pkg.stores.memory", "string")]
        assert cycles(root) == [["pkg.stores.base", "pkg.stores.memory", "pkg.stores.table"]]

    def test_import_module_of_the_celery_layer_from_the_core(self, tmp_path: Path) -> None:
        """``importlib.import_module("pkg._celery.task")`` in the core is an edge: it closes a
        cycle with the Celery layer's import of the core, and goes up a layer."""
        root = plant(
            tmp_path,
            {
                "_core/lease.py": """
                    import importlib

                    def install():
                        importlib.import_module("pkg._celery.task")
                        __import__("pkg._celery.hooks")
                    """,
                "_celery/task.py": "from pkg._core import lease\n",
                "_celery/hooks.py": "",
            },
        )
        assert late_bound(root) == [
            ("pkg._core.lease", "pkg._celery.hooks", "import_module"),
            ("pkg._core.lease", "pkg._celery.task", "import_module"),
        ]
        assert cycles(root) == [["pkg._celery.task", "pkg._core.lease"]]
        stack = checks.layers({"layers": ["pkg.cli | pkg.metrics", "pkg._celery", "pkg._core"]})
        assert stack == [["pkg.cli", "pkg.metrics"], ["pkg._celery"], ["pkg._core"]]
        upward = [(e.source, e.target) for e in checks.layer_violations(checks.edges(root), stack)]
        assert upward == [
            ("pkg._core.lease", "pkg._celery.hooks"),
            ("pkg._core.lease", "pkg._celery.task"),
        ]

    def test_a_relative_import_module(self, tmp_path: Path) -> None:
        """``import_module(".x", __package__)`` is resolved against the calling module's
        package."""
        root = plant(
            tmp_path,
            {
                "_core/lease.py": (
                    "import importlib\n\nimportlib.import_module('..worker', __package__)\n"
                ),
                "worker.py": "",
            },
        )
        assert late_bound(root) == [("pkg._core.lease", "pkg.worker", "import_module")]

    def test_names_that_are_not_edges(self, tmp_path: Path) -> None:
        """A logger's name, a docstring, the package's bare name and a string that only starts
        like a module are not edges."""
        root = plant(
            tmp_path,
            {
                "stores/base.py": '''
                    """See pkg.stores.memory"""
                    import logging

                    logger = logging.getLogger("pkg.stores.memory")
                    TRACER = "pkg"
                    UID = "pkg.stores.memory_flush"
                    STEP = "pkg.stores.memory:Not a name"
                    ''',
                "stores/memory.py": "from pkg.stores import base\n",
            },
        )
        assert late_bound(root) == []
        assert cycles(root) == []


class TestImportLinterContracts:
    def test_lint_imports_is_the_interpreters_own(self) -> None:
        """The ``lint-imports`` run by test_public_api is the one beside ``sys.executable``, which
        exists without the venv activated."""
        from tests.unit.test_public_api import LINT_IMPORTS

        assert Path(sys.executable).parent / "lint-imports" == LINT_IMPORTS
        assert LINT_IMPORTS.is_file()

    @pytest.mark.parametrize(
        ("module", "addon"),
        [
            ("_core/keys.py", "celery_lease.testing"),
            ("_celery/settings.py", "celery_lease.cli"),
            ("stores/memory.py", "celery_lease.fencing"),
        ],
    )
    def test_an_addon_imported_by_the_library_breaks_the_addon_layers(
        self, tmp_path: Path, module: str, addon: str
    ) -> None:
        """In a copy of the package where a module of the library imports an add-on, the add-on
        layer contract of pyproject.toml is broken."""
        from tests.unit.test_public_api import LINT_IMPORTS

        shutil.copytree(REPOSITORY / "celery_lease", tmp_path / "celery_lease")
        shutil.copy(REPOSITORY / "pyproject.toml", tmp_path / "pyproject.toml")
        planted = tmp_path / "celery_lease" / module
        planted.write_text(f"{planted.read_text()}\nimport {addon}  # noqa\n")
        result = subprocess.run(
            [str(LINT_IMPORTS), "--no-cache"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env={"PATH": "", "PYTHONPATH": str(tmp_path)},
        )
        assert result.returncode == 1, result.stdout + result.stderr
        assert "Layers: the add-ons over the library BROKEN" in result.stdout
        assert f"celery_lease.{module[:-3].replace('/', '.')} -> {addon}" in result.stdout
