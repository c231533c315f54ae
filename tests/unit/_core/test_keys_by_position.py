"""A template of bare parameter names keys a call passing every argument by position without
binding the arguments: the key is, byte for byte, the one the same arguments passed by name make
(the bound, canonical path), for every kind of value, errors included."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import math
import uuid
from collections.abc import Callable
from datetime import date, datetime, timezone
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_lease._core.keys import MAX_KEY_FIELD_CHARS, make_key_function
from celery_lease.errors import LeaseConfigError


class Colour(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Point:
    x: int
    y: int


class Text(str):
    """A str subclass."""


class Number(int):
    """An int subclass."""


VALUES: list[Any] = [
    0,
    1,
    -1,
    7,
    10**18 - 1,
    10**18,
    -(10**18) + 1,
    -(10**18),
    10**30,
    2**4000,
    True,
    False,
    None,
    "",
    "a",
    "abc-DEF_0.9",
    "123",
    "-5",
    "0",
    "01",
    "a b",
    "a:b",
    "a/b",
    "%",
    "~x",
    "ü€😀",
    "\x00",
    "x" * MAX_KEY_FIELD_CHARS,
    "x" * (MAX_KEY_FIELD_CHARS + 1),
    Text("sub"),
    Number(5),
    0.0,
    -0.0,
    1.5,
    1e300,
    math.inf,
    -math.inf,
    math.nan,
    Decimal("1.10"),
    Decimal("NaN"),
    b"bytes",
    [1, "a"],
    (1, 2),
    {"b": 1, "a": [2]},
    {1: "x"},
    set(),
    uuid.UUID(int=5),
    date(2024, 1, 2),
    datetime(2024, 1, 2, 3, 4, 5, tzinfo=timezone.utc),
    Colour.RED,
    Point(1, 2),
    object(),
    lambda: None,
]


def one(i):  # type: ignore[no-untyped-def]
    return None


def two(a, b):  # type: ignore[no-untyped-def]
    return None


def _outcome(call: Callable[[], str]) -> tuple[str, str]:
    try:
        return ("ok", call())
    except LeaseConfigError as exc:
        return ("LeaseConfigError", str(exc))
    except TypeError as exc:
        return ("TypeError", str(exc))


TEMPLATES_OF_ONE = ["o:{i}", "{i}", "{i}:o", "a:{i}:b", "x/{i}/{i}"]


class TestOneArgument:
    @pytest.mark.parametrize("template", TEMPLATES_OF_ONE)
    @pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
    def test_by_position_keys_as_by_name(self, template: str, value: Any) -> None:
        key = make_key_function(template, inspect.signature(one), task="t")
        for _ in range(2):
            assert _outcome(lambda: key((value,), {})) == _outcome(lambda: key((), {"i": value}))

    @settings(max_examples=400, deadline=None)
    @given(value=st.integers() | st.text(max_size=220) | st.floats() | st.booleans() | st.none())
    def test_any_scalar_keys_as_by_name(self, value: Any) -> None:
        key = make_key_function("o:{i}", inspect.signature(one), task="t")
        assert _outcome(lambda: key((value,), {})) == _outcome(lambda: key((), {"i": value}))

    def test_the_usual_keys(self) -> None:
        """Small ints and plain strs as they are; a numeric str, a bool, None tagged."""
        key = make_key_function("o:{i}", inspect.signature(one), task="t")
        assert [key((v,), {}) for v in (42, -3, "abc", "12", True, None)] == [
            "o:42",
            "o:-3",
            "o:abc",
            "o:~str.12",
            "o:~true",
            "o:~none",
        ]

    def test_a_call_that_does_not_fit_raises_as_before(self) -> None:
        key = make_key_function("o:{i}", inspect.signature(one), task="t")
        for args, kwargs in (((), {}), ((1, 2), {}), ((1,), {"i": 1}), ((), {"j": 1})):
            with pytest.raises(TypeError):
                key(args, kwargs)


class TestTwoArguments:
    @settings(max_examples=300, deadline=None)
    @given(a=st.sampled_from(VALUES), b=st.sampled_from(VALUES))
    def test_by_position_keys_as_by_name(self, a: Any, b: Any) -> None:
        for template in ("{a}:{b}", "k:{b}/{a}:z", "{a}:{a}"):
            key = make_key_function(template, inspect.signature(two), task="t")
            assert _outcome(lambda: key((a, b), {})) == _outcome(  # noqa: B023 - called here
                lambda: key((), {"a": a, "b": b})  # noqa: B023 - called here
            )
