"""Durations: seconds (int/float), ``datetime.timedelta`` or strings such as ``"250ms"``, ``"30s"``.

Every duration goes through :func:`to_seconds` once, at construction, naming the parameter.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta

from celery_lease.errors import LeaseConfigError

__all__ = ["Duration", "to_seconds"]

Duration = int | float | timedelta | str
"""Seconds as a number, a ``timedelta``, or a string: ``"250ms"``, ``"30s"``, ``"5m"``, ``"1h"``."""

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*$")
_ALLOWED = "seconds as a number, a timedelta, or a string like '250ms', '30s', '5m', '1h'"


def to_seconds(value: object, *, name: str, minimum: float = 0.0, inclusive: bool = True) -> float:
    """Return ``value`` as seconds (float), validated.

    Args:
        value: the duration as given by the user.
        name: the parameter's name, used in the error message.
        minimum: the smallest value allowed (default 0).
        inclusive: whether ``minimum`` itself is allowed (``False`` for "must be > 0").

    Raises:
        LeaseConfigError: (a ``ValueError``) naming ``name``, the value and what is allowed.
    """
    seconds: float
    if isinstance(value, bool):
        raise LeaseConfigError(f"{name}={value!r} is not a duration: use {_ALLOWED}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        if match is None:
            raise LeaseConfigError(f"{name}={value!r} is not a duration: use {_ALLOWED}")
        seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    else:
        raise LeaseConfigError(
            f"{name}={value!r} ({type(value).__name__}) is not a duration: use {_ALLOWED}"
        )
    if math.isnan(seconds) or math.isinf(seconds):
        raise LeaseConfigError(f"{name}={value!r} must be a finite duration")
    if seconds < minimum or (not inclusive and seconds == minimum):
        relation = ">=" if inclusive else ">"
        raise LeaseConfigError(f"{name}={value!r} must be {relation} {minimum:g} seconds")
    return seconds
