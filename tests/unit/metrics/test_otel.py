"""celery_lease.metrics.otel: the OpenTelemetry sink against the real SDK (opentelemetry-sdk)."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

import celery_lease.metrics as metrics
from celery_lease import signals


class TestOtel:
    def test_same_metrics_and_spans_through_the_sdk(self, app: Celery) -> None:
        """The OTel sink records the counters, histograms and a wait and a hold span."""
        pytest.importorskip("opentelemetry.sdk")
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from celery_lease.metrics.otel import OtelSink

        reader = InMemoryMetricReader()
        spans = InMemorySpanExporter()
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
        metrics.connect(OtelSink(MeterProvider(metric_readers=[reader]), tracer_provider))
        try:
            app.tasks["m.work"].apply((4,)).get()
        finally:
            metrics.disconnect()
        data = reader.get_metrics_data()
        points = {
            m.name: m.data.data_points
            for rm in data.resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
        }
        assert points["celery_lease.acquired"][0].value == 1
        assert points["celery_lease.acquired"][0].attributes == {"celery.task.name": "m.work"}
        assert points["celery_lease.hold"][0].count == 1
        assert points["celery_lease.held"][0].value == 0
        names = sorted(span.name for span in spans.get_finished_spans())
        assert names == ["celery_lease.hold", "celery_lease.wait"]


class TestOtelSlots:
    def _spans(self, send: Any) -> list[Any]:
        pytest.importorskip("opentelemetry.sdk")
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from celery_lease.metrics.otel import OtelSink

        spans = InMemorySpanExporter()
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
        metrics.connect(OtelSink(tracer_provider=tracer_provider))
        try:
            send()
        finally:
            metrics.disconnect()
        return list(spans.get_finished_spans())

    def test_the_spans_of_a_slot_name_its_key_and_slot(self, app: Celery) -> None:
        """The wait and hold spans of slot 2 carry ``celery_lease.key`` and
        ``celery_lease.slot`` (span attributes add no time series)."""
        task = app.tasks["m.work"]

        def send() -> None:
            signals.lock_acquired.send(
                sender=task, key="pay:7", slot=2, token=9, task_id="t", wait_seconds=0.0
            )
            signals.lock_released.send(
                sender=task, key="pay:7", slot=2, token=9, task_id="t", held_seconds=0.1
            )

        spans = self._spans(send)
        assert sorted(s.name for s in spans) == ["celery_lease.hold", "celery_lease.wait"]
        for span in spans:
            assert (span.attributes["celery_lease.key"], span.attributes["celery_lease.slot"]) == (
                "pay:7",
                2,
            )

    def test_a_release_named_by_the_slots_store_key_ends_the_hold_span(self, app: Celery) -> None:
        """The dead-holders reaper names what it released by its store key: the hold span of
        that slot (opened under the key) still ends."""
        from celery_lease.stores.slots import slot_key

        task = app.tasks["m.work"]

        def send() -> None:
            signals.lock_acquired.send(
                sender=task, key="pay:7", slot=1, token=9, task_id="t", wait_seconds=0.0
            )
            signals.lock_released.send(
                sender=task,
                key=slot_key("pay:7", 1),
                token=9,
                task_id="t",
                held_seconds=0.1,
                reason="holder_died",
            )

        spans = self._spans(send)
        assert sorted(s.name for s in spans) == ["celery_lease.hold", "celery_lease.wait"]
