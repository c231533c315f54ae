"""A small, realistic Celery app built on celery-lease, and the ``demo`` that shows it working.

- :mod:`example_project.app`: the Celery app, configured from ``EXAMPLE_*`` environment variables;
- :mod:`example_project.tasks`: a nightly report run by beat (``on_held="skip"`` and a
  ``cooldown``: once per night, however many beat instances send it), an account balance update
  fenced by its token against a real table, and a cache rebuild that waits and uses the hand-off;
- :mod:`example_project.db`: the fenced ``accounts`` table (SQLite, or PostgreSQL from a DSN);
- :mod:`example_project.demo`: ``python -m example_project demo`` (also ``celery-lease demo``).

``celery -A example_project ...`` finds the app through :func:`__getattr__`, which imports it
on first use: importing the package alone (as ``python -m example_project demo`` does) does not
configure the app in that process.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["app"]


def __getattr__(name: str) -> Any:
    """``app`` (and ``celery``, where Celery also looks): the Celery app, imported lazily."""
    if name in ("app", "celery"):
        return importlib.import_module("example_project.app").app
    raise AttributeError(f"module 'example_project' has no attribute {name!r}")
