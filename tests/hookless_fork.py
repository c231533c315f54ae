"""Fork with libc's ``fork()`` (no Python at-fork hook runs in the child) without hanging it.

CPython's own after-fork step (``PyOS_AfterFork_Child``) rebuilds the GIL. A child forked without
it keeps the GIL's condition variable exactly as it was at the fork: if another thread of the
parent was waiting for the GIL at that instant (a thread just started, or one woken and not yet
running), the condition variable counts a waiter the child does not have, and the child's first
hand-over of the GIL (a blocking call, a thread start) waits for it forever. That is CPython's
hazard, met the same way by any C-level fork of a threaded process; a test forks only once every
other thread is blocked in a wait, where it holds no lock and does not want the GIL.

Used by the scripts the fork-without-hooks tests run in a fresh interpreter (``cwd`` = the
repository root, so ``tests`` is importable).
"""

from __future__ import annotations

import ctypes
import linecache
import os
import sys
import threading
import time
from types import FrameType

SETTLE = 0.005
"""Seconds the forking thread sleeps between checks: a thread waiting for the GIL takes it then."""

CALM_CHECKS = 3
"""Consecutive checks that must find every other thread blocked before the fork."""

GIVE_UP = 30.0
"""Seconds after which the threads are reported as never calm (a test bug, not a hang)."""


def _blocked_in_a_wait(frame: FrameType | None) -> bool:
    """Whether a thread's innermost Python frame is the blocking acquire of ``Condition.wait``."""
    if frame is None:  # started, not yet running Python code: it is waiting for the GIL
        return False
    code = frame.f_code
    if os.path.basename(code.co_filename) != "threading.py" or code.co_name != "wait":
        return False
    return "acquire(" in linecache.getline(code.co_filename, frame.f_lineno)


def fork_without_hooks() -> int:
    """``fork()`` through libc (the GIL kept, no at-fork hook runs) once the other threads are calm.

    Returns what ``fork()`` returns: 0 in the child, the child's pid in the parent.

    Raises:
        RuntimeError: some thread was still running (or not blocked in a wait) after ``GIVE_UP`` s.
    """
    me = threading.get_ident()
    calm = 0
    give_up = time.monotonic() + GIVE_UP
    while calm < CALM_CHECKS:
        time.sleep(SETTLE)
        frames = sys._current_frames()
        busy = [
            thread.name
            for thread in threading.enumerate()
            if thread.ident != me and not _blocked_in_a_wait(frames.get(thread.ident or -1))
        ]
        calm = 0 if busy else calm + 1
        if busy and time.monotonic() > give_up:
            raise RuntimeError(f"threads never blocked in a wait before the fork: {busy}")
    pid: int = ctypes.PyDLL(None).fork()
    return pid
