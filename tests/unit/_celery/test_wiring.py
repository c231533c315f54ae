"""``celery_lease._celery.wiring``: one call hooks celery-lease into Celery, once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from celery import Celery, signals
from celery.app.task import Context
from celery.app.trace import build_tracer
from celery.worker.control import Panel

from celery_lease import MemoryLockStore, lease
from celery_lease._celery import control, wiring
from celery_lease._core.owners import parse_owner

UIDS = {
    "worker_init": "celery_lease.worker_init",
    "worker_process_init": "celery_lease.worker_process_init",
    "worker_shutdown": "celery_lease.worker_shutdown",
    "task_failure": "celery_lease.task_failure",
    "before_task_publish": "celery_lease.release_before_retry",
    "worker_process_shutdown": "celery_lease.flush_deferred_process",
    "task_revoked": "celery_lease.unique.revoked",
}


FLUSH = "celery_lease.flush_deferred"
"""The second uid on ``worker_shutdown``: the exit flush of deferred releases."""

SOLO = "celery_lease.early_acquire.install"
"""The second uid on ``worker_process_init``: connects the solo worker's receivers."""


def _ours() -> dict[str, int]:
    counts = {
        name: sum(key[0] == uid for key, _ in getattr(signals, name).receivers)
        for name, uid in UIDS.items()
    }
    counts[FLUSH] = sum(key[0] == FLUSH for key, _ in signals.worker_shutdown.receivers)
    counts[SOLO] = sum(key[0] == SOLO for key, _ in signals.worker_process_init.receivers)
    return counts


class TestInstall:
    def test_every_receiver_is_connected_once_under_its_fixed_uid(self) -> None:
        """Installing twice connects each receiver once (importing the task layer installs:
        :class:`TestWhereItRuns`)."""
        wiring.install()
        wiring.install()
        assert _ours() == dict.fromkeys([*UIDS, FLUSH, SOLO], 1)

    def test_the_table_names_every_receiver(self) -> None:
        assert {(signal.name, uid) for signal, _, uid in wiring.RECEIVERS} == {
            *UIDS.items(),
            ("worker_shutdown", FLUSH),
            ("worker_process_init", SOLO),
        }

    def test_the_steps_run_again_connect_nothing_twice(self) -> None:
        """Each step is idempotent of itself: two threads racing past the flag change nothing."""
        for signal, receiver, uid in wiring.RECEIVERS:
            signal.connect(receiver, weak=False, dispatch_uid=uid)
        assert _ours() == dict.fromkeys([*UIDS, FLUSH, SOLO], 1)

    def test_a_forked_child_has_each_receiver_once_and_installs_nothing_more(self) -> None:
        """The flag and the receivers are inherited together: installing in the child (as the
        task layer's import would, in a pool process) connects nothing twice."""
        wiring.install()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            try:
                wiring.install()
                os.write(write, json.dumps(_ours()).encode())
            finally:
                os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        with os.fdopen(read) as answer:
            assert json.loads(answer.read()) == dict.fromkeys([*UIDS, FLUSH, SOLO], 1)

    def test_the_command_and_the_request_attributes_are_installed(self) -> None:
        wiring.install()
        assert Panel.data["leases"] is control.leases
        assert Panel.meta["leases"].type == "inspect"
        assert {name: getattr(Context(), name) for name in ("lock_token", "lock_lost")} == {
            "lock_token": None,
            "lock_lost": False,
        }


def _in_fresh_interpreter(code: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    answer: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


_REPORT = (
    "import json; from celery import signals; from celery.worker.control import Panel; "
    "from celery.app.task import Context; "
    "print(json.dumps({'leases': 'leases' in Panel.data, "
    "'attributes': hasattr(Context, 'lock_token'), "
    "'receivers': sorted(k[0] for n in ('worker_init', 'task_failure', 'before_task_publish') "
    "for k, _ in getattr(signals, n).receivers if str(k[0]).startswith('celery_lease.'))}))"
)


class TestWhereItRuns:
    def test_importing_the_locked_task_installs_everything(self) -> None:
        answer = _in_fresh_interpreter("from celery_lease import LockedTask; " + _REPORT)
        assert answer == {
            "leases": True,
            "attributes": True,
            "receivers": [
                "celery_lease.release_before_retry",
                "celery_lease.task_failure",
                "celery_lease.worker_init",
            ],
        }

    def test_the_cli_registers_the_command_and_connects_no_worker_hook(self) -> None:
        """The ``celery`` program loads the CLI in every run, workers of apps without a locked
        task included: it must not add celery-lease's hooks to those."""
        answer = _in_fresh_interpreter("import celery_lease.cli; " + _REPORT)
        assert answer == {"leases": True, "attributes": False, "receivers": []}


class TestOwnerDefaultsWithoutTaskSignals:
    """A ``lease()`` in a task body that is not a LockedTask still names the task in its owner id,
    with no ``task_prerun`` / ``task_postrun`` receiver of ours: Celery sends those signals for
    every task (plain ones too) only while some receiver is connected."""

    def test_no_receiver_of_ours_makes_celery_send_the_task_signals(self) -> None:
        wiring.install()
        for signal in (signals.task_prerun, signals.task_postrun):
            assert [k for k, _ in signal.receivers if str(k[0]).startswith("celery_lease.")] == []

    def _app(self) -> Celery:
        app = Celery("owners", broker="memory://", backend="cache+memory://", set_as_current=False)
        app.conf.task_eager_propagates = True
        return app

    def test_a_lease_in_a_traced_plain_task_names_the_task(self) -> None:
        wiring.install()
        store = MemoryLockStore()
        app = self._app()
        seen: list[str] = []

        @app.task(name="owners.outer", shared=False)
        def outer() -> None:
            with lease("k", store=store, ttl=5) as held:
                seen.append(held.owner)

        tracer = build_tracer(outer.name, outer, app=app, eager=True, propagate=True)
        tracer("id-1", (), {}, {"id": "id-1", "delivery_info": {}})
        holder = parse_owner(seen[0])
        assert (holder.task, holder.task_id) == ("owners.outer", "id-1")
        app.close()

    def test_a_direct_calls_own_request_on_the_running_task_leaves_the_worker_request_named(
        self,
    ) -> None:
        """Celery 5.4 pushes a fresh ``called_directly`` request onto the running task itself when
        it calls itself as a function: the worker request below it still names the owner."""
        wiring.install()
        store = MemoryLockStore()
        app = self._app()
        seen: list[str] = []

        @app.task(name="owners.self_calling", bind=True, shared=False)
        def outer(self: Any) -> None:
            self.request_stack.push(Context(called_directly=True))
            try:
                with lease("k", store=store, ttl=5) as held:
                    seen.append(held.owner)
            finally:
                self.request_stack.pop()

        tracer = build_tracer(outer.name, outer, app=app, eager=True, propagate=True)
        tracer("id-3", (), {}, {"id": "id-3", "delivery_info": {}})
        holder = parse_owner(seen[0])
        assert (holder.task, holder.task_id) == ("owners.self_calling", "id-3")
        app.close()

    def test_a_task_called_directly_in_a_body_keeps_the_running_tasks_name(self) -> None:
        """Celery's worker task (the traced one), never a task called as a function in it."""
        wiring.install()
        store = MemoryLockStore()
        app = self._app()
        seen: list[str] = []

        @app.task(name="owners.inner", shared=False)
        def inner() -> None:
            with lease("k", store=store, ttl=5) as held:
                seen.append(held.owner)

        @app.task(name="owners.outer", shared=False)
        def outer() -> None:
            inner()

        tracer = build_tracer(outer.name, outer, app=app, eager=True, propagate=True)
        tracer("id-2", (), {}, {"id": "id-2", "delivery_info": {}})
        inner()  # outside any execution: no task at all
        running, direct = (parse_owner(owner) for owner in seen)
        assert (running.task, running.task_id) == ("owners.outer", "id-2")
        assert (direct.task, direct.task_id) == (None, None)
        app.close()
