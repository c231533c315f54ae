"""celery_lease.metrics.otel: the OpenTelemetry sink against the real SDK (opentelemetry-sdk)."""

from __future__ import annotations

import pytest
from celery import Celery

import celery_lease.metrics as metrics


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
