"""The renewer and dispatcher of a child forked without Python's at-fork hooks are its own.

Such a child (uWSGI with the app loaded in the master, a C-level ``fork()``) inherits the
parent's renewer object, whose thread does not exist in the child: a lease the child takes must
be renewed by a renewer of its own, never added to the parent's (where nothing renews it and no
loss is reported), and the child must never see the parent's leases as its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.support import REPO_ROOT
from tests.unit.conftest import REAL_TIMEOUT

# Runs in a fresh interpreter (cwd: the repository root): fork with libc's fork(), so no Python
# at-fork hook runs in the child.
SCRIPT = textwrap.dedent(
    """
    import json, os
    from celery_lease import MemoryLockStore, lease
    from celery_lease._core.dispatch import get_dispatcher
    from celery_lease._core.renewer import get_renewer, snapshot
    from tests.hookless_fork import fork_without_hooks, wait_for_child

    store = MemoryLockStore()
    with lease("parent", store=store, ttl=30):
        parent_renewer, parent_dispatcher = get_renewer(None, store), get_dispatcher()
        read, write = os.pipe()
        pid = fork_without_hooks()  # once the renewer thread is started and blocked in its wait
        if pid == 0:
            os.close(read)
            with lease("child", store=store, ttl=30) as held:  # the store the parent renews
                out = {
                    "same_renewer": held._entry.renewer is parent_renewer,
                    "same_dispatcher": get_dispatcher() is parent_dispatcher,
                    "keys": [row["key"] for row in snapshot()],
                }
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


class TestForkWithoutHooks:
    def test_a_childs_lease_is_renewed_by_the_childs_own_renewer(self) -> None:
        """The child's lease goes to a new renewer and dispatcher; it sees only its own lease."""
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=REAL_TIMEOUT * 6,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout.strip().splitlines()[-1])
        assert out == {"same_renewer": False, "same_dispatcher": False, "keys": ["child"]}
