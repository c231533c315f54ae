"""A worker gets celery-lease's hooks whatever module of its app imports celery-lease.

The two most common layouts of a Celery project, written to a temporary directory and run with
the real ``celery`` program (a ``celery worker`` subprocess and the ``celery inspect`` client) on
a throwaway ``redis-server`` broker (lock store: the broker's Redis):

- ``include``: ``proj/celery.py`` builds ``Celery(..., include=["proj.tasks"])``; only
  ``proj/tasks.py`` imports celery-lease;
- ``django``: a Django project whose ``proj/celery.py`` reads ``django.conf:settings`` (namespace
  ``CELERY``) and calls ``app.autodiscover_tasks()``; only ``app1/tasks.py`` (an installed app)
  imports celery-lease, with ``@shared_task(base=LockedTask)``.

In both, ``celery -A proj inspect leases`` is accepted and lists the lease a body holds, the worker
serves the metrics its settings ask for, and a SIGKILLed pool child's lease is released at once
(the dead-holders bootstep). A worker of an app that has no locked task and sets no ``lease_*``
setting gets none of it: no socket directory, no store touched.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from celery import Celery

from celery_lease import store_from_url
from celery_lease.stores.base import SupportsInspection
from tests.fixtures_redis import RedisServer
from tests.integration.workers import CeleryWorker
from tests.support import complete_lines, service_missing

pytestmark = [pytest.mark.worker, pytest.mark.slow]

READY_TIMEOUT = 60.0  # seconds for a worker to log "ready." on a loaded machine
TIMEOUT = 30.0  # seconds a test waits for a marker file, a key or a command
FREED_BOUND = 5.0  # seconds: a dead child's lease (ttl 60 s) is released well within this
POLL = 0.02

TASKS = textwrap.dedent(
    """
    import os
    import time
    from pathlib import Path

    from celery_lease import LockedTask

    OUT = Path(os.environ["WW_DIR"])


    def hold_body(run):
        (OUT / f"held-{run}").write_text(f"{os.getpid()}\\n")
        deadline = time.monotonic() + 60
        while not (OUT / f"done-{run}").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return os.getpid()
    """
)

LAYOUTS: dict[str, dict[str, str]] = {
    "include": {
        "proj/__init__.py": "",
        "proj/celery.py": """
            import os

            from celery import Celery

            app = Celery(
                "proj",
                broker=os.environ["WW_BROKER"],
                backend=os.environ["WW_BROKER"],
                include=["proj.tasks"],
            )
            app.conf.lease_metrics = "prometheus"
            app.conf.lease_metrics_port = 0
            app.conf.lease_restart_grace = 0  # the session's throwaway redis-server
            app.conf.task_default_queue = os.environ["WW_QUEUE"]
            """,
        "proj/tasks.py": TASKS
        + textwrap.dedent(
            """
            from proj.celery import app


            @app.task(name="ww.hold", base=LockedTask, lock_key="ww:{run}", lock_ttl="60s")
            def hold(run):
                return hold_body(run)
            """
        ),
    },
    "django": {
        "proj/__init__.py": "from .celery import app as celery_app\n",
        "proj/settings.py": """
            import os

            SECRET_KEY = "not-secret"
            INSTALLED_APPS = ["app1"]
            USE_TZ = True
            CELERY_BROKER_URL = os.environ["WW_BROKER"]
            CELERY_RESULT_BACKEND = os.environ["WW_BROKER"]
            CELERY_TASK_DEFAULT_QUEUE = os.environ["WW_QUEUE"]
            CELERY_LEASE_METRICS = "prometheus"
            CELERY_LEASE_METRICS_PORT = 0
            CELERY_LEASE_RESTART_GRACE = 0  # the session's throwaway redis-server
            """,
        "proj/celery.py": """
            import os

            from celery import Celery

            os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
            app = Celery("proj")
            app.config_from_object("django.conf:settings", namespace="CELERY")
            app.autodiscover_tasks()
            """,
        "app1/__init__.py": "",
        "app1/tasks.py": TASKS
        + textwrap.dedent(
            """
            from celery import shared_task


            @shared_task(name="ww.hold", base=LockedTask, lock_key="ww:{run}", lock_ttl="60s")
            def hold(run):
                return hold_body(run)
            """
        ),
    },
    "unused": {  # celery-lease imported, but no locked task and no lease_* setting
        "proj/__init__.py": "",
        "proj/celery.py": """
            import os

            from celery import Celery

            app = Celery(
                "proj",
                broker=os.environ["WW_BROKER"],
                backend=os.environ["WW_BROKER"],
                include=["proj.tasks"],
            )
            app.conf.task_default_queue = os.environ["WW_QUEUE"]
            """,
        "proj/tasks.py": """
            import os

            from celery_lease import LockedTask  # imported, never used
            from proj.celery import app


            @app.task(name="ww.plain")
            def plain():
                return os.getpid()
            """,
    },
}


def write_project(root: Path, layout: str) -> None:
    for name, text in LAYOUTS[layout].items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text if text.startswith(TASKS) else textwrap.dedent(text))


@dataclass
class Project:
    """A running worker of a temporary project, and what the test needs to talk to it."""

    root: Path
    out: Path
    tmp: Path  # the worker's TMPDIR: what celery-lease makes there is the test's to see
    env: dict[str, str]
    node: str
    client: Celery
    process: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 80) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def held(self, run: str) -> int:
        """Wait until the body of ``run`` holds its key; the pid of the pool child."""
        path = self.out / f"held-{run}"
        deadline = time.monotonic() + TIMEOUT
        while not complete_lines(path):
            assert self.process.poll() is None, f"worker exited:\n{self.tail()}"
            assert time.monotonic() < deadline, f"{run} not held; log:\n{self.tail()}"
            time.sleep(POLL)
        return int(complete_lines(path)[0])

    def celery(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run the ``celery`` program on this project (``-A proj``), as an operator would."""
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "proj", *args],
            cwd=self.root,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )


UNSET = ("DJANGO_SETTINGS_MODULE", "PROMETHEUS_MULTIPROC_DIR", "CELERY_LEASE_STORE")
"""Variables of this environment the project's worker and ``celery`` commands must not see."""


def start_project(redis_server: RedisServer, base: Path, layout: str, db: int) -> Iterator[Project]:
    root, out = base / "project", base / "out"
    root.mkdir()
    out.mkdir()
    # Short: a unix socket path (<TMPDIR>/celery-lease-<pid>-<random>/<pid>.sock) has 107 bytes.
    tmp = Path(tempfile.mkdtemp(prefix="ww-"))
    write_project(root, layout)
    broker = f"redis://127.0.0.1:{redis_server.port}/{db}"
    queue = f"ww-{layout}-{uuid.uuid4().hex[:6]}"
    env = {
        **os.environ,
        "WW_BROKER": broker,
        "WW_QUEUE": queue,
        "WW_DIR": str(out),
        "PYTHONPATH": str(root),
        "TMPDIR": str(tmp),
        "C_FORCE_ROOT": "1",
    }
    for name in UNSET:
        env.pop(name, None)
    name = f"ww{uuid.uuid4().hex[:6]}"
    worker = CeleryWorker(
        "proj",
        base / "worker.log",
        pool="prefork",
        concurrency=1,
        name=name,
        env=env,
        unset=UNSET,
        cwd=root,
    )
    process, log = worker.process, worker.log
    client = Celery("ww-client", broker=broker, backend=broker, set_as_current=False)
    client.conf.task_default_queue = queue
    project = Project(root, out, tmp, env, f"{name}@{os.uname().nodename}", client, process, log)
    try:
        worker.wait_ready(READY_TIMEOUT)
        yield project
    finally:
        for marker in out.glob("held-*"):
            (out / marker.name.replace("held-", "done-", 1)).write_text("")
        worker.stop()
        client.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module", params=["include", "django"])
def project(
    request: pytest.FixtureRequest,
    redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Project]:
    """A prefork worker (-c 1) of a project in this layout, for the module's tests."""
    layout: str = request.param
    if importlib.util.find_spec("prometheus_client") is None:  # lease_metrics = "prometheus"
        service_missing("prometheus_client", "pip install 'celery-lease[prometheus]'")
    if layout == "django" and importlib.util.find_spec("django") is None:
        service_missing("Django", "pip install 'celery-lease[django]'")
    db = 12 if layout == "include" else 13
    yield from start_project(redis_server, tmp_path_factory.mktemp(layout), layout, db)


def run_id() -> str:
    return "r" + uuid.uuid4().hex[:10]


class TestEveryLayout:
    def test_celery_inspect_leases_lists_the_lease_a_body_holds(self, project: Project) -> None:
        """``celery -A proj inspect leases`` is accepted although ``proj`` itself does not import
        celery-lease, and the worker's pool child answers with the lease its body holds."""
        run = run_id()
        result = project.client.send_task("ww.hold", (run,))
        pid = project.held(run)
        try:
            done = project.celery("inspect", "leases", "--json", "-d", project.node, "-t", "10")
        finally:
            (project.out / f"done-{run}").write_text("")
        assert result.get(timeout=TIMEOUT) == pid
        assert done.returncode == 0, done.stderr + done.stdout
        answer = json.loads(done.stdout)[project.node]
        assert answer["unanswered"] == []
        (row,) = [r for r in answer["leases"] if r["key"] == f"ww:{run}"]
        assert (row["pid"], row["task"], row["task_id"]) == (pid, "ww.hold", result.id)

    def test_the_worker_serves_the_metrics_its_settings_ask_for(self, project: Project) -> None:
        """``lease_metrics = "prometheus"`` (from the task module's app, or Django's settings):
        the worker's main process serves them (port 0: the port it took is logged)."""
        assert "celery-lease: metrics of" in project.log.read_text(errors="replace"), project.tail()

    def test_a_killed_pool_childs_lease_is_released_at_once(self, project: Project) -> None:
        """The dead-holders bootstep is installed: the lease (ttl 60 s) of a body whose pool
        child is SIGKILLed is free within seconds."""
        run = run_id()
        project.client.send_task("ww.hold", (run,))
        pid = project.held(run)
        store = store_from_url(project.env["WW_BROKER"])
        assert isinstance(store, SupportsInspection)
        assert store.get(f"ww:{run}") is not None
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while store.get(f"ww:{run}") is not None:
            assert time.monotonic() - killed < FREED_BOUND, project.tail()
            time.sleep(POLL)


class TestAppWithoutLockedTasks:
    def test_its_worker_starts_quietly_and_still_answers_inspect(
        self, redis_server: RedisServer, tmp_path: Path
    ) -> None:
        """An app that imports celery-lease but has no locked task and no ``lease_*`` setting:
        its worker logs nothing of celery-lease and still answers ``inspect leases`` (nothing
        held)."""
        gen = start_project(redis_server, tmp_path, "unused", 12)
        project = next(gen)
        try:
            assert project.client.send_task("ww.plain").get(timeout=TIMEOUT) > 0
            assert "celery-lease" not in project.log.read_text(errors="replace"), project.tail()
            done = project.celery(
                "inspect", "leases", "--json", "-d", project.node, "--timeout", "10"
            )
            assert done.returncode == 0, done.stderr + done.stdout
            answer = json.loads(done.stdout)[project.node]
            assert (answer["leases"], answer["unanswered"]) == ([], [])
        finally:
            gen.close()
