"""A child forked without Python's at-fork hooks (a C-level ``fork()``) can use SQLite stores.

It copies whatever the parent's threads held at the fork (no hook ran): the lock that new stores
register under, a store's lock. Its first use of any store must replace them, and must forget
only what it inherited, never a connection it opened itself.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import REPO_ROOT
from tests.unit.conftest import REAL_TIMEOUT

# Runs in a fresh interpreter (cwd: the repository root) with the mode and a directory as args.
SCRIPT = textwrap.dedent(
    """
    import os, sys, threading
    from celery_lease.stores import _sqlite_connections as connections
    from celery_lease.stores.sqlite import SQLiteLockStore
    from tests.hookless_fork import fork_without_hooks, wait_for_child

    mode, path = sys.argv[1], os.path.join(sys.argv[2], "leases.db")
    inherited = SQLiteLockStore(path)
    assert inherited.get("k") is None  # open in the parent
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:
        with connections._CREATING:  # as a store being made at the moment of the fork
            holding.set()
            done.wait()

    holder = threading.Thread(target=hold)
    if mode != "own-first":
        holder.start()
        holding.wait()
    pid = fork_without_hooks()
    if pid == 0:
        if mode == "new-store":
            own = SQLiteLockStore(path)
            assert own.acquire("child", "child", 60_000) is not None
        elif mode == "os-fork":
            grandchild = os.fork()
            if grandchild == 0:
                os._exit(0)
            assert os.waitpid(grandchild, 0)[1] == 0
        else:
            own = SQLiteLockStore(path)
            assert own.get("k") is None
            opened = own._conn
            assert inherited.get("k") is None  # the first use of an inherited store
            assert own._conn is opened, "the child's own connection was forgotten"
            assert own.acquire("child", "child", 60_000) is not None
        os._exit(0)
    try:
        wait_for_child(pid)
    finally:
        done.set()
    print("child ok")
    """
)


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param("new-store", id="a store made in the child, the registry lock held at fork"),
        pytest.param("os-fork", id="the child forks again, the registry lock held at fork"),
        pytest.param("own-first", id="the child opens its own store, then uses an inherited one"),
    ],
)
def test_a_child_forked_without_hooks_uses_sqlite_stores(mode: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode, str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=REAL_TIMEOUT * 6,
        check=False,
    )
    assert done.returncode == 0 and "child ok" in done.stdout, done.stdout + done.stderr
