"""The after-fork registry: each reset runs once, in order; a failing one stops no other."""

from __future__ import annotations

import ast
import gc
import json
import logging
import os
import signal
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import celery_lease
from celery_lease import _forking as forking

PACKAGE = Path(celery_lease.__file__).parent
DEADLINE = 10.0

calls: list[str] = []
"""What the resets registered by a test did, in this process (a forked child inherits a copy)."""


@pytest.fixture(autouse=True)
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The package's own resets stay registered; what a test registers is gone after it."""
    for name in ("_before", "_after_in_parent", "_after_in_child", "_new_process"):
        monkeypatch.setattr(forking, name, list(getattr(forking, name)))
    calls.clear()
    yield
    calls.clear()


def record(label: str) -> Callable[[], None]:
    def reset() -> None:
        calls.append(label)

    return reset


def fail(exc: BaseException) -> Callable[[], None]:
    def reset() -> None:
        calls.append("raised")
        raise exc

    return reset


def in_forked_child(body: Callable[[], object]) -> object:
    """Fork; the child sends ``body()`` as JSON and ends with os._exit. Returns what it sent."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not pytest-timeout's handler
        signal.alarm(60)  # a child that hangs dies instead of outliving the test
        try:
            os.write(write, json.dumps(body()).encode())
        finally:
            os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 65536):
        data += chunk
    os.close(read)
    deadline = time.monotonic() + DEADLINE
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child did not end")
        time.sleep(0.01)  # polling a child's exit with a deadline, not synchronising
    return json.loads(data)


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def forking_log() -> Iterator[ListHandler]:
    """What celery_lease._forking logs (a forked child inherits the handler: it sends them)."""
    handler = ListHandler()
    logger = logging.getLogger("celery_lease.forking")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX-only")
class TestForkedChild:
    def test_a_forked_child_runs_every_child_reset_once_in_registration_order(self) -> None:
        """os.fork() runs the child resets once each, in order, in the child only."""
        for label in ("first", "second", "third"):
            forking.on_fork_child(record(label), name=f"test: {label}")

        assert in_forked_child(lambda: calls) == ["first", "second", "third"]
        assert calls == []  # none ran in the parent

    def test_parent_hooks_run_before_and_after_the_fork_in_the_parent(self) -> None:
        """``before`` runs in reverse registration order, ``after`` in order, in the parent."""
        forking.on_fork_parent(name="test: a", before=record("before a"), after=record("after a"))
        forking.on_fork_parent(name="test: b", before=record("before b"), after=record("after b"))
        forking.on_fork_child(record("child"), name="test: child")

        seen_by_child = in_forked_child(lambda: calls)

        assert seen_by_child == ["before b", "before a", "child"]
        assert calls == ["before b", "before a", "after a", "after b"]

    @pytest.mark.parametrize("exc", [RuntimeError("boom"), SystemExit(3)], ids=repr)
    def test_a_raising_child_reset_is_logged_and_the_later_ones_still_run(
        self, exc: BaseException, forking_log: ListHandler
    ) -> None:
        """Whatever a child reset raises, the next ones run (as os.register_at_fork's own)."""
        forking.on_fork_child(record("before"), name="test: before")
        forking.on_fork_child(fail(exc), name="test: raiser")
        forking.on_fork_child(record("after"), name="test: after")

        seen = in_forked_child(lambda: {"calls": calls, "log": forking_log.messages})

        assert seen == {
            "calls": ["before", "raised", "after"],
            "log": ["celery-lease: the after-fork (child) hook 'test: raiser' failed"],
        }

    def test_a_raising_before_hook_neither_stops_the_fork_nor_the_after_hooks(
        self, forking_log: ListHandler
    ) -> None:
        """A ``before`` that raises is logged; the fork happens and every ``after`` runs."""
        forking.on_fork_parent(name="test: ok", before=record("before ok"), after=record("after"))
        forking.on_fork_parent(name="test: raiser", before=fail(RuntimeError()), after=record("x"))

        assert in_forked_child(lambda: calls) == ["raised", "before ok"]
        assert calls == ["raised", "before ok", "after", "x"]
        assert forking_log.messages == ["celery-lease: the before-fork hook 'test: raiser' failed"]

    def test_new_process_resets_do_not_run_at_a_fork(self) -> None:
        """A reset for new pool processes runs from reset_child_state() only."""
        forking.on_new_process(record("new process"), name="test: new process")

        assert in_forked_child(lambda: calls) == []


class TestResetChildState:
    def test_runs_every_new_process_reset_in_order_without_a_fork(self) -> None:
        """reset_child_state() runs the new-process resets now, in this process, in order."""
        forking.on_new_process(record("first"), name="test: first")
        forking.on_fork_child(record("child only"), name="test: child only")
        forking.on_new_process(record("second"), name="test: second")

        forking.reset_child_state()

        assert calls == ["first", "second"]

    def test_a_raising_reset_is_logged_and_the_later_ones_still_run(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """An exception of one reset is logged with the module's logger; the next one runs."""
        forking.on_new_process(fail(RuntimeError("boom")), name="test: raiser")
        forking.on_new_process(record("after"), name="test: after")

        with caplog.at_level(logging.ERROR, logger="celery_lease.forking"):
            forking.reset_child_state()

        assert calls == ["raised", "after"]
        assert [r.getMessage() for r in caplog.records] == [
            "celery-lease: the process reset 'test: raiser' failed"
        ]

    def test_an_interrupt_reaches_the_caller(self) -> None:
        """KeyboardInterrupt is not swallowed in a live process."""
        forking.on_new_process(fail(KeyboardInterrupt()), name="test: interrupted")

        with pytest.raises(KeyboardInterrupt):
            forking.reset_child_state()


class Resource:
    def reset(self) -> None:
        calls.append("resource")


class TestWeakInstances:
    def test_a_bound_method_does_not_keep_its_instance_alive(self) -> None:
        """Registering ``obj.reset`` holds ``obj`` weakly; its entries leave with it."""
        resource = Resource()
        before = len(forking._after_in_child), len(forking._new_process)
        forking.on_fork_child(resource.reset, name="test: resource")
        forking.on_new_process(resource.reset, name="test: resource")
        forking.reset_child_state()
        assert calls == ["resource"]

        gone = weakref.ref(resource)
        del resource
        gc.collect()

        assert gone() is None
        assert (len(forking._after_in_child), len(forking._new_process)) == before
        forking.reset_child_state()
        assert calls == ["resource"]


def _register_at_fork_calls(path: Path) -> list[int]:
    """Lines of ``path`` that call ``register_at_fork`` (``os.``, an alias, or imported)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == "register_at_fork":
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and any(
            alias.name == "register_at_fork" for alias in node.names
        ):
            lines.append(node.lineno)
    return lines


class TestOneRegistry:
    def test_only_the_forking_module_calls_register_at_fork(self) -> None:
        """Every at-fork hook of the package goes through celery_lease._forking."""
        found = {
            str(path.relative_to(PACKAGE)): lines
            for path in sorted(PACKAGE.rglob("*.py"))
            if (lines := _register_at_fork_calls(path))
        }

        assert list(found) == ["_forking.py"]
        assert len(found["_forking.py"]) == 1

    def test_the_forking_module_imports_the_standard_library_only(self) -> None:
        """_forking.py depends on nothing else: not Celery, not another celery_lease module."""
        tree = ast.parse((PACKAGE / "_forking.py").read_text())
        imported = {
            (alias.name if isinstance(node, ast.Import) else node.module or "").split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names
        }

        assert imported
        assert imported - {"__future__"} <= sys.stdlib_module_names
