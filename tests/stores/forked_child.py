"""A forked child driven step by step over two pipes, for the tests of stores across fork()."""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tests.stores.contract import DEADLINE


def read_line(fd: int) -> str:
    """One line a forked child wrote to ``fd``, within DEADLINE seconds."""
    data = b""
    deadline = time.monotonic() + DEADLINE
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"the child said only {data!r}"
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            chunk = os.read(fd, 64)
            assert chunk, f"the child ended after saying {data!r}"
            data += chunk
    return data.decode().strip()


class Child:
    """A forked child driven step by step over two pipes (``go()`` / ``said()``)."""

    def __init__(self) -> None:
        self._to_r, self._to_w = os.pipe()
        self._from_r, self._from_w = os.pipe()
        self.pid = -1

    def say(self, text: str) -> None:  # in the child
        os.write(self._from_w, f"{text}\n".encode())

    def wait_go(self) -> None:  # in the child
        os.read(self._to_r, 1)

    def go(self) -> None:
        os.write(self._to_w, b"g")

    def said(self) -> str:
        return read_line(self._from_r)

    def in_child(self) -> None:
        os.close(self._to_w)  # so that the parent closing its end ends wait_go() with EOF
        os.close(self._from_r)

    def in_parent(self, pid: int) -> None:
        self.pid = pid
        os.close(self._to_r)
        os.close(self._from_w)

    def finish(self) -> None:
        """Let the child end (EOF on its pipe), reap it; kill it if it does not end in time."""
        os.close(self._to_w)
        os.close(self._from_r)
        deadline = time.monotonic() + DEADLINE
        while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                raise AssertionError("the forked child did not end")
            time.sleep(0.01)  # polling a child's exit with a deadline, not synchronising


@contextmanager
def forked(body: object) -> Iterator[Child]:
    """Run ``body(child)`` in a forked child; it ends with os._exit (never returns to pytest)."""
    child = Child()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        child.in_child()
        code = 1
        try:
            body(child)  # type: ignore[operator]
            code = 0
        except BaseException as exc:
            child.say(f"error {exc!r}")
        finally:
            os._exit(code)
    child.in_parent(pid)
    try:
        yield child
    finally:
        child.finish()
