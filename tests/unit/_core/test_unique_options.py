"""``celery_lease._core.unique_options``: the enqueue-time options (unique, on_duplicate,
queue_ttl, debounce, debounce_max) are validated once, and an error names the option, the value
and what is allowed or missing."""

from __future__ import annotations

from typing import Any

import pytest

from celery_lease import LeaseConfigError
from celery_lease._core.unique_options import (
    DEBOUNCE_MAX_FACTOR,
    ON_DUPLICATE,
    UNIQUE,
    UniqueOptions,
    validate_unique,
)


def _name(option: str) -> str:
    return f"lock_{option} of task 'app.work'"


def _validate(raw: dict[str, Any], *, has_key: bool = True) -> UniqueOptions | None:
    return validate_unique(raw, name=_name, has_key=has_key)


def _fails(raw: dict[str, Any], *, has_key: bool = True) -> str:
    with pytest.raises(LeaseConfigError) as info:
        _validate(raw, has_key=has_key)
    return str(info.value)


class TestUnset:
    def test_no_unique_is_none(self) -> None:
        """Without ``unique`` a task has no enqueue-time uniqueness."""
        assert _validate({}) is None
        assert _validate({"unique": None}) is None

    @pytest.mark.parametrize(
        ("option", "value"),
        [("on_duplicate", "raise"), ("queue_ttl", 60), ("debounce", 1), ("debounce_max", 5)],
    )
    def test_a_unique_option_without_unique_is_refused(self, option: str, value: Any) -> None:
        """Setting one of the others alone would silently do nothing: refused, naming both
        options and the values ``unique`` takes."""
        message = _fails({option: value})
        assert f"{_name(option)}={value!r} needs {_name('unique')} set" in message
        assert all(repr(u) in message for u in UNIQUE)


class TestValues:
    def test_defaults(self) -> None:
        """unique alone: on_duplicate "existing", queue_ttl from the settings, no debounce."""
        for unique in UNIQUE:
            assert _validate({"unique": unique}) == UniqueOptions(unique, "existing")

    def test_an_unknown_unique_lists_the_allowed_values(self) -> None:
        """unique="always": named with its value and every allowed one."""
        message = _fails({"unique": "always"})
        assert f"{_name('unique')}='always' is not allowed" in message
        assert all(repr(u) in message for u in UNIQUE)

    def test_an_unknown_on_duplicate_lists_the_allowed_policies(self) -> None:
        """on_duplicate="ignore": named with its value and every allowed policy."""
        message = _fails({"unique": "while_queued", "on_duplicate": "ignore"})
        assert f"{_name('on_duplicate')}='ignore' is not allowed" in message
        assert all(repr(o) in message for o in ON_DUPLICATE)

    def test_queue_ttl_is_seconds_and_positive(self) -> None:
        """queue_ttl="10m" is 600 s; a zero queue_ttl is refused, naming the option."""
        options = _validate({"unique": "until_done", "queue_ttl": "10m"})
        assert options is not None and options.queue_ttl == 600.0
        assert _name("queue_ttl") in _fails({"unique": "until_done", "queue_ttl": 0})


class TestDebounce:
    def test_debounce_max_defaults_to_a_multiple_of_debounce(self) -> None:
        """debounce=2s without debounce_max: the waiting copy is kept at most 10x as long."""
        options = _validate({"unique": "while_queued", "debounce": "2s"})
        assert options is not None
        assert (options.debounce, options.debounce_max) == (2.0, 2.0 * DEBOUNCE_MAX_FACTOR)

    def test_debounce_needs_a_key(self) -> None:
        """Without a key the newest arguments could never supersede: refused, saying to set
        the key option."""
        message = _fails({"unique": "while_queued", "debounce": 1}, has_key=False)
        assert f"{_name('debounce')}=1 needs a unique key" in message and _name("key") in message

    def test_debounce_max_without_debounce_is_refused(self) -> None:
        """debounce_max alone means nothing: refused, naming debounce."""
        message = _fails({"unique": "while_queued", "debounce_max": 5})
        assert f"{_name('debounce_max')}=5 needs {_name('debounce')} set" in message

    def test_debounce_max_shorter_than_debounce_is_refused(self) -> None:
        """debounce_max below debounce could never be reached: both values are named."""
        message = _fails({"unique": "while_queued", "debounce": 5, "debounce_max": 2})
        assert f"{_name('debounce_max')}=2 is shorter than {_name('debounce')}=5" in message

    def test_debounce_max_given_is_kept(self) -> None:
        """An explicit debounce_max at or above debounce is used as given, in seconds."""
        options = _validate({"unique": "while_queued", "debounce": 5, "debounce_max": "1m"})
        assert options is not None and (options.debounce, options.debounce_max) == (5.0, 60.0)
