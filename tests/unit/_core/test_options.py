"""``celery_lease._core.options``: lock options are validated once, at definition, and a bad one
fails naming the option (with its task), the value given and what is allowed."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from celery_lease import LeaseConfigError, MemoryLockStore
from celery_lease._core.options import (
    ON_HELD,
    ON_LOST,
    RETRY_CAP,
    RETRY_FIRST,
    LockOptions,
    retry_countdown,
    validate_options,
)
from celery_lease._core.unique_options import UniqueOptions

WHERE = "task 'app.work'"


def _fails(raw: dict[str, Any], prefix: str = "lock_") -> str:
    with pytest.raises(LeaseConfigError) as info:
        validate_options(raw, where=WHERE, prefix=prefix)
    return str(info.value)


class TestDefaults:
    def test_nothing_set_is_all_defaults(self) -> None:
        """No options: every field unset (app setting or built-in default later), policies at
        their defaults."""
        options = validate_options({}, where=WHERE)
        assert options == LockOptions()
        assert (options.on_held, options.on_lost, options.cooldown) == ("raise", "mark", 0.0)
        assert options.unique is None

    def test_none_is_unset(self) -> None:
        """An option given as ``None`` reads as not given."""
        raw = {"key": None, "ttl": None, "on_held": None, "on_lost": None, "cooldown": None}
        assert validate_options(raw, where=WHERE) == LockOptions()


class TestDurations:
    def test_every_duration_is_normalised_to_seconds(self) -> None:
        """ttl, wait, max_hold, cooldown and retry_countdown accept "30s", numbers and
        timedeltas, and come out as float seconds."""
        options = validate_options(
            {
                "ttl": "1m",
                "wait": 2,
                "max_hold": timedelta(minutes=5),
                "cooldown": "1.5s",
                "retry_countdown": 0.25,
            },
            where=WHERE,
        )
        assert (options.ttl, options.wait, options.max_hold) == (60.0, 2.0, 300.0)
        assert (options.cooldown, options.retry_countdown) == (1.5, 0.25)

    def test_zero_wait_and_cooldown_are_allowed(self) -> None:
        """wait=0 (do not wait) and cooldown=0 (release at once) are values, not errors."""
        options = validate_options({"wait": 0, "cooldown": 0}, where=WHERE)
        assert (options.wait, options.cooldown) == (0.0, 0.0)

    @pytest.mark.parametrize("option", ["ttl", "max_hold"])
    def test_ttl_and_max_hold_must_be_positive(self, option: str) -> None:
        """A zero ttl or max_hold is refused, naming the option of the task."""
        message = _fails({option: 0})
        assert f"lock_{option} of {WHERE}" in message

    def test_a_duration_that_does_not_parse_names_the_option(self) -> None:
        """ "30 seconds" is not a duration: the error names the option and the task."""
        message = _fails({"wait": "30 seconds"})
        assert f"lock_wait of {WHERE}" in message and "30 seconds" in message


class TestBadValues:
    @pytest.mark.parametrize(
        ("option", "value", "allowed"),
        [
            ("on_held", "wait", ON_HELD),
            ("on_lost", "ignore", ON_LOST),
        ],
    )
    def test_an_unknown_policy_lists_the_allowed_ones(
        self, option: str, value: str, allowed: tuple[str, ...]
    ) -> None:
        """A policy not in the list: option, value and every allowed policy are named."""
        message = _fails({option: value})
        assert f"lock_{option} of {WHERE}={value!r} is not allowed" in message
        assert all(policy in message for policy in allowed)

    def test_a_key_that_is_neither_template_nor_callable(self) -> None:
        """key=42: the error names the option and value and says what a key can be."""
        message = _fails({"key": 42})
        assert f"lock_key of {WHERE}=42 is not allowed" in message
        assert "template str" in message and "callable" in message

    def test_an_empty_template(self) -> None:
        """key="": a template must say something."""
        assert f"lock_key of {WHERE}='' must be a non-empty template" in _fails({"key": ""})

    def test_a_store_of_the_wrong_type(self) -> None:
        """store=5: neither a LockStore nor a URL."""
        message = _fails({"store": 5})
        assert f"lock_store of {WHERE}=5 is not allowed" in message
        assert "LockStore" in message and "store URL" in message

    def test_a_store_string_without_a_scheme(self) -> None:
        """store="localhost": a string must be a URL, and the error shows what one looks like."""
        message = _fails({"store": "localhost"})
        assert f"lock_store of {WHERE}='localhost' is not a store URL" in message
        assert "redis://" in message

    def test_decorator_keywords_are_named_without_prefix(self) -> None:
        """``locked(on_held=...)`` has no ``lock_`` prefix, and its error has none either."""
        message = _fails({"on_held": "wait"}, prefix="")
        assert message.startswith(f"on_held of {WHERE}='wait'")


class TestAcceptedValues:
    def test_keys_stores_and_policies_are_kept_as_given(self) -> None:
        """A template, a store instance or URL, and each allowed policy pass unchanged."""

        def key(n: int) -> str:
            return f"k:{n}"

        store = MemoryLockStore()
        assert validate_options({"key": "k:{n}"}, where=WHERE).key == "k:{n}"
        assert validate_options({"key": key}, where=WHERE).key is key
        assert validate_options({"store": store}, where=WHERE).store is store
        assert validate_options({"store": "memory://"}, where=WHERE).store == "memory://"
        for policy in ON_HELD:
            assert validate_options({"on_held": policy}, where=WHERE).on_held == policy
        for policy in ON_LOST:
            assert validate_options({"on_lost": policy}, where=WHERE).on_lost == policy

    def test_unique_options_are_validated_with_the_rest(self) -> None:
        """unique=... comes back as UniqueOptions; its errors name the option the same way."""
        options = validate_options({"key": "k", "unique": "while_queued"}, where=WHERE)
        assert options.unique == UniqueOptions("while_queued")
        assert f"lock_unique of {WHERE}='always'" in _fails({"unique": "always"})


class TestRetryCountdown:
    def test_the_option_is_used_as_it_is(self) -> None:
        """retry_countdown set: every attempt waits exactly that long."""
        options = LockOptions(retry_countdown=7.0)
        assert [retry_countdown(options, n) for n in (0, 3, 30)] == [7.0, 7.0, 7.0]

    @pytest.mark.parametrize("retries", [0, 1, 2, 5, 6, 20, 1000])
    def test_unset_is_exponential_jittered_and_capped(self, retries: int) -> None:
        """Unset: between half and all of min(cap, first * 2**retries)."""
        base = min(RETRY_CAP, RETRY_FIRST * 2**retries)
        for _ in range(50):
            assert base / 2 <= retry_countdown(LockOptions(), retries) <= base
