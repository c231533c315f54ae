"""Starting and stopping real ``celery worker`` subprocesses, for the integration tests.

A test module defines its app at import time (from environment variables the test sets), starts
:class:`CeleryWorker` on it with ``-A <module>:app``, waits for the worker to log ``ready.`` (or
to exit, when the test expects a refusal), reads what it logged, and stops it.
:func:`filesystem_app` builds an app on the multi-process-safe filesystem transport of
``example_project.transport``, with file results, as the worker and the test's client alike.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from celery import Celery

ROOT = Path(__file__).resolve().parents[2]
STOP_TIMEOUT = 15.0  # seconds for a warm shutdown before SIGKILL
POLL = 0.05  # seconds between two looks at the log


def filesystem_app(main: str, directory: str, poll: float = POLL) -> Celery:
    """An app with the filesystem broker in ``<directory>/broker`` (polled every ``poll`` s)
    and results in ``<directory>/results``; both folders are made."""
    app = Celery(
        main, broker="filesystem://", backend=f"file://{directory}/results", set_as_current=False
    )
    folder = os.path.join(directory, "broker")
    os.makedirs(folder, exist_ok=True)
    os.makedirs(os.path.join(directory, "results"), exist_ok=True)
    app.conf.update(
        broker_transport="example_project.transport:FilesystemTransport",
        broker_transport_options={
            "data_folder_in": folder,
            "data_folder_out": folder,
            "control_folder": os.path.join(folder, "control"),
            "polling_interval": poll,
        },
        broker_connection_retry_on_startup=True,
    )
    return app


class CeleryWorker:
    """A ``celery -A <app> worker`` subprocess in its own session, its output in ``log``.

    Args:
        app: what ``-A`` gets (``"tests.integration.x:app"``).
        log: the file the worker's stdout and stderr go to.
        pool, concurrency, name: ``-P``, ``-c`` and ``-n <name>@%h``.
        env: added to this process's environment (besides ``PYTHONPATH`` set to ``cwd`` and
            ``C_FORCE_ROOT``: CI containers run as root and the workers accept pickle).
        unset: names removed from the environment.
        args: more worker options (``-E``).
        cwd: where the worker runs, and its ``PYTHONPATH``: the repository, or a project the
            test wrote.
    """

    def __init__(
        self,
        app: str,
        log: Path,
        *,
        pool: str,
        concurrency: int,
        name: str,
        env: Mapping[str, str],
        unset: Sequence[str] = (),
        args: Sequence[str] = (),
        cwd: Path = ROOT,
    ) -> None:
        self.log = log
        environ = {**os.environ, **env, "PYTHONPATH": str(cwd), "C_FORCE_ROOT": "1"}
        for variable in unset:
            environ.pop(variable, None)
        cmd = [
            sys.executable, "-m", "celery", "-A", app, "worker",
            "-P", pool, "-c", str(concurrency), *args, "-n", f"{name}@%h", "--loglevel", "INFO",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                cmd, cwd=cwd, env=environ, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def text(self) -> str:
        """What the worker logged so far."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_ready(self, timeout: float, poll: float = POLL) -> None:
        """Return once the worker logged ``ready.``; if it exits first or ``timeout`` passes,
        stop it and fail with the end of its log."""
        deadline = time.monotonic() + timeout
        while "ready." not in self.text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"worker did not start:\n{self.text()[-4000:]}")
            time.sleep(poll)

    def ready_or_exited(self, timeout: float, poll: float = POLL) -> bool:
        """True once the worker logged ``ready.``, False once it exited; fails if neither
        happens within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            if "ready." in self.text():
                return True
            time.sleep(poll)
        raise AssertionError(f"worker neither ready nor exited in {timeout}s:\n{self.text()}")

    def stop(self) -> None:
        """Warm shutdown, then SIGKILL to its process group (:func:`stop_worker`)."""
        stop_worker(self.process)


def start_worker(
    app: str,
    name: str,
    pool: str,
    concurrency: int,
    env: Mapping[str, str],
    directory: Path,
    timeout: float,
    args: Sequence[str] = (),
) -> tuple[subprocess.Popen[bytes], Path]:
    """Start ``celery -A app worker`` as ``name@%h``, logging to ``directory/worker-<name>.log``,
    and wait (``timeout`` s) until it logs ``ready.``; its process and its log."""
    worker = CeleryWorker(
        app,
        directory / f"worker-{name}.log",
        pool=pool,
        concurrency=concurrency,
        name=name,
        env=env,
        args=args,
    )
    worker.wait_ready(timeout)
    return worker.process, worker.log


def stop_worker(process: subprocess.Popen[bytes]) -> None:
    """Warm shutdown (SIGTERM to the main process), then SIGKILL to its process group."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
