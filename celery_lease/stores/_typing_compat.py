"""The one reach into :mod:`typing`'s internals: whether a class is a ``Protocol``.

Python 3.13 has :func:`typing.is_protocol`; before it, the marker ``_is_protocol`` that
``typing`` sets on every protocol class (and on no other class) is what it reads.
"""

from __future__ import annotations

import sys
import typing


def is_protocol(cls: type) -> bool:
    """Whether ``cls`` itself is a ``typing.Protocol`` class (not a class that implements one)."""
    if sys.version_info >= (3, 13):
        return typing.is_protocol(cls)
    return bool(cls.__dict__.get("_is_protocol", False))  # pragma: no cover (before 3.13)
