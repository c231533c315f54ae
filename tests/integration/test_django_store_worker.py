"""A Django project on ``CELERY_LEASE_STORE = "django://default"``, run by a real worker.

The project (written to a temporary directory) is Celery's Django layout: ``proj/settings.py``
with ``DATABASES["default"]`` on the real PostgreSQL (the session's scratch database),
``proj/celery.py`` reading the ``CELERY`` namespace, and a ``shared_task(base=LockedTask)`` in an
installed app. A ``celery worker`` (prefork -c 1, the filesystem broker) builds the store from
``DATABASES`` at start (its store check) and in its pool process; the lease the task took is in
that database. ``celery -A proj lease check`` reads the same store.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

from tests.integration.workers import ROOT, CeleryWorker

pytestmark = [pytest.mark.worker]

START_TIMEOUT = 60.0
RESULT_TIMEOUT = 30.0

SETTINGS = """
import os

SECRET_KEY = "not-secret"
INSTALLED_APPS = ["shop"]
USE_TZ = True
DATABASES = {{"default": {database!r}}}
BROKER_DIR = os.environ["DJ_DIR"] + "/broker"
CELERY_BROKER_URL = "filesystem://"
CELERY_BROKER_TRANSPORT = "example_project.transport:FilesystemTransport"
CELERY_BROKER_TRANSPORT_OPTIONS = {{
    "data_folder_in": BROKER_DIR,
    "data_folder_out": BROKER_DIR,
    "control_folder": BROKER_DIR + "/control",
    "polling_interval": 0.05,
}}
CELERY_RESULT_BACKEND = "file://" + os.environ["DJ_DIR"] + "/results"
CELERY_LEASE_STORE = "django://default"
CELERY_LEASE_KEY_PREFIX = "shop:"
"""

CELERY = """
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
"""

TASKS = """
import os

from celery import shared_task

from celery_lease import LockedTask, current_lease


@shared_task(name="shop.report", base=LockedTask, lock_key="report:{day}")
def report(day):
    held = current_lease()
    return held.key, held.token, os.getpid()
"""


def _database(dsn: str) -> dict[str, Any]:
    parts = urlsplit(dsn)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parts.path.lstrip("/"),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
    }


@pytest.fixture
def project(tmp_path: Path, pg_database_dsn: str) -> Iterator[tuple[Path, dict[str, str]]]:
    """The project's directory and the environment its processes run in."""
    pytest.importorskip("django")
    for package in ("proj", "shop"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    # as Celery's Django guide: the app is made whenever Django loads the project
    (tmp_path / "proj" / "__init__.py").write_text("from .celery import app as celery_app\n")
    (tmp_path / "proj" / "settings.py").write_text(
        SETTINGS.format(database=_database(pg_database_dsn))
    )
    (tmp_path / "proj" / "celery.py").write_text(textwrap.dedent(CELERY))
    (tmp_path / "shop" / "tasks.py").write_text(textwrap.dedent(TASKS))
    for folder in ("broker", "broker/control", "results"):
        (tmp_path / folder).mkdir()
    # The worker's PYTHONPATH is its working directory (the project): this checkout's package
    # and broker transport are linked there, so the code under test is the one imported.
    for package in ("celery_lease", "example_project"):
        (tmp_path / package).symlink_to(ROOT / package, target_is_directory=True)
    env = {
        "DJ_DIR": str(tmp_path),
        "DJANGO_SETTINGS_MODULE": "proj.settings",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
    }
    yield tmp_path, env


def test_a_worker_takes_its_leases_in_the_database_of_databases(
    project: tuple[Path, dict[str, str]], pg_database_dsn: str
) -> None:
    """The worker starts on ``django://default`` (its store check reached the database), runs
    the locked task in a pool process, and the lease's token is the one the database's table
    recorded for the prefixed key; ``lease check`` says ok for the same store."""
    from celery_lease import PostgresLockStore

    directory, env = project
    worker = CeleryWorker(
        "proj",
        directory / "worker.log",
        pool="prefork",
        concurrency=1,
        name=f"dj-{uuid.uuid4().hex[:6]}",
        env=env,
        cwd=directory,
    )
    client = subprocess.run(
        [
            sys.executable,
            "-c",
            "import django; django.setup()\n"
            "from shop.tasks import report\n"
            f"print(report.delay('mon').get(timeout={RESULT_TIMEOUT}))\n",
        ],
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT + RESULT_TIMEOUT,
        cwd=directory,
        env={**os.environ, **env},
        check=False,
    )  # sent at once: it waits in the broker until the worker is ready
    try:
        worker.wait_ready(START_TIMEOUT)
        assert client.returncode == 0, client.stderr + worker.text()[-3000:]
        key, token, pid = ast.literal_eval(client.stdout.strip())
    finally:
        worker.stop()
    assert key == "shop:report:mon" and pid != worker.process.pid
    store = PostgresLockStore(pg_database_dsn)
    try:
        assert store.last_token("shop:report:mon") == token
        assert store.get("shop:report:mon") is None  # released after the body
    finally:
        store.close()
    check = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "proj", "lease", "check"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=directory,
        env={**os.environ, **env},
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "ok    lease_store django://default" in check.stdout, check.stdout
