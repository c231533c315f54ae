"""celery_lease.metrics.prometheus: the Prometheus sink counts the real lock signals of eager
tasks on a MemoryLockStore, into a registry of the test's own (prometheus_client)."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

import celery_lease.metrics as metrics
from celery_lease import LeaseConfigError, MemoryLockStore
from celery_lease import signals as lease_signals
from tests.unit.metrics.samples import value

pytest.importorskip("prometheus_client")


class TestPrometheusSink:
    def test_acquired_released_and_hold_counted_by_task(self, app: Celery, registry: Any) -> None:
        """Two runs: two acquisitions and releases, two hold observations, nothing held after."""
        assert app.tasks["m.work"].apply((1,)).get() == 1
        assert app.tasks["m.work"].apply((2,)).get() == 2
        assert value(registry, "celery_lease_acquired_total", task="m.work") == 2
        assert value(registry, "celery_lease_released_total", task="m.work") == 2
        assert value(registry, "celery_lease_hold_seconds_count", task="m.work") == 2
        assert value(registry, "celery_lease_wait_seconds_count", task="m.work") == 2
        assert value(registry, "celery_lease_held", task="m.work") == 0

    def test_rejected_run_counted_and_gauge_follows_holding(
        self, app: Celery, registry: Any, store: MemoryLockStore
    ) -> None:
        """A run turned away (key held by another owner) counts as rejected, not acquired."""
        store.acquire("work:7", "someone-else", 60_000)
        app.tasks["m.skip"].apply((7,)).get()
        assert value(registry, "celery_lease_rejected_total", task="m.skip") == 1
        assert value(registry, "celery_lease_acquired_total", task="m.skip") == 0

    def test_lost_counted_by_reason_and_leaves_gauge(self, registry: Any) -> None:
        """lock_lost as the engine sends it: counted under its reason; the gauge goes down."""
        task = type("T", (), {"name": "m.x"})()
        lease_signals.send(
            lease_signals.lock_acquired, task, key="k", token=1, waited=False, wait_seconds=0.5,
            task_id="i",
        )  # fmt: skip
        assert value(registry, "celery_lease_held", task="m.x") == 1
        lease_signals.send(
            lease_signals.lock_lost, task, key="k", token=1, reason="expired", task_id="i"
        )
        assert value(registry, "celery_lease_lost_total", task="m.x", reason="expired") == 1
        assert value(registry, "celery_lease_held", task="m.x") == 0
        assert value(registry, "celery_lease_wait_seconds_sum", task="m.x") == 0.5

    def test_renewal_observer_labels_by_task_of_key(self, registry: Any) -> None:
        """A renewal of a key held by a task is observed under that task's name."""
        task = type("T", (), {"name": "m.r"})()
        lease_signals.send(
            lease_signals.lock_acquired, task, key="rk", token=1, waited=False, wait_seconds=0.0,
            task_id="i",
        )  # fmt: skip
        metrics._on_renewal("rk", 1, 0.004, True)
        assert value(registry, "celery_lease_renewal_seconds_count", task="m.r") == 1
        assert value(registry, "celery_lease_renewal_seconds_sum", task="m.r") == 0.004


def _listening(port: int = 0) -> socket.socket:
    """A socket listening on 127.0.0.1 (``port`` 0: a free one), as another worker's server."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1)
    return sock


def _free_run(count: int) -> list[int]:
    """``count`` consecutive ports free on 127.0.0.1 now."""
    from celery_lease.metrics.prometheus import port_in_use

    for _ in range(50):
        with _listening() as probe:
            first = int(probe.getsockname()[1])
        ports = list(range(first, first + count))
        if ports[-1] <= 65535 and all(port_in_use("127.0.0.1", p) is None for p in ports):
            return ports
    raise AssertionError(f"no {count} consecutive free ports")


class TestPortsTaken:
    def test_a_taken_port_raises_ports_taken_naming_the_setting_and_makes_nothing(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """One port, taken: PortsTaken (not a LeaseConfigError, which refuses a worker), its
        one-line message names the setting, the port and that the worker runs without metrics;
        no multiprocess directory is made."""
        from celery_lease.metrics.prometheus import PortsTaken, PrometheusExporter

        monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
        with _listening() as taken:
            port = int(taken.getsockname()[1])
            with pytest.raises(PortsTaken) as caught:
                PrometheusExporter(port, "127.0.0.1", multiprocess=True, node="w@h")
        assert not isinstance(caught.value, LeaseConfigError)
        line = caught.value.message("w@h")
        assert "\n" not in line
        assert f"lease_metrics_port={port} cannot be served on 127.0.0.1" in line, line
        assert "worker w@h runs its tasks without metrics" in line, line
        assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ

    def test_a_range_takes_its_first_free_port_and_names_the_range_when_full(self) -> None:
        """Ports given as a range: the first free one is taken; all taken: the message names the
        range as the setting reads it."""
        from celery_lease.metrics.prometheus import PortsTaken, PrometheusExporter

        ports = _free_run(3)
        with _listening(ports[0]), _listening(ports[1]):
            exporter = PrometheusExporter(ports, "127.0.0.1", multiprocess=False, node="w@h")
            assert exporter.port == ports[2]
            with _listening(ports[2]), pytest.raises(PortsTaken) as caught:
                PrometheusExporter(ports, "127.0.0.1", multiprocess=False, node="w@h")
        assert f"lease_metrics_port={ports[0]}-{ports[2]} has no port left" in str(caught.value)

    def test_a_port_taken_between_choice_and_bind_moves_on_to_the_next(self) -> None:
        """The port chosen while the worker was built is taken before the server binds it: the
        exporter serves on the next free port of the range, and logs that one."""
        from celery_lease.metrics.prometheus import PortsTaken, PrometheusExporter

        ports = _free_run(2)
        exporter = PrometheusExporter(ports, "127.0.0.1", multiprocess=False, node="w@h")
        assert exporter.port == ports[0]
        with _listening(ports[0]):
            exporter.start()
            try:
                assert exporter.bound_port == ports[1]
            finally:
                exporter.stop()
        late = PrometheusExporter(ports[1:], "127.0.0.1", multiprocess=False, node="w@h")
        with _listening(ports[1]), pytest.raises(PortsTaken):
            late.start()
        assert late.bound_port is None


class TestDeadDirs:
    @staticmethod
    def _made(parent: Path, name: str, *, lock: bool) -> Path:
        path = parent / f"celery-lease-metrics-{name}"
        path.mkdir()
        (path / "counter_1.db").write_bytes(b"x")
        if lock:
            (path / "owner.lock").write_text("1\n")
        return path

    def test_only_directories_whose_lock_no_process_holds_are_removed(self, tmp_path: Path) -> None:
        """Removed: a directory whose lock file is not locked (its worker and children are
        gone). Kept: one whose lock is held (a live worker), one without a lock file (being
        made, or an older version's), and a directory of another name."""
        from celery_lease.metrics.prometheus import remove_dead_dirs

        dead = self._made(tmp_path, "dead", lock=True)
        live = self._made(tmp_path, "live", lock=True)
        unlocked = self._made(tmp_path, "nolock", lock=False)
        other = tmp_path / "celery-lease-5432-x"
        other.mkdir()
        with open(live / "owner.lock") as holder:
            fcntl.flock(holder.fileno(), fcntl.LOCK_EX)
            assert remove_dead_dirs(str(tmp_path)) == [str(dead)]
        assert not dead.exists()
        assert live.exists() and unlocked.exists() and other.exists()
        assert remove_dead_dirs(str(tmp_path)) == [str(live)]  # its holder closed it

    def test_a_lock_held_by_another_process_keeps_the_directory(self, tmp_path: Path) -> None:
        """The lock of a live worker is held by another process (a forked pool child keeps it
        after the worker's main process died): its directory stays until that process exits."""
        from celery_lease.metrics.prometheus import remove_dead_dirs

        live = self._made(tmp_path, "child", lock=True)
        # Two pipes, one each way: on one pipe the child could read back its own "locked".
        locked_r, locked_w = os.pipe()
        go_r, go_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                signal.alarm(60)  # never outlive a parent that failed before letting it go
                with open(live / "owner.lock") as holder:
                    fcntl.flock(holder.fileno(), fcntl.LOCK_EX)
                    os.write(locked_w, b"1")
                    os.read(go_r, 1)  # until the parent says so
            finally:
                os._exit(0)
        try:
            assert os.read(locked_r, 1) == b"1"
            assert remove_dead_dirs(str(tmp_path)) == []
            assert live.exists()
        finally:
            os.write(go_w, b"1")
            os.waitpid(pid, 0)
            for fd in (locked_r, locked_w, go_r, go_w):
                os.close(fd)
        assert remove_dead_dirs(str(tmp_path)) == [str(live)]


def test_an_unreadable_metrics_file_fails_no_scrape(tmp_path: Path) -> None:
    """A process killed while writing its metrics file leaves it unreadable: the scrape still
    answers with every other process's samples."""
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    from celery_lease.metrics.prometheus import _MultiProcess

    good = MmapedDict(str(tmp_path / "counter_101.db"))
    key = mmap_key("celery_lease_acquired", "celery_lease_acquired_total", ["task"], ["t"], "h")
    good.write_value(key, 3.0, 0.0)
    good.close()
    (tmp_path / "counter_102.db").write_bytes(b"\x40\x00\x00\x00" + b"\x00" * 4 + b"\xff" * 56)
    metrics = list(_MultiProcess(str(tmp_path)).collect())
    samples = [(s.name, s.value) for m in metrics for s in m.samples]
    assert ("celery_lease_acquired_total", 3.0) in samples
