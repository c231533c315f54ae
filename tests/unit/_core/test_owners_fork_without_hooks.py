"""Identity after a fork that skips Python's at-fork hooks.

uWSGI (app loaded in the master) and any C-level ``fork()`` make children without running
``os.register_at_fork`` hooks. Owner ids and the lease's idea of "this process" must still differ
between parent and child: two holders with one owner id would both hold the key (the same-owner
acquire is idempotent) with one fencing token.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.support import REPO_ROOT
from tests.unit.conftest import REAL_TIMEOUT

# Runs in a fresh interpreter (cwd: the repository root): fork with libc's fork(), so
# no Python at-fork hook runs in the child, then compare what parent and child make.
SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from celery_lease import MemoryLockStore, lease
    from celery_lease._core.owners import make_owner, new_nonce
    from tests.hookless_fork import fork_without_hooks, wait_for_child

    make_owner()  # the generator exists before the fork, as in a preloaded uWSGI master
    store_parent = MemoryLockStore()
    read, write = os.pipe()
    pid = fork_without_hooks()
    if pid == 0:
        os.close(read)
        out = {"owner": make_owner(), "nonce": new_nonce()}
        os.write(write, json.dumps(out).encode())
        os._exit(0)
    os.close(write)
    mine = {"owner": make_owner(), "nonce": new_nonce()}
    data = b""
    while chunk := os.read(read, 65536):
        data += chunk
    wait_for_child(pid)
    print(json.dumps({"parent": mine, "child": json.loads(data), "child_pid": pid}))
    """
)

LEASE_SCRIPT = textwrap.dedent(
    """
    import json, os
    from celery_lease import MemoryLockStore, lease, current_lease
    from tests.hookless_fork import fork_without_hooks, wait_for_child

    store = MemoryLockStore()
    with lease("k", store=store, ttl=30) as held:
        read, write = os.pipe()
        pid = fork_without_hooks()
        if pid == 0:
            os.close(read)
            out = {"lost": held.lost, "reason": held.lost_reason,
                   "current": current_lease() is not None}
            os.write(write, json.dumps(out).encode())
            os._exit(0)
        os.close(write)
        data = b""
        while chunk := os.read(read, 65536):
            data += chunk
        wait_for_child(pid)
    print(data.decode())
    """
)


def run(script: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=REAL_TIMEOUT * 6,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


class TestForkWithoutHooks:
    def test_parent_and_child_make_different_owner_ids(self) -> None:
        """The child's owner ids carry its own pid and never equal the parent's."""
        out = run(SCRIPT)
        parent, child = out["parent"], out["child"]
        assert isinstance(parent, dict) and isinstance(child, dict)
        parent_head = str(parent["owner"]).split(";")[0]
        child_head = str(child["owner"]).split(";")[0]
        assert child_head != parent_head
        assert child_head.split("/")[1] == str(out["child_pid"])
        assert child["nonce"] != parent["nonce"]

    def test_the_parents_lease_is_not_the_childs(self) -> None:
        """In such a child the parent's lease reads as lost ("forked") and is not current."""
        out = run(LEASE_SCRIPT)
        assert out == {"lost": True, "reason": "forked", "current": False}
