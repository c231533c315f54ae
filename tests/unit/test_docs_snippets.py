"""Every ```python block in docs/*.md and README.md runs, so the docs cannot drift from the code.

The blocks of one page run in order in one namespace, as a reader would paste them. A block can
be skipped with ``<!-- snippet: skip <reason> -->`` on the line before its fence; the reason is
required. Functions named ``test_*`` that a page defines are then called, with the fixtures of
the ``celery_lease.testing`` pytest plugin (``lease_clock``, ``lease_store``,
``use_lease_store``) passed by name.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from celery_lease import MemoryLockStore
from celery_lease.testing import FakeClock, override_lease_store

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = [*sorted(DOCS.glob("*.md")), DOCS.parent / "README.md"]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*$")
_SKIP = re.compile(r"^\s*<!--\s*snippet:\s*skip\b(?P<reason>.*?)-->\s*$")


@dataclass(frozen=True)
class Snippet:
    """One fenced code block of a page."""

    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip_reason: str | None  # None: runs; "" would be a skip without a reason


def snippets(page: Path) -> Iterator[Snippet]:
    """The fenced blocks of ``page``, in order, with any skip marker just before them."""
    lines = page.read_text(encoding="utf-8").splitlines()
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent = opening["indent"]
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise AssertionError(f"{page.name}:{index + 1}: code fence is never closed")
        previous = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        marker = _SKIP.match(previous)
        body = "\n".join(line.removeprefix(indent) for line in lines[index + 1 : end])
        yield Snippet(
            page=page,
            line=index + 1,
            lang=opening["lang"].lower(),
            code=textwrap.dedent(body) + "\n",
            skip_reason=None if marker is None else marker["reason"].strip(),
        )
        index = end + 1


def python_snippets(page: Path) -> list[Snippet]:
    return [s for s in snippets(page) if s.lang in ("python", "py", "python3")]


RUNNABLE = [p for p in PAGES if any(s.skip_reason is None for s in python_snippets(p))]
"""Pages with at least one Python block that runs."""


@pytest.fixture
def isolated_celery() -> Iterator[None]:
    """Shared tasks and the current app a page defines do not leak into later tests."""
    from celery import _state

    finalizers = set(_state._on_app_finalizers)
    current = getattr(_state._tls, "current_app", None)
    yield
    _state._on_app_finalizers.clear()
    _state._on_app_finalizers.update(finalizers)
    _state._tls.current_app = current


@pytest.fixture
def isolated_signals() -> Iterator[None]:
    """Receivers a page connects to celery-lease's signals are disconnected afterwards."""
    from celery_lease import signals

    names = ("lock_acquired", "lock_lost", "lock_rejected", "lock_released")
    saved = {name: list(getattr(signals, name).receivers) for name in names}
    yield
    for name, receivers in saved.items():
        signal = getattr(signals, name)
        signal.receivers[:] = receivers
        signal.sender_receivers_cache.clear()


def _use_store(overrides: contextlib.ExitStack, store: MemoryLockStore, app: Any) -> Any:
    """The ``use_lease_store`` fixture for a page's test: undone when ``overrides`` closes."""
    return overrides.enter_context(override_lease_store(app, store))


def _call_tests(namespace: dict[str, Any], page: Path) -> int:
    """Call the page's ``test_*`` functions with the plugin's fixtures; returns how many ran."""
    ran = 0
    for name, func in list(namespace.items()):
        if not (name.startswith("test_") and inspect.isfunction(func)):
            continue
        clock = FakeClock(1000.0)
        store = MemoryLockStore(clock=clock)
        with contextlib.ExitStack() as overrides:
            fixtures = {
                "lease_clock": clock,
                "lease_store": store,
                "use_lease_store": functools.partial(_use_store, overrides, store),
            }
            wanted = inspect.signature(func).parameters
            unknown = set(wanted) - set(fixtures)
            assert not unknown, f"{page.name}: {name} asks for unknown fixtures {sorted(unknown)}"
            func(**{p: fixtures[p] for p in wanted})
        ran += 1
    return ran


class TestDocsSnippets:
    def test_there_are_pages_with_python(self):
        """The docs directory exists and holds Python examples (the suite below is not empty)."""
        assert sum(len(python_snippets(page)) for page in PAGES) >= 10

    def test_skips_are_rare_and_explained(self):
        """Every skipped block gives a reason, and most blocks run."""
        blocks = [s for page in PAGES for s in python_snippets(page)]
        skipped = [s for s in blocks if s.skip_reason is not None]
        for snippet in skipped:
            assert snippet.skip_reason, f"{snippet.page.name}:{snippet.line}: skip needs a reason"
        assert len(skipped) * 4 <= len(blocks), [f"{s.page.name}:{s.line}" for s in skipped]

    @pytest.mark.parametrize("page", RUNNABLE, ids=[page.name for page in RUNNABLE])
    @pytest.mark.usefixtures("isolated_signals", "isolated_celery")
    def test_page_snippets_run(
        self, page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The page's Python blocks run in order in one namespace without raising."""
        blocks = [s for s in python_snippets(page) if s.skip_reason is None]
        monkeypatch.chdir(tmp_path)  # files a snippet creates (sqlite:///leases.db) go here
        namespace: dict[str, Any] = {"__name__": f"docs_{page.stem}"}
        for snippet in blocks:
            code = compile(snippet.code, f"{page.relative_to(DOCS.parent)}:{snippet.line}", "exec")
            exec(code, namespace)
        _call_tests(namespace, page)


_STRICT_FENCE = re.compile(r"\bfence\s*<(?!=)")
_INCREMENT = re.compile(r"\b(\w+)\s*=\s*\1\s*[-+]")


class TestFenceRule:
    def test_no_page_shows_a_fenced_write_against_the_rule(self) -> None:
        """Every page shows the rule of docs/fencing.md: a write is applied when the fence is
        ``<=`` its token (never a strict ``fence < token``, which refuses the holder's own
        retry), so no fenced write increments a value the database computes."""
        wrong = []
        for page in PAGES:
            for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
                strict = _STRICT_FENCE.search(line)
                increment = "fence" in line and _INCREMENT.search(line)
                if strict or increment:
                    wrong.append(f"{page.name}:{number}: {line.strip()}")
        assert not wrong, "\n".join(wrong)


class TestSnippetParser:
    def test_skip_marker_and_indented_fences(self, tmp_path: Path):
        """The parser finds fences inside admonitions and reads the skip marker's reason."""
        page = tmp_path / "page.md"
        page.write_text(
            "text\n\n<!-- snippet: skip needs a server -->\n```python\nx = 1\n```\n\n"
            "!!! note\n    ```python\n    y = 2\n    ```\n\n```bash\nls\n```\n"
        )
        found = python_snippets(page)
        assert [(s.code, s.skip_reason) for s in found] == [
            ("x = 1\n", "needs a server"),
            ("y = 2\n", None),
        ]
