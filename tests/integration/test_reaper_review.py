"""Review attacks on dead-holder freeing with real prefork workers.

Reuses the harness and app of ``tests/integration/test_dead_holders.py`` (the worker runs that
module's app). ``revoke(terminate=True)`` is one of the deaths issue 11 names: Celery marks the
request ready (``task_ready``) *before* the child is reaped, so the reaper must find the task of
the terminated child in the pool's own jobs, not only in the worker's active requests.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.integration.test_dead_holders import (
    FREED_BOUND,
    TIMEOUT,
    Worker,
    assert_reaped,
    held,
    new_run,
    released_after_reaping,
    worker,
)

__all__ = ["worker"]  # the fixture, imported for this module's tests

pytestmark = [pytest.mark.worker, pytest.mark.slow]


class TestRevokeTerminate:
    def test_a_child_terminated_by_revoke_frees_its_key_at_once(self, worker: Worker) -> None:
        """``revoke(terminate=True, signal="SIGKILL")`` of a running locked task: the child dies
        without running any cleanup; its 30 s lease is released once the child is reaped."""
        run = new_run()
        key = f"dh:{run}"
        result = worker.app.send_task("dh.hold", kwargs={"run": run})
        ((child, token, _),) = worker.wait_for(f"attempts-{run}")
        assert held(worker, key).token == token
        worker.app.control.revoke(result.id, terminate=True, signal="SIGKILL")
        killed = time.monotonic()
        freed = worker.wait_free(key, timeout=TIMEOUT)
        assert freed is not None, f"key still held {TIMEOUT}s after revoke; log:\n{worker.tail()}"
        measured = time.monotonic() - killed
        assert measured <= FREED_BOUND, f"freed after {measured:.3f}s; log:\n{worker.tail()}"
        released_after_reaping(worker, run, child)
        (released,) = worker.wait_for(f"released-dh-{run}")
        assert released["reason"] == "holder_died" and released["pid"] == child
        assert released["exitcode"] == -signal.SIGKILL
        assert_reaped(child)

    def test_the_default_terminate_signal_frees_the_key_at_once_too(self, worker: Worker) -> None:
        """``revoke(terminate=True)`` with Celery's default SIGTERM: the key is free at once,
        whether the child released it itself or died and the main process released it."""
        run = new_run()
        key = f"dh:{run}"
        result = worker.app.send_task("dh.hold", kwargs={"run": run})
        ((_, token, _),) = worker.wait_for(f"attempts-{run}")
        assert held(worker, key).token == token
        worker.app.control.revoke(result.id, terminate=True)
        killed = time.monotonic()
        freed = worker.wait_free(key, timeout=TIMEOUT)
        assert freed is not None, f"key still held {TIMEOUT}s after revoke; log:\n{worker.tail()}"
        measured = time.monotonic() - killed
        assert measured <= FREED_BOUND, f"freed after {measured:.3f}s; log:\n{worker.tail()}"
