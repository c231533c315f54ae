"""celery_lease.metrics: connecting sinks, install() and the worker step's settings, and renewal
latency observed under the task's name (against prometheus_client)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from celery import Celery

import celery_lease.metrics as metrics
from celery_lease import LeaseConfigError, LockedTask, MemoryLockStore
from celery_lease import signals as lease_signals
from celery_lease._celery import settings as config
from tests.unit.metrics.samples import value

prometheus_client = pytest.importorskip("prometheus_client")


class TestHotPath:
    def test_no_receivers_unless_connected(self, app: Celery) -> None:
        """Without metrics the lock signals have no receiver of ours (the engine skips them)."""
        ours = [
            r
            for signal in (lease_signals.lock_acquired, lease_signals.lock_released)
            for r in signal.receivers
            if "celery_lease.metrics" in str(r[0])
        ]
        assert ours == []


class TestInstall:
    def test_install_adds_the_worker_step_only(self, app: Celery) -> None:
        """install() validates and adds the bootstep; it connects nothing in this process."""
        metrics.install(app, port=0)
        assert metrics.MetricsStep in app.steps["worker"]
        assert metrics._sink is None

    def test_install_counts_the_app_as_using_celery_lease(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """An app with no locked task and no ``lease_*`` setting gets the worker's hooks (and
        its store check) once it installed the metrics."""
        from celery_lease._celery import startup

        plain = Celery("plain", broker="memory://", set_as_current=False)
        # Shared locked tasks of other tests would count: this app has none of its own.
        monkeypatch.setattr(startup, "locked_tasks", lambda app: iter(()))
        assert not startup.uses_celery_lease(plain)
        metrics.install(plain, port=0)
        assert metrics.installed(plain)
        assert startup.uses_celery_lease(plain)

    @pytest.mark.parametrize(
        ("kwargs", "needle"),
        [
            ({"exporter": "statsd"}, "exporter='statsd'"),
            ({"port": 70000}, "port=70000"),
            ({"port": "9809"}, "port='9809'"),
            ({"addr": ""}, "addr=''"),
        ],
    )
    def test_bad_arguments_name_the_parameter(
        self, app: Celery, kwargs: dict[str, Any], needle: str
    ) -> None:
        """A bad argument fails at the call, naming it and the value."""
        with pytest.raises(LeaseConfigError, match=needle):
            metrics.install(app, **kwargs)

    def test_refuses_when_prometheus_client_imported_without_multiproc_dir(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Prefork needs multiprocess mode, which prometheus_client picks at import."""
        from celery_lease.metrics.prometheus import PrometheusExporter

        monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
        with pytest.raises(LeaseConfigError, match="PROMETHEUS_MULTIPROC_DIR"):
            PrometheusExporter(0, "127.0.0.1", multiprocess=True, node="w@h")

    def test_single_process_exporter_serves_over_http(self, app: Celery) -> None:
        """solo/threads: the default registry, served from this process on a free port."""
        import urllib.request

        from celery_lease.metrics.prometheus import PrometheusExporter

        exporter = PrometheusExporter(0, "127.0.0.1", multiprocess=False, node="w@h")
        metrics.connect(exporter.sink)
        exporter.start()
        try:
            app.tasks["m.work"].apply((3,)).get()
            url = f"http://127.0.0.1:{exporter.bound_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as response:
                text = response.read().decode()
        finally:
            exporter.stop()
            metrics.disconnect()
        assert 'celery_lease_acquired_total{task="m.work"}' in text
        assert "# TYPE celery_lease_hold_seconds histogram" in text


class TestSetting:
    """``app.conf.lease_metrics`` / ``lease_metrics_port``: metrics without code."""

    def test_setting_selects_the_exporter_and_port(self, app: Celery) -> None:
        """lease_metrics and lease_metrics_port (a str from the environment too) are read."""
        app.conf.lease_metrics = "prometheus"
        app.conf.lease_metrics_port = "9911"
        options = metrics._options_of(app)
        assert options is not None
        assert (options.exporter, options.port) == ("prometheus", 9911)

    @pytest.mark.parametrize(
        ("value", "ports"),
        [
            ("9811-9813", (9811, 9812, 9813)),
            (" 9811 - 9811 ", (9811,)),
            (range(9811, 9814), (9811, 9812, 9813)),
            ([9815, 9811], (9815, 9811)),
            ((9811,), (9811,)),
        ],
    )
    def test_a_range_of_ports_is_read_in_each_accepted_form(
        self, app: Celery, value: object, ports: tuple[int, ...]
    ) -> None:
        """lease_metrics_port as "first-last" (from the environment), a range, a list or a tuple:
        the ports each worker takes the first free one of, in the order given."""
        app.conf.lease_metrics = "prometheus"
        app.conf.lease_metrics_port = value
        options = metrics._options_of(app)
        assert options is not None and options.port == ports

    def test_install_takes_a_range_of_ports(self, app: Celery) -> None:
        """install(port=range(...)) as the setting's range; a str is refused there (code passes
        ints), naming the parameter."""
        metrics.install(app, port=range(9811, 9813))
        options = metrics._options_of(app)
        assert options is not None and options.port == (9811, 9812)
        with pytest.raises(LeaseConfigError, match=re.escape("port='9811-9812' is not allowed")):
            metrics.install(app, port="9811-9812")

    def test_unset_or_none_exports_nothing(self, app: Celery) -> None:
        """No setting and no install(): the worker step does nothing."""
        assert metrics._options_of(app) is None
        app.conf.lease_metrics = None
        assert metrics._options_of(app) is None

    def test_install_wins_over_the_setting(self, app: Celery) -> None:
        """An install() call is used as it is, whatever the setting says."""
        app.conf.lease_metrics = "otel"
        metrics.install(app, port=0)
        options = metrics._options_of(app)
        assert options is not None and (options.exporter, options.port) == ("prometheus", 0)

    @pytest.mark.parametrize(
        ("conf", "needle"),
        [
            ({"lease_metrics": "statsd"}, "lease_metrics='statsd' is not allowed"),
            ({"lease_metrics": True}, "lease_metrics=True is not allowed"),
            ({"lease_metrics_port": 70000}, "lease_metrics_port=70000 is not allowed"),
            ({"lease_metrics_port": "80a"}, "lease_metrics_port='80a' is not allowed"),
            ({"lease_metrics_port": True}, "lease_metrics_port=True is not allowed"),
            ({"lease_metrics_port": "9813-9811"}, "lease_metrics_port='9813-9811' is not allowed"),
            ({"lease_metrics_port": [0, 9811]}, "lease_metrics_port=[0, 9811] is not allowed"),
            ({"lease_metrics_port": {9811}}, "lease_metrics_port={9811} is not allowed"),
            ({"lease_metrics_port": []}, "lease_metrics_port=[] is not allowed"),
            (
                {"lease_metrics_port": range(65535, 65537)},
                "lease_metrics_port=range(65535, 65537) is not allowed",
            ),
            ({"lease_metrics_port": 9809.0}, "lease_metrics_port=9809.0 is not allowed"),
            ({"lease_metric": "prometheus"}, "did you mean 'lease_metrics'"),
            ({"lease_metrics_prot": 1}, "did you mean 'lease_metrics_port'"),
        ],
    )
    def test_bad_setting_names_the_setting_and_the_value(
        self, app: Celery, conf: dict[str, Any], needle: str
    ) -> None:
        """A bad value or a misspelled name fails when the settings are read (worker start)."""
        from celery_lease._celery import settings as config

        app.conf.update(conf)
        with pytest.raises(LeaseConfigError, match=re.escape(needle)):
            config.get_settings(app)

    def test_missing_library_names_the_setting_and_the_extra(
        self, app: Celery, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """lease_metrics="otel" without opentelemetry: the worker step says what to install."""
        import importlib.util

        real = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a: None if name == "opentelemetry" else real(name, *a),
        )
        app.conf.lease_metrics = "otel"
        with pytest.raises(LeaseConfigError, match=r"lease_metrics='otel'.*celery-lease\[otel\]"):
            metrics._options_of(app)


class TestRenewalLatency:
    def test_renewals_of_a_running_task_observed_under_its_name(
        self, store: MemoryLockStore
    ) -> None:
        """A task holding a 1.5 s lease is renewed (every 0.5 s) while its body waits for the
        second observed renewal: both land in the renewal histogram under the task's name (a
        shorter ttl is lost on a loaded machine, and then nothing is renewed)."""
        import threading

        from celery_lease._core import renewer
        from celery_lease.metrics.prometheus import PrometheusSink

        app = Celery("r", broker="memory://", backend="cache+memory://", set_as_current=False)
        app.conf.lease_store = store
        registry = prometheus_client.CollectorRegistry()
        renewed = threading.Event()
        seen: list[str] = []

        def note(key: str, token: int | None, seconds: float, ok: bool | None) -> None:
            seen.append(key)
            if seen.count("slow:1") >= 2:
                renewed.set()

        observe = getattr(renewer, "observe_renewals", None)
        assert observe is not None, "renewer.observe_renewals is missing"
        forget = observe(note)

        @app.task(
            name="r.slow", base=LockedTask, lock_key="slow:{n}", lock_ttl="1.5s", shared=False
        )
        def slow(n: int) -> bool:
            return renewed.wait(10.0)

        metrics.connect(PrometheusSink(registry))
        try:
            assert slow.apply((1,)).get() is True
        finally:
            metrics.disconnect()
            forget()
            app.close()
        assert value(registry, "celery_lease_renewal_seconds_count", task="r.slow") >= 2


class TestAPortRangeOutOfBounds:
    """A range whose ends are not both ports (1 to 65535) is refused from its ends, before any
    of its ports is listed: a mistyped ``"9809-981800000000000"`` is an error naming the setting,
    not a tuple of a hundred trillion ints."""

    @pytest.mark.parametrize(
        "value", ["9809-981800000000000", range(9809, 981_800_000_000_000), "0-9818", "9809-65536"]
    )
    def test_it_is_refused_naming_the_setting(self, value: object) -> None:
        with pytest.raises(LeaseConfigError, match=r"lease_metrics_port=.*from 1 to 65535"):
            config.read_metrics_port(value, "lease_metrics_port")


class TestSlots:
    """Leases of a key's slots: the lock signals name the key and its ``slot``, the renewer the
    slot's store key; several slots of one key may be held in one process at once."""

    @staticmethod
    def _acquired(sender: object, key: str, slot: int, token: int, task_id: str) -> None:
        lease_signals.lock_acquired.send(
            sender=sender, key=key, slot=slot, token=token, task_id=task_id, wait_seconds=0.0
        )

    def test_a_slots_renewals_count_under_its_task(self, app: Celery) -> None:
        """A renewal of ``slot_key(key, i)`` is observed under the task that took slot ``i``."""
        from celery_lease.metrics.prometheus import PrometheusSink
        from celery_lease.stores.slots import slot_key

        registry = prometheus_client.CollectorRegistry()
        metrics.connect(PrometheusSink(registry))
        try:
            self._acquired(app.tasks["m.work"], "pay:7", 1, 11, "id-1")
            metrics._on_renewal(slot_key("pay:7", 1), 11, 0.002, True)
        finally:
            metrics.disconnect()
        assert value(registry, "celery_lease_renewal_seconds_count", task="m.work") == 1

    def test_one_slot_released_leaves_the_others_renewals_counted(self, app: Celery) -> None:
        """Two slots of one key held here, one released: the other's renewals still count,
        and the held gauge counts one."""
        from celery_lease.metrics.prometheus import PrometheusSink
        from celery_lease.stores.slots import slot_key

        registry = prometheus_client.CollectorRegistry()
        task = app.tasks["m.work"]
        metrics.connect(PrometheusSink(registry))
        try:
            self._acquired(task, "pay:7", 0, 10, "id-0")
            self._acquired(task, "pay:7", 1, 11, "id-1")
            lease_signals.lock_released.send(
                sender=task, key="pay:7", slot=0, token=10, task_id="id-0", held_seconds=1.0
            )
            metrics._on_renewal(slot_key("pay:7", 1), 11, 0.002, True)
        finally:
            metrics.disconnect()
        assert value(registry, "celery_lease_renewal_seconds_count", task="m.work") == 1
        assert value(registry, "celery_lease_held", task="m.work") == 1

    def test_a_replaced_holder_is_counted_lost_with_its_reason(self, app: Celery) -> None:
        """A holder asked to stop loses its lease with ``reason="replaced"``: a bounded label
        value like the other reasons."""
        from celery_lease.metrics.prometheus import PrometheusSink

        registry = prometheus_client.CollectorRegistry()
        task = app.tasks["m.work"]
        metrics.connect(PrometheusSink(registry))
        try:
            self._acquired(task, "sync:1", 0, 10, "old")
            lease_signals.lock_lost.send(
                sender=task, key="sync:1", slot=0, token=10, task_id="old", reason="replaced"
            )
        finally:
            metrics.disconnect()
        lost = value(registry, "celery_lease_lost_total", task="m.work", reason="replaced")
        assert lost == 1
        assert value(registry, "celery_lease_held", task="m.work") == 0


class TestSlotRenewals:
    def test_renewals_of_a_task_holding_a_slot_count_under_its_name(
        self, store: MemoryLockStore
    ) -> None:
        """A task with ``lock_limit=2`` holding slot 1 (slot 0 is another worker's) is renewed
        under the slot's store key: its renewals land under the task's name, and its
        acquisition and release are counted once each."""
        import threading

        from celery_lease._core import renewer
        from celery_lease.metrics.prometheus import PrometheusSink
        from celery_lease.stores.slots import slot_key

        app = Celery("rs", broker="memory://", backend="cache+memory://", set_as_current=False)
        app.conf.lease_store = store
        store.acquire_slot("slots:1", "another-worker", 60_000, 2)
        registry = prometheus_client.CollectorRegistry()
        renewed = threading.Event()
        seen: list[str] = []

        def note(key: str, token: int | None, seconds: float, ok: bool | None) -> None:
            seen.append(key)
            if seen.count(slot_key("slots:1", 1)) >= 2:
                renewed.set()

        forget = renewer.observe_renewals(note)

        @app.task(
            name="rs.slow",
            base=LockedTask,
            lock_key="slots:{n}",
            lock_ttl="1.5s",
            lock_limit=2,
            shared=False,
        )
        def slow(n: int) -> tuple[int, bool]:
            return slow.request.lock_slot, renewed.wait(10.0)

        metrics.connect(PrometheusSink(registry))
        try:
            assert slow.apply((1,)).get() == (1, True)
        finally:
            metrics.disconnect()
            forget()
            app.close()
        assert value(registry, "celery_lease_renewal_seconds_count", task="rs.slow") >= 2
        assert value(registry, "celery_lease_acquired_total", task="rs.slow") == 1
        assert value(registry, "celery_lease_released_total", task="rs.slow") == 1
        assert value(registry, "celery_lease_held", task="rs.slow") == 0
