"""The checks of the package's shape, as functions of a package root, so that a test can run each
one on a small package planted in a temporary directory and see it catch the fault it is for.

What a check sees is what the code does, not only its import statements:

- an **import edge** is an import statement (at module level or inside a function), a string
  that names one of our modules (``"pkg.x.y"`` or ``"pkg.x.y:Name"``: a table read by
  ``importlib``, a Celery bootstep's ``requires``) and a call of ``importlib.import_module`` /
  ``__import__`` with a constant name. The last two are *late-bound* edges: the interpreter
  follows them when the code runs, import-linter never does. A logger's name
  (``logging.getLogger("pkg.x")``), a docstring and the bare name of the package (a tracer's or a
  table's name) are names, not edges.
- a **private access** is ``obj._name`` (read, written or deleted) and
  ``getattr/hasattr/setattr/delattr(obj, "_name")``, on anything but ``self``, ``cls`` and
  ``super()``. Privacy is scoped by package (trio's rule): the modules directly inside one package
  (``pkg._core.*``) may use each other's private names; a private name is *defined* by a package
  when one of its modules defines it in a class body, assigns it on ``self``/``cls``, binds it at
  module level or lists it in ``__slots__``. An access to a private name its package does not
  define is a reach into another package's (or another library's) internals. A parameter of
  that name, or a string equal to it, defines nothing.

Without types, a name defined by two packages is taken as the reader's own: the check is exact
for names one package owns, which is the rule the code keeps (private names carry their
package's vocabulary).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SELF_NAMES = frozenset({"self", "cls"})
ATTRIBUTE_FUNCTIONS = frozenset({"getattr", "hasattr", "setattr", "delattr"})
IMPORT_FUNCTIONS = frozenset({"import_module", "__import__"})
LOGGER_FUNCTIONS = frozenset({"getLogger"})


@dataclass(frozen=True, order=True)
class Edge:
    """``source`` depends on ``target`` (both dotted module names) at ``line`` of ``file``;
    ``how`` is ``"import"`` (a statement), ``"import_module"`` (a call) or ``"string"``."""

    source: str
    target: str
    file: str
    line: int
    how: str

    @property
    def late_bound(self) -> bool:
        return self.how != "import"

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.source} -> {self.target} ({self.how})"


@dataclass(frozen=True, order=True)
class Finding:
    """``text`` at ``line`` of ``file``, about ``name``: a private name its package does not
    define, or the other name a module is imported under."""

    file: str
    line: int
    name: str
    text: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.text}"


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the package at ``root`` (a directory with an
    ``__init__.py``), the package itself included."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def package_of(module: str, path: Path) -> str:
    """The package a module belongs to: itself for a package's ``__init__.py``, else its
    parent."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _display(path: Path, root: Path) -> str:
    return path.relative_to(root.parent).as_posix()


def _absolute(module: str, path: Path, level: int, name: str | None) -> str:
    """The absolute name of ``from <level dots><name> import ...`` written in ``module``."""
    parts = package_of(module, path).split(".")
    parts = parts[: len(parts) - (level - 1)]
    return ".".join([*parts, *([name] if name else [])])


def imported_names(module: str, path: Path, known: Iterable[str]) -> Iterator[tuple[str, str, int]]:
    """``(imported module, name, line)`` for every import statement of ``module``, wherever it
    is; ``name`` is ``""`` when a whole module is imported."""
    known = set(known)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, "", node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = _absolute(module, path, node.level, node.module)
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    yield f"{base}.{alias.name}", "", node.lineno
                else:
                    yield base, alias.name, node.lineno


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _docstrings(tree: ast.Module) -> set[int]:
    """``id()`` of every docstring node (module, class, function)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _named_module(text: str, known: set[str]) -> str | None:
    """The module ``text`` names, as ``"pkg.x.y"`` or ``"pkg.x.y:Name"``, or ``None``."""
    name, colon, attribute = text.partition(":")
    if colon and not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", attribute):
        return None
    if "." not in name and not colon:
        return None  # the package's bare name: a tracer's, a table's
    return name if name in known else None


def _late_bound(module: str, path: Path, known: set[str]) -> Iterator[tuple[str, int, str]]:
    """``(target, line, how)`` of the late-bound edges of ``module`` (see the module
    docstring)."""
    tree = ast.parse(path.read_text())
    skipped = _docstrings(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        called = _called_name(node)
        if called in LOGGER_FUNCTIONS:
            skipped.update(id(arg) for arg in node.args)
        elif called in IMPORT_FUNCTIONS and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                skipped.add(id(first))
                name = first.value.lstrip(".")
                dots = len(first.value) - len(name)
                if dots:
                    name = _absolute(module, path, dots, name or None)
                yield name, node.lineno, "import_module"
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            named = _named_module(node.value, known) if id(node) not in skipped else None
            if named is not None:
                yield named, node.lineno, "string"


def edges(root: Path) -> list[Edge]:
    """Every import edge between the modules of the package at ``root`` (see the module
    docstring): statements and late-bound ones, a module's edges to itself left out."""
    found = modules(root)
    known = set(found)
    result: set[Edge] = set()
    for module, path in found.items():
        file = _display(path, root)
        statements = ((t, line, "import") for t, _, line in imported_names(module, path, known))
        for target, line, how in [*statements, *_late_bound(module, path, known)]:
            if target in known and target != module:
                result.add(Edge(module, target, file, line, how))
    return sorted(result)


def graph(found: Iterable[Edge]) -> dict[str, set[str]]:
    """Module -> the modules it depends on, from ``found`` edges."""
    result: dict[str, set[str]] = {}
    for edge in found:
        result.setdefault(edge.source, set()).add(edge.target)
        result.setdefault(edge.target, set())
    return result


def cycles(depends: dict[str, set[str]]) -> set[frozenset[str]]:
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
        for target in sorted(depends.get(node, ())):
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

    for node in sorted(depends):
        if node not in index:
            visit(node)
    return groups


def edges_in_cycles(found: Iterable[Edge]) -> list[Edge]:
    """The edges whose two ends are in one cycle of the graph ``found`` makes."""
    found = list(found)
    groups = cycles(graph(found))
    return [e for e in found if any(e.source in g and e.target in g for g in groups)]


def layers(contract: Mapping[str, Any]) -> list[list[str]]:
    """The layers of an import-linter ``type = "layers"`` contract (its TOML table), top first,
    each a list of packages (split on ``|`` or ``:``)."""
    return [re.split(r"\s*[|:]\s*", layer.strip()) for layer in contract["layers"]]


def _layer_index(module: str, stack: Sequence[Sequence[str]]) -> int | None:
    for index, layer in enumerate(stack):
        if any(module == package or module.startswith(f"{package}.") for package in layer):
            return index
    return None


def layer_violations(found: Iterable[Edge], stack: Sequence[Sequence[str]]) -> list[Edge]:
    """The edges from a module of a lower layer of ``stack`` (top first, see :func:`layers`) to
    one of a higher layer: what import-linter reports for statements, for late-bound edges too."""
    result = []
    for edge in found:
        source, target = _layer_index(edge.source, stack), _layer_index(edge.target, stack)
        if source is not None and target is not None and target < source:
            result.append(edge)
    return result


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_self(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in SELF_NAMES
    return isinstance(node, ast.Call) and _called_name(node) == "super"


def _private_argument(call: ast.Call) -> str | None:
    """The private name ``"_name"`` given as the second argument of ``call`` (as to
    ``getattr(obj, "_name", ...)``), or ``None``."""
    if len(call.args) < 2:
        return None
    name = call.args[1]
    if isinstance(name, ast.Constant) and isinstance(name.value, str) and _is_private(name.value):
        return name.value
    return None


def _target_names(target: ast.expr) -> Iterator[str]:
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _target_names(element)


def _bound_in(body: list[ast.stmt]) -> Iterator[str]:
    """The names a module or class body binds directly (not inside its functions)."""
    for statement in body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield statement.name
        elif isinstance(statement, ast.Assign):
            for target in statement.targets:
                yield from _target_names(target)
            if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in statement.targets):
                for node in ast.walk(statement.value):
                    if isinstance(node, ast.Constant) and isinstance(node.value, str):
                        yield node.value
        elif isinstance(statement, (ast.AnnAssign, ast.AugAssign)):
            yield from _target_names(statement.target)
        elif isinstance(statement, (ast.Import, ast.ImportFrom)):
            for alias in statement.names:
                yield (alias.asname or alias.name).split(".")[0]
        elif isinstance(statement, (ast.If, ast.Try, ast.With)):
            nested = [getattr(statement, field, []) for field in ("body", "orelse", "finalbody")]
            nested += [handler.body for handler in getattr(statement, "handlers", [])]
            for block in nested:
                yield from _bound_in(block)


def defined_private_names(tree: ast.Module) -> set[str]:
    """The private names a module defines: bound at module level or in a class body, assigned
    on ``self``/``cls`` (also by ``setattr``/``object.__setattr__``) or listed in ``__slots__``.
    A parameter or a string of that name defines nothing."""
    names = set(_bound_in(tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            names.update(_bound_in(node.body))
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and _is_self(node.value)
        ):
            names.add(node.attr)
        elif isinstance(node, ast.Call) and _called_name(node) in ("setattr", "__setattr__"):
            private = _private_argument(node)
            if private is not None and _is_self(node.args[0]):
                names.add(private)
    return {name for name in names if _is_private(name)}


def private_accesses(
    root: Path, exempt: Iterable[str] = (), conventional: Iterable[str] = ()
) -> list[Finding]:
    """Every access to a private name its package does not define (see the module docstring),
    in the modules of the package at ``root`` but the ``exempt`` ones (dotted names); names in
    ``conventional`` (another library's documented underscore API, such as Django's ``_meta``)
    are not private."""
    found = modules(root)
    trees = {module: ast.parse(path.read_text()) for module, path in found.items()}
    defined: dict[str, set[str]] = {}
    for module, tree in trees.items():
        defined.setdefault(package_of(module, found[module]), set()).update(
            defined_private_names(tree)
        )
    exempt, conventional = set(exempt), set(conventional)
    result = []
    for module, tree in trees.items():
        if module in exempt:
            continue
        own = defined[package_of(module, found[module])]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                name, obj = node.attr, node.value
            elif (
                isinstance(node, ast.Call)
                and _called_name(node) in ATTRIBUTE_FUNCTIONS
                and (literal := _private_argument(node)) is not None
            ):
                name, obj = literal, node.args[0]
            else:
                continue
            if not _is_private(name) or name in own or name in conventional or _is_self(obj):
                continue
            file = _display(found[module], root)
            result.append(Finding(file, node.lineno, name, ast.unparse(node)))
    return sorted(result)


def private_imports(root: Path) -> list[Finding]:
    """``from pkg.x import _name`` where ``pkg.x`` is in another package than the importer's."""
    found = modules(root)
    result = []
    for module, path in found.items():
        package = package_of(module, path)
        for target, name, line in imported_names(module, path, found):
            if target not in found or not _is_private(name):
                continue
            if package_of(target, found[target]) != package:
                text = f"from {target} import {name}"
                result.append(Finding(_display(path, root), line, name, text))
    return sorted(result)


def renamed_module_imports(root: Path) -> list[Finding]:
    """Imports of a module of the package under another name (``import settings as config``):
    one module, one name, wherever it is read. Dropping or adding the leading underscore
    (``_forking as forking``) keeps the name."""
    found = modules(root)
    result = []
    for module, path in found.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for alias in node.names:
                if alias.asname is None:
                    continue
                if isinstance(node, ast.Import):
                    imported = alias.name
                else:
                    base = node.module or ""
                    if node.level:
                        base = _absolute(module, path, node.level, node.module)
                    imported = f"{base}.{alias.name}"
                name = imported.rpartition(".")[2]
                if imported in found and alias.asname.lstrip("_") != name.lstrip("_"):
                    text = f"{imported} as {alias.asname}"
                    result.append(Finding(_display(path, root), node.lineno, alias.asname, text))
    return sorted(result)
