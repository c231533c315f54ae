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
import signal
import sys
import threading
import time
from types import FrameType

SETTLE = 0.005
"""Seconds the forking thread sleeps between checks: a thread waiting for the GIL takes it then."""

CALM_CHECKS = 3
"""Consecutive checks that must find every other thread blocked before the fork."""

LONG_WAIT = 1.0
"""Seconds: a timed wait shorter than this might end (and want the GIL) at the fork itself."""

GIVE_UP = 30.0
"""Seconds after which the threads are reported as never calm (a test bug, not a hang)."""

CHILD_DEADLINE = 30
"""Seconds after which the child is killed by ``SIGALRM`` (no handler: it dies even inside C)."""

# The two lines of ``Condition.wait`` that block on the waiter lock once the condition's own lock
# is released (``saved_state`` is bound): untimed, and timed with a positive timeout.
_BLOCKING_LINES = {"waiter.acquire()", "gotit = waiter.acquire(True, timeout)"}


def _blocked_in_a_wait(frame: FrameType | None) -> bool:
    """Whether a thread's innermost frame is ``Condition.wait`` blocked on its waiter lock.

    The frame stays on that line also once the acquire returned and the thread waits to take the
    GIL back; only a wait that is untimed or long (``LONG_WAIT``) is trusted not to end at the fork.
    """
    if frame is None:  # started, not yet running Python code: it is waiting for the GIL
        return False
    code = frame.f_code
    if os.path.basename(code.co_filename) != "threading.py" or code.co_name != "wait":
        return False
    names = frame.f_locals
    if "saved_state" not in names:  # before the condition's own lock is released
        return False
    if linecache.getline(code.co_filename, frame.f_lineno).strip() not in _BLOCKING_LINES:
        return False
    timeout = names.get("timeout")
    return timeout is None or timeout >= LONG_WAIT


def _native_thread_count() -> int | None:
    """How many threads the OS counts in this process (Linux), or None where it cannot tell."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def fork_without_hooks() -> int:
    """``fork()`` through libc (the GIL kept, no at-fork hook runs) once the other threads are calm.

    Calm: every other thread is blocked in an untimed or long ``Condition.wait``, and no thread
    exists that Python does not know of (a C thread could want the GIL at any time).

    Returns what ``fork()`` returns: 0 in the child, the child's pid in the parent. The child
    gets ``CHILD_DEADLINE`` seconds to live.

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
            str(ident)
            for ident, frame in frames.items()
            if ident != me and not _blocked_in_a_wait(frame)
        ]
        native = _native_thread_count()
        if native is not None and native != len(frames):
            busy.append(f"{native - len(frames)} thread(s) unknown to Python")
        calm = 0 if busy else calm + 1
        if busy and time.monotonic() > give_up:
            raise RuntimeError(f"threads never blocked in a wait before the fork: {busy}")
    pid: int = ctypes.PyDLL(None).fork()
    if pid == 0:
        signal.alarm(CHILD_DEADLINE)  # a hung child must not outlive the test as an orphan
    return pid


def wait_for_child(pid: int) -> None:
    """Reap the child; raise if it did not exit with status 0 (e.g. killed by its deadline)."""
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise RuntimeError(f"the child forked without hooks ended with wait status {status:#x}")
