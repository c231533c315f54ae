"""OpenTelemetry instruments of locked tasks (``pip install 'celery-lease[otel]'``): the
Prometheus measurements (meter ``celery_lease``, attribute ``celery.task.name``) plus the spans
``celery_lease.wait`` and ``celery_lease.hold``. Configure the providers in each process that
runs tasks (under prefork: in ``worker_process_init``); docs/operations.md ("Metrics").
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["OtelSink"]

TASK = "celery.task.name"
SLOT = "celery_lease.slot"
"""Span attribute: the slot of a lease taken with ``limit`` (a span attribute adds no series)."""


class OtelSink:
    """Instruments from ``meter_provider`` / ``tracer_provider`` (default: the global ones)."""

    def __init__(self, meter_provider: Any = None, tracer_provider: Any = None) -> None:
        from opentelemetry import metrics, trace

        meter = metrics.get_meter("celery_lease", meter_provider=meter_provider)
        self.tracer = trace.get_tracer("celery_lease", tracer_provider=tracer_provider)
        self.acquired_total = meter.create_counter(
            "celery_lease.acquired", unit="{lease}", description="Leases acquired."
        )
        self.rejected_total = meter.create_counter(
            "celery_lease.rejected", unit="{run}", description="Runs turned away (key held)."
        )
        self.lost_total = meter.create_counter(
            "celery_lease.lost", unit="{lease}", description="Leases lost while the body ran."
        )
        self.released_total = meter.create_counter(
            "celery_lease.released", unit="{lease}", description="Leases released."
        )
        self.wait_seconds = meter.create_histogram(
            "celery_lease.wait", unit="s", description="Time taken to acquire."
        )
        self.hold_seconds = meter.create_histogram(
            "celery_lease.hold", unit="s", description="Time a lease was held."
        )
        self.held = meter.create_up_down_counter(
            "celery_lease.held", unit="{lease}", description="Leases held now."
        )
        self.renewal_seconds = meter.create_histogram(
            "celery_lease.renewal", unit="s", description="Round trip of one renewal."
        )
        self._spans: dict[tuple[str, str | None], Any] = {}
        self._lock = threading.Lock()

    def acquired(
        self,
        task: str,
        key: str,
        task_id: str | None,
        wait_seconds: float,
        slot: int | None = None,
    ) -> None:
        """Counts under the task; the wait and hold spans carry the key and, when the lease
        names one, its slot (``celery_lease.slot``)."""
        attributes = {TASK: task}
        self.acquired_total.add(1, attributes)
        self.wait_seconds.record(wait_seconds, attributes)
        self.held.add(1, attributes)
        now = time.time_ns()
        attrs: dict[str, str | int] = {TASK: task, "celery_lease.key": key}
        if slot is not None:
            attrs[SLOT] = slot
        wait = self.tracer.start_span(
            "celery_lease.wait", start_time=now - int(wait_seconds * 1e9), attributes=attrs
        )
        wait.end(end_time=now)
        hold = self.tracer.start_span("celery_lease.hold", start_time=now, attributes=attrs)
        with self._lock:
            self._spans[(key, task_id)] = hold

    def _end(self, key: str, task_id: str | None, outcome: str) -> None:
        with self._lock:
            span = self._spans.pop((key, task_id), None)
        if span is not None:
            span.set_attribute("celery_lease.outcome", outcome)
            span.end()

    def rejected(self, task: str) -> None:
        self.rejected_total.add(1, {TASK: task})

    def lost(self, task: str, key: str, task_id: str | None, reason: str) -> None:
        self.lost_total.add(1, {TASK: task, "reason": reason})
        self.held.add(-1, {TASK: task})
        self._end(key, task_id, f"lost:{reason}")

    def released(
        self, task: str, key: str, task_id: str | None, held_seconds: float, counted: bool = True
    ) -> None:
        attributes = {TASK: task}
        self.released_total.add(1, attributes)
        self.hold_seconds.record(held_seconds, attributes)
        if counted:  # else another process counted it as held (a dead pool child)
            self.held.add(-1, attributes)
        self._end(key, task_id, "released")

    def renewal(self, task: str, seconds: float) -> None:
        self.renewal_seconds.record(seconds, {TASK: task})
