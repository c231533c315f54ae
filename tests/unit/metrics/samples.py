"""Reading a Prometheus registry in the metrics tests."""

from __future__ import annotations

from typing import Any


def value(registry: Any, name: str, **labels: str) -> float:
    """The sample ``name`` with ``labels`` in ``registry``; 0.0 when it was never recorded."""
    got = registry.get_sample_value(name, labels)
    return 0.0 if got is None else float(got)
