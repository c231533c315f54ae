"""Owner ids made by ``make_owner`` are, byte for byte, what the plain spelling of the format
makes: every field validated and percent-encoded on each call, in order. ``make_owner`` keeps
encoded fields between calls; these tests hold it to the plain spelling over odd inputs (the
characters it encodes, long and over-long values, str subclasses, wrong types, None), on the
first call of a combination and on the next ones, errors included.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_lease._core import owners
from celery_lease._core.owners import MAX_OWNER_FIELD_CHARS, make_owner

_ENCODE = str.maketrans({";": "%3B", "=": "%3D", "%": "%25", "/": "%2F"})
_AT_NS = 1_733_260_000_123_456_789


def _reference_field(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(
            f"make_owner: {name} must be a str or None, got {type(value).__name__} {value!r}"
        )
    if len(value) > MAX_OWNER_FIELD_CHARS:
        raise ValueError(
            f"make_owner: {name} is {len(value)} characters long ({value[:40]!r}...); "
            f"at most {MAX_OWNER_FIELD_CHARS} are allowed"
        )
    return str(value.translate(_ENCODE))


def _reference_tail(
    node: Any, task: Any, task_id: Any, label: Any, ttl_ms: Any, cooldown_ms: Any, ticket: Any
) -> str:
    """The fields after ``host/pid/<hex>``, as the format spells them (no task source)."""
    tail = ""
    for code, name, value in (
        ("n", "node", node),
        ("t", "task", task),
        ("i", "task_id", task_id),
        ("l", "label", label),
    ):
        if value is not None:
            tail += f";{code}=" + _reference_field(name, value)
    if ttl_ms is not None:
        tail += f";ttl={int(ttl_ms)}"
    if cooldown_ms:
        tail += f";cd={int(cooldown_ms)}"
    if ticket is not None:
        tail += f";rt={int(ticket)}"
    return f"{tail};at={_AT_NS // 1_000_000}"


class _Text(str):
    """A str subclass: written as its text."""


TEXTS: list[Any] = [
    None,
    "",
    "w1@host",
    "report.build",
    "5b1d7c2e-0f3a-4c11-9d2e-4b5a6c7d8e9f",
    ";",
    "=",
    "%",
    "/",
    "%3B",
    "a;b=c/d%e",
    "ü€😀\x00\n",
    "x" * MAX_OWNER_FIELD_CHARS,
    "y" * (MAX_OWNER_FIELD_CHARS - 1) + ";",
    "z" * (MAX_OWNER_FIELD_CHARS + 1),
    _Text("sub;class"),
    _Text("plain"),
    7,
    b"bytes",
    ["list"],
]
NUMBERS: list[Any] = [None, 0, 1, 30_000, True, False, 1.9, 0.0, 10**20, -5]


def _outcome(call: Any) -> tuple[str, str]:
    try:
        return ("ok", call())
    except (TypeError, ValueError) as exc:
        return (type(exc).__name__, str(exc))


def _both(
    node: Any, task: Any, task_id: Any, label: Any, ttl_ms: Any, cooldown_ms: Any, ticket: Any
) -> tuple[tuple[str, str], tuple[str, str]]:
    def made() -> str:
        owner = make_owner(
            node=node,
            task=task,
            task_id=task_id,
            label=label,
            ttl_ms=ttl_ms,
            cooldown_ms=cooldown_ms,
            replace_ticket=ticket,
        )
        _head, sep, tail = owner.partition(";")
        return sep + tail

    def expected() -> str:
        return _reference_tail(node, task, task_id, label, ttl_ms, cooldown_ms, ticket)

    return _outcome(made), _outcome(expected)


@pytest.fixture(autouse=True)
def _fixed_time_no_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fixed time, and no default node or task (the process's are put back after)."""
    monkeypatch.setattr(time, "time_ns", lambda: _AT_NS)
    monkeypatch.setattr(owners, "_node", None)
    monkeypatch.setattr(owners, "_task_source", None)


class TestOwnerIdsMatchTheirPlainSpelling:
    @settings(max_examples=1500, deadline=None)
    @given(
        node=st.sampled_from(TEXTS),
        task=st.sampled_from(TEXTS),
        task_id=st.sampled_from(TEXTS),
        label=st.sampled_from(TEXTS),
        ttl_ms=st.sampled_from(NUMBERS),
        cooldown_ms=st.sampled_from(NUMBERS),
        ticket=st.sampled_from([None, 0, 3, 1_700_000_123]),
    )
    def test_every_combination_of_odd_fields_is_written_or_refused_alike(
        self,
        node: Any,
        task: Any,
        task_id: Any,
        label: Any,
        ttl_ms: Any,
        cooldown_ms: Any,
        ticket: Any,
    ) -> None:
        """Same text, or the same error (type and message), on the first call and the next."""
        for _ in range(2):
            made, expected = _both(node, task, task_id, label, ttl_ms, cooldown_ms, ticket)
            assert made == expected

    @settings(max_examples=500, deadline=None)
    @given(
        node=st.none() | st.text(max_size=30),
        task=st.none() | st.text(max_size=30),
        task_id=st.none() | st.text(max_size=40),
        label=st.none() | st.text(max_size=30),
        ttl_ms=st.none() | st.integers(0, 10**12),
        cooldown_ms=st.none() | st.integers(0, 10**9),
    )
    def test_any_text_is_written_alike(
        self,
        node: str | None,
        task: str | None,
        task_id: str | None,
        label: str | None,
        ttl_ms: int | None,
        cooldown_ms: int | None,
    ) -> None:
        for _ in range(2):
            made, expected = _both(node, task, task_id, label, ttl_ms, cooldown_ms, None)
            assert made == expected

    def test_a_str_subclass_equal_to_a_kept_text_is_written_as_its_own_text(self) -> None:
        """A value equal to one written before (another type, or a str subclass) is still
        checked and encoded as itself."""
        for ttl in (30_000, 30_000.0, True, 1):
            made, expected = _both("n", "t", "i", _Text("l;"), ttl, 5, None)
            assert made == expected
        assert _both("n", _Text("t"), "i", None, 1, 1.0, None)[0] == (
            "ok",
            ";n=n;t=t;i=i;ttl=1;cd=1;at=1733260000123",
        )

    def test_the_task_source_fills_left_out_task_fields(self) -> None:
        owners.set_task_source(lambda: ("t;1", "id/2"))
        for _ in range(2):
            made = make_owner(node="n", ttl_ms=5)
            assert made.partition(";")[2] == "n=n;t=t%3B1;i=id%2F2;ttl=5;at=1733260000123"


class TestOwnerIdHead:
    def test_the_hex_digits_are_the_base_plus_the_count_wrapped_to_64_bits(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``host/pid/`` then 16 lower-case hex digits of ``base + n`` modulo 2**64."""
        ids = owners._this_process_ids()
        monkeypatch.setattr(ids, "base", 2**64 - 2)
        monkeypatch.setattr(ids, "count", itertools.count(1))
        heads = [make_owner(task="t").partition(";")[0] for _ in range(3)]
        assert heads == [
            ids.prefix + "ffffffffffffffff",
            ids.prefix + "0000000000000000",
            ids.prefix + "0000000000000001",
        ]
