"""Lock keys from templates, callables and the digest of bound arguments."""

from __future__ import annotations

import inspect
import subprocess
import sys
import uuid
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal

import pytest

from celery_lease.errors import LeaseConfigError
from celery_lease.keys import canonical_json, make_key_function, template_fields


def body(account_id, amount=10, *, currency="EUR"):  # type: ignore[no-untyped-def]
    return None


SIG = inspect.signature(body)


class TestTemplate:
    def test_formats_bound_arguments_with_defaults(self) -> None:
        """A template sees positional and keyword arguments by name, defaults applied."""
        key = make_key_function("acct:{account_id}:{amount}:{currency}", SIG, task="t")
        assert key((7,), {}) == "acct:7:10:EUR"
        assert key((), {"account_id": 7, "amount": 3}) == "acct:7:3:EUR"

    def test_unknown_field_names_field_and_parameters(self) -> None:
        """A field that is not a parameter fails at definition time, listing the parameters."""
        with pytest.raises(LeaseConfigError, match=r"\{acount_id\}.*account_id, amount, currency"):
            make_key_function("acct:{acount_id}", SIG, task="t")

    def test_positional_field_is_rejected(self) -> None:
        """``{}`` and ``{0}`` cannot name a parameter and are refused."""
        with pytest.raises(LeaseConfigError, match="positional field"):
            template_fields("acct:{}")
        with pytest.raises(LeaseConfigError, match="positional field"):
            make_key_function("acct:{0}", SIG, task="t")

    def test_var_keyword_fields_are_usable(self) -> None:
        """Names passed through ``**kwargs`` can appear in a template."""

        def f(a, **extra):  # type: ignore[no-untyped-def]
            return None

        key = make_key_function("{a}:{region}", inspect.signature(f), task="t")
        assert key((1,), {"region": "eu"}) == "1:eu"
        with pytest.raises(LeaseConfigError, match="region"):
            key((1,), {})

    def test_attribute_access_uses_base_name(self) -> None:
        """``{account_id.real}`` is checked against the parameter ``account_id``."""
        assert make_key_function("{account_id.real}", SIG, task="t")((5,), {}) == "5"


class TestCallable:
    def test_called_exactly_as_the_task(self) -> None:
        """A key function gets the task's own args and kwargs."""
        seen = []

        def key_fn(*args, **kwargs):  # type: ignore[no-untyped-def]
            seen.append((args, kwargs))
            return "k"

        assert make_key_function(key_fn, SIG, task="t")((1,), {"amount": 2}) == "k"
        assert seen == [((1,), {"amount": 2})]

    def test_non_str_result_is_a_config_error(self) -> None:
        """A key function returning something other than a str names what it returned."""
        key = make_key_function(lambda *a, **k: 42, SIG, task="t")
        with pytest.raises(LeaseConfigError, match=r"returned 42 \(int\)"):
            key((1,), {})

    def test_bad_key_type_is_rejected(self) -> None:
        """A key that is neither str, callable nor None is refused with what is allowed."""
        with pytest.raises(LeaseConfigError, match="template str"):
            make_key_function(42, SIG, task="t")  # type: ignore[arg-type]


class TestDigest:
    def test_same_for_positional_keyword_and_order(self) -> None:
        """Spelling, order and defaults do not change the default key."""
        key = make_key_function(None, SIG, task="app.t")
        a = key((1, 10), {})
        assert a == key((), {"amount": 10, "account_id": 1})
        assert a == key((1,), {"currency": "EUR"})
        assert a.startswith("app.t:") and len(a) == len("app.t:") + 32
        assert a != key((2,), {})

    def test_stable_across_processes(self) -> None:
        """Another interpreter (another hash seed) computes the same key."""
        code = (
            "import inspect\n"
            "from celery_lease.keys import make_key_function\n"
            "def body(account_id, amount=10, *, currency='EUR'): pass\n"
            "print(make_key_function(None, inspect.signature(body), task='app.t')"
            "((1,), {'currency': 'EUR', 'amount': 10}))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": "123", "PATH": ""},
        )
        assert out.stdout.strip() == make_key_function(None, SIG, task="app.t")((1,), {})

    def test_special_types_are_canonical(self) -> None:
        """UUID, datetime, date, Decimal and sets get one stable form each."""
        u = uuid.UUID("12345678-1234-5678-1234-567812345678")
        utc = datetime(2024, 1, 1, 12, tzinfo=timezone.utc)
        plus_one = datetime(2024, 1, 1, 13, tzinfo=timezone(timedelta(hours=1)))
        assert canonical_json({"t": utc}) == canonical_json({"t": plus_one})
        assert canonical_json({"d": Decimal("1.50")}) == canonical_json({"d": Decimal("1.5")})
        assert canonical_json({"s": {3, 1, 2}}) == canonical_json({"s": {2, 1, 3}})
        assert '"$uuid":"12345678-1234-5678-1234-567812345678"' in canonical_json({"u": u})
        assert canonical_json({"d": date(2024, 1, 2)}) == '{"d":{"$date":"2024-01-02"}}'
        assert canonical_json({"x": "1"}) != canonical_json({"x": 1})

    def test_uncanonical_argument_names_it_and_says_pass_key(self) -> None:
        """An argument with no canonical form fails naming it and pointing at ``key``."""
        key = make_key_function(None, SIG, task="t")
        with pytest.raises(LeaseConfigError, match=r"argument 'amount'.*object.*pass `key`"):
            key((1, object()), {})
        with pytest.raises(LeaseConfigError, match=r"argument 'account_id\[0\]'"):
            key(([object()],), {})
