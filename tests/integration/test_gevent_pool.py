"""A gevent worker: the renewer runs on the hub, exclusion and revoke work there too; skipped
duplicates end REVOKED ("skipped: ...")."""

from __future__ import annotations

import pytest
from celery.exceptions import TaskRevokedError

from celery_lease import LockLostError
from tests.integration.conftest import WorkerEnv, assert_no_overlap, intervals
from tests.integration.test_task_workers import send_duplicates

pytestmark = [pytest.mark.worker, pytest.mark.slow]


def test_gevent_pool_smoke(gevent_env: WorkerEnv) -> None:
    """Under gevent: duplicates exclude each other and a lost lease stops the greenlet."""
    run = gevent_env.run_id()
    results = send_duplicates(gevent_env, "it.dup_skip", run)
    assert_no_overlap(intervals(gevent_env, run))
    skipped = [r for r in results if isinstance(r, TaskRevokedError)]
    assert results.count("ran") >= 1 and results.count("ran") + len(skipped) == len(results)
    assert all("skipped: " in str(r) for r in skipped), skipped
    revoke_run = gevent_env.run_id()
    result = gevent_env.app.send_task("it.revoke", (revoke_run,))
    gevent_env.wait_file(f"held-{revoke_run}")
    gevent_env.store.force_release(f"revoke:{revoke_run}")  # type: ignore[attr-defined]
    with pytest.raises(LockLostError):
        gevent_env.get(result)
