"""Durations are parsed once, and bad ones are refused with the parameter named."""

from __future__ import annotations

from datetime import timedelta

import pytest

from celery_lease import LeaseConfigError, to_seconds


class TestToSeconds:
    @pytest.mark.parametrize(
        ("value", "expected"),
        [
            (30, 30.0),
            (0.25, 0.25),
            (timedelta(minutes=2), 120.0),
            ("250ms", 0.25),
            ("30s", 30.0),
            ("5m", 300.0),
            ("1h", 3600.0),
            ("1.5s", 1.5),
            ("2d", 172800.0),
            ("10", 10.0),
            (" 3 s ", 3.0),
        ],
    )
    def test_accepts_every_documented_form(self, value: object, expected: float) -> None:
        """Numbers, timedeltas and unit strings all become seconds."""
        assert to_seconds(value, name="ttl") == pytest.approx(expected)

    @pytest.mark.parametrize("value", ["abc", "5 minutes", "-1s", "", "1e3", [], None, True])
    def test_rejects_garbage_naming_the_parameter(self, value: object) -> None:
        """A value that is not a duration is a ValueError naming the parameter and the value."""
        with pytest.raises(ValueError, match=r"ttl=") as info:
            to_seconds(value, name="ttl")
        assert isinstance(info.value, LeaseConfigError)
        assert repr(value) in str(info.value)

    @pytest.mark.parametrize("value", [float("nan"), float("inf")])
    def test_rejects_non_finite(self, value: float) -> None:
        """NaN and infinity are refused."""
        with pytest.raises(LeaseConfigError, match="finite"):
            to_seconds(value, name="wait")

    def test_minimum_inclusive_and_exclusive(self) -> None:
        """Zero is allowed where the minimum is inclusive and refused where it is exclusive."""
        assert to_seconds(0, name="wait") == 0.0
        with pytest.raises(LeaseConfigError, match=r"ttl=0 must be > 0"):
            to_seconds(0, name="ttl", inclusive=False)
        with pytest.raises(LeaseConfigError, match=r"wait=-1 must be >= 0"):
            to_seconds(-1, name="wait")
