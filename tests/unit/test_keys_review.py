"""Adversarial review of lock keys (issue 8, item 9): collisions, splits and unkeyable values.

Each class tries to break one promise of :mod:`celery_lease.keys`:

- distinct argument values never share a key (template encoding decoded back, independently);
- equal values as they arrive after every serializer kombu has installed (json, pickle, yaml,
  msgpack) share one;
- a value that cannot be keyed is a :class:`LeaseConfigError` at call time, never another
  exception;
- a key stays within what every store accepts (PostgreSQL's btree index rows: about 2.7 kB).
"""

from __future__ import annotations

import inspect
import pickle
import re
import unicodedata
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any
from uuid import UUID
from zoneinfo import ZoneInfo

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kombu import serialization
from kombu.utils.json import dumps, loads

from celery_lease import keys
from celery_lease.errors import LeaseConfigError
from celery_lease.keys import make_key_function

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))


def _sig(*names: str) -> inspect.Signature:
    return inspect.Signature([inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in names])


TEMPLATE = make_key_function("k:{a}:{b}", _sig("a", "b"), task="t")
DIGEST = make_key_function(None, _sig("a", "b"), task="t")
FORMS = {"template": TEMPLATE, "digest": DIGEST}


def key(form: str, a: Any, b: Any = None) -> str:
    return FORMS[form]((), {"a": a, "b": b})


def _json(value: Any) -> Any:
    return loads(dumps(value))


# An independent decoder of the template encoding: decodable means injective ------------------


def _unpct(text: str) -> bytes:
    return re.sub(rb"%([0-9A-F]{2})", lambda m: bytes([int(m[1], 16)]), text.encode("ascii"))


def _unesc(text: str) -> str:
    return re.sub(r"%(25|2E)", lambda m: "%" if m[1] == "25" else ".", text)


def _items(body: str) -> list[str]:
    if not body:
        return []
    assert body.startswith("."), body
    return [_unesc(part) for part in body[1:].split(".")]


def _iso_datetime(text: str) -> str:
    m = re.fullmatch(r"(\d{4})(\d\d)(\d\d)T(\d\d)(\d\d)(\d\d)(\.\d{6})?(Z?)", text)
    assert m, text
    iso = f"{m[1]}-{m[2]}-{m[3]}T{m[4]}:{m[5]}:{m[6]}{m[7] or ''}"
    return iso + ("+00:00" if m[8] else "")


def _iso_time(text: str) -> str:
    m = re.fullmatch(r"(\d\d)(\d\d)(\d\d)(\.\d{6})?(?:([+-])(\d\d)(\d\d)(\d\d)?)?", text)
    assert m, text
    iso = f"{m[1]}:{m[2]}:{m[3]}{m[4] or ''}"
    if m[5]:
        iso += f"{m[5]}{m[6]}:{m[7]}" + (f":{m[8]}" if m[8] else "")
    return iso


def decode(field: str) -> Any:
    """The canonical value (as ``keys._canon`` writes it) whose template encoding is ``field``."""
    assert set(field) <= keys.FIELD_ALPHABET, field
    if not field.startswith("~"):
        if re.fullmatch(r"-?[0-9]+", field):
            assert field == str(int(field)), field
            return int(field)
        return _unpct(field).decode("utf-8", "surrogatepass")
    tag, dot, rest = field[1:].partition(".")
    body = field[1 + len(tag) :]
    simple = {"none": None, "true": True, "false": False}
    if tag in simple:
        assert not dot, field
        return simple[tag]
    if tag == "str":
        assert dot and (rest == "" or re.fullmatch(r"-?[0-9]+", rest)), field
        return rest
    if tag == "float":
        text = _unpct(rest).decode()
        return {"$float": text} if text in ("nan", "inf", "-inf") else float(text)
    if tag in ("int", "uuid"):
        return {f"${tag}": rest}
    if tag == "dt":
        return {"$datetime": _iso_datetime(rest)}
    if tag == "date":
        assert re.fullmatch(r"\d{8}", rest), field
        return {"$date": f"{rest[:4]}-{rest[4:6]}-{rest[6:]}"}
    if tag == "time":
        return {"$time": _iso_time(_unpct(rest).decode())}
    if tag == "td":
        return {"$timedelta": [int(part) for part in rest.split(".")]}
    if tag in ("dec", "enum"):
        return {"$decimal" if tag == "dec" else "$enum": _unpct(rest).decode()}
    if tag == "bytes":
        return {"$bytes": _unpct(rest).hex()}
    if tag == "list":
        return [decode(part) for part in _items(body)]
    if tag == "set":
        return {"$set": [decode(part) for part in _items(body)]}
    if tag == "dict":
        parts = _items(body)
        assert len(parts) % 2 == 0, field
        out: dict[str, Any] = {}
        for name, value in zip(parts[::2], parts[1::2], strict=True):
            text = decode(name)
            assert isinstance(text, str), field
            out["$" + text if text.startswith("$") else text] = decode(value)
        return out
    raise AssertionError(f"unknown tag in {field!r}")


_LOOKALIKES = [
    "~none", "~true", "~str.42", "~list.1", "~dict", "~float.1.5", "~dt.20240102T030405Z",
    "%7Enone", "%2E", "%252E", "$uuid", "$$", "$", "$set", "~hash.0", ".", "",
]  # fmt: skip
_PIECES = [*"%~.-_09aA:/$é", "e\u0301", "\u212b", "\u00c5", "A\u030a", "2E", "25", "\ud800"]
adversarial_text = st.lists(st.sampled_from(_PIECES), max_size=6).map("".join) | st.sampled_from(
    _LOOKALIKES
)
adversarial_scalars = (
    adversarial_text
    | st.integers(-3, 3)
    | st.sampled_from([10**700, 2**63, True, False, None, 0.0, -0.0, 1.0, float("nan")])
    | st.sampled_from([float("inf"), 1e16, 1e-5, Decimal("1.50"), Decimal("15E-1")])
    | st.sampled_from([Decimal("1E+2"), Decimal("NaN"), Decimal("-0"), b"", b"%", b"."])
    | st.datetimes(timezones=st.none() | st.timezones())
    | st.times()
    | st.dates()
    | st.timedeltas()
    | st.uuids()
)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    names = adversarial_text | st.integers(-2, 2)
    return (
        st.lists(children, max_size=3)
        | st.lists(children, max_size=3).map(tuple)
        | st.dictionaries(names, children, max_size=3)
        | st.frozensets(adversarial_text | st.integers(-2, 2), max_size=3)
    )


adversarial_values = st.recursive(adversarial_scalars, _containers, max_leaves=8)


def _canonical(value: Any) -> Any:
    try:
        return keys._canon(value, "a", set())
    except keys._Uncanonical:
        return None


class TestTemplateEncodingIsDecodable:
    @SETTINGS
    @given(value=adversarial_values)
    def test_every_field_decodes_to_its_canonical_value(self, value: Any) -> None:
        """A field's encoding decodes back to the canonical value: no two values share one."""
        canonical = _canonical(value)
        if canonical is None:
            return
        field = keys._render(canonical)
        assert keys._dumps(decode(field)) == keys._dumps(canonical), (value, field)

    @SETTINGS
    @given(a=adversarial_values, b=adversarial_values)
    def test_template_and_digest_agree_on_what_is_one_value(self, a: Any, b: Any) -> None:
        """Two values share a template key exactly when they share a digest key."""
        if _canonical(a) is None or _canonical(b) is None:
            return
        assert (key("template", a) == key("template", b)) is (key("digest", a) == key("digest", b))


def _serializers() -> list[str]:
    """Every serializer kombu's registry has that works here (msgpack only if installed)."""
    usable = []
    for name in sorted(serialization.registry._encoders):
        try:
            serialization.dumps([1], serializer=name)
        except Exception:  # SerializerNotInstalled and friends
            continue
        usable.append(name)
    return usable


SERIALIZERS = _serializers()


def _transit(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What a worker receives for ``(args, kwargs)`` sent with serializer ``name``, or None."""
    try:
        content_type, encoding, body = serialization.dumps((args, kwargs, {}), serializer=name)
        received = serialization.loads(body, content_type, encoding, accept=[content_type])
    except Exception:  # a value this serializer cannot carry never arrives
        return None
    return received


class TestEveryInstalledSerializer:
    def test_json_pickle_and_yaml_are_checked(self) -> None:
        """The round trips below cover at least json, pickle and yaml."""
        assert {"json", "pickle", "yaml"} <= set(SERIALIZERS)

    @pytest.mark.parametrize("serializer", SERIALIZERS)
    @pytest.mark.parametrize("form", sorted(FORMS))
    @SETTINGS
    @given(a=adversarial_values, b=adversarial_values)
    def test_a_value_keeps_its_key_in_transit(
        self, serializer: str, form: str, a: Any, b: Any
    ) -> None:
        """What the serializer delivers has the key of what was sent (or could not be sent)."""
        try:
            sent = key(form, a, b)
        except LeaseConfigError:
            return
        received = _transit(serializer, (a, b), {})
        if received is None:
            return
        (a2, b2), _, _ = received
        assert key(form, a2, b2) == sent, (a2, b2)


class TestCanonicalDecisions:
    @pytest.mark.parametrize("form", sorted(FORMS))
    def test_nfc_and_nfd_are_distinct_values_in_transit(self, form: str) -> None:
        """An "é" composed and decomposed are different strs: two keys, also after transit."""
        nfc, nfd = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")
        assert nfc != nfd
        for name in SERIALIZERS:
            ((a, b), _, _) = _transit(name, (nfc, nfd), {})
            assert key(form, a) == key(form, nfc) != key(form, nfd) == key(form, b), name

    @pytest.mark.parametrize("form", sorted(FORMS))
    def test_fold_of_an_aware_datetime_is_its_instant(self, form: str) -> None:
        """Both readings of an ambiguous local time are two instants: two keys, kept by json.

        (Python's ``==`` ignores ``fold`` within one zone; json and pickle keep the instant.)
        """
        first = datetime(2024, 11, 3, 1, 30, tzinfo=ZoneInfo("America/New_York"))
        second = first.replace(fold=1)
        assert key(form, first) != key(form, second)
        for value in (first, second):
            assert key(form, _json(value)) == key(form, pickle.loads(pickle.dumps(value)))
            assert key(form, _json(value)) == key(form, value)
        naive = datetime(2024, 11, 3, 1, 30)
        assert key(form, naive) == key(form, naive.replace(fold=1)) == key(form, _json(naive))

    @pytest.mark.parametrize("form", sorted(FORMS))
    def test_naive_and_aware_utc_are_two_values(self, form: str) -> None:
        """A naive datetime is not the UTC one with the same digits (json keeps them apart)."""
        naive = datetime(2024, 1, 2, 3, 4, 5)
        aware = naive.replace(tzinfo=timezone.utc)
        assert key(form, naive) != key(form, aware)
        assert key(form, _json(aware)) == key(form, aware)

    @pytest.mark.parametrize("form", sorted(FORMS))
    def test_containers_after_json(self, form: str) -> None:
        """Bools stay apart from ints inside containers; tuples nest as lists; int keys as str."""
        assert key(form, [True, (1, (2,))]) == key(form, _json([True, (1, (2,))]))
        assert key(form, [True]) != key(form, [1])
        assert key(form, {1: [1]}) != key(form, {1: [True]})
        assert key(form, {1: {2: "x"}}) == key(form, _json({1: {2: "x"}}))
        assert key(form, Decimal("1E+2")) == key(form, Decimal("100.00"))
        assert key(form, Decimal("1E+2")) != key(form, Decimal("101"))

    @pytest.mark.parametrize("form", sorted(FORMS))
    @pytest.mark.parametrize(
        "offset", [timedelta(microseconds=1), timedelta(microseconds=-999_999), timedelta(0)]
    )
    def test_datetime_with_a_sub_second_offset_is_an_error_or_keeps_its_key(
        self, form: str, offset: timedelta
    ) -> None:
        """A UTC offset under a second is dropped by json (CPython 3.11): refused, never split.

        Before the fix the aware datetime keyed as its exact instant and json delivered one a
        microsecond away: another key for the same call.
        """
        value = datetime(2024, 1, 1, tzinfo=timezone(offset))
        try:
            sent = key(form, value)
        except LeaseConfigError as exc:
            assert "offset" in str(exc) and "argument 'a'" in str(exc)
            return
        assert key(form, _json(value)) == sent

    @pytest.mark.parametrize("form", sorted(FORMS))
    def test_sub_second_offsets_are_refused_alike_for_time_and_datetime(self, form: str) -> None:
        """One rule for both: an offset with microseconds is refused, whole seconds are kept."""
        tz = timezone(timedelta(hours=1, microseconds=5))
        for value in (time(1, tzinfo=tz), datetime(2024, 1, 1, tzinfo=tz)):
            with pytest.raises(LeaseConfigError, match="offset with microseconds"):
                key(form, value)
        seconds = timezone(timedelta(minutes=19, seconds=32))  # Amsterdam's offset until 1937
        value = datetime(1930, 1, 1, tzinfo=seconds)
        assert key(form, _json(value)) == key(form, value)
        assert key(form, time(1, tzinfo=seconds)) == key(form, _json(time(1, tzinfo=seconds)))


class TestUnkeyableIsAConfigError:
    @pytest.mark.parametrize("form", sorted(FORMS))
    def test_deep_nesting_is_a_config_error_at_any_depth(self, form: str) -> None:
        """However deep a value nests, the key is built or a LeaseConfigError, never a bare
        RecursionError (the template encoding recursed deeper than the canonical form did)."""
        for depth in range(200, 520, 8):
            value: list[Any] = []
            for _ in range(depth):
                value = [value]
            try:
                key(form, value)
            except LeaseConfigError as exc:
                assert "nested too deeply" in str(exc)


class TestLongArguments:
    """A template key must stay storable: PostgreSQL refuses index rows over ~2.7 kB.

    Before the fix a 3 kB string in ``"doc:{text}"`` made a 3 kB key, and the PostgreSQL store
    failed every acquire with ``index row size 4016 exceeds btree version 4 maximum 2704``
    (``StoreUnavailableError``): a task that works for short arguments fails for long ones.
    """

    LIMIT = 2704  # PostgreSQL btree v4: the largest index row, in bytes

    @pytest.mark.parametrize(
        "value",
        ["x" * 10_000, "\u00e9" * 10_000, ["é" * 50] * 200, {"k": "v" * 3000}, 10**2000],
        ids=["ascii", "non-ascii", "list", "dict", "int"],
    )
    def test_a_long_argument_gives_a_storable_key(self, value: Any) -> None:
        """A 10 kB argument in a template gives a key far below PostgreSQL's index row limit."""
        made = key("template", value, "short")
        assert len(made.encode()) < self.LIMIT // 4, made[:80]
        assert made.startswith("k:") and made.endswith(":short")

    def test_long_arguments_keep_distinct_and_equal_keys(self) -> None:
        """Long values that differ by one character get two keys; equal ones (json) share one."""
        base = "é" * 5000
        assert key("template", base + "a") != key("template", base + "b")
        assert key("template", (base, 1)) == key("template", _json((base, 1)))
        assert key("template", base) != key("template", [base])

    def test_short_fields_stay_readable(self) -> None:
        """A field of up to 200 encoded characters is written out, not hashed."""
        assert key("template", "a" * 200, 1) == "k:" + "a" * 200 + ":1"
        hashed = key("template", "a" * 201, 1)
        assert re.fullmatch(r"k:~hash\.[0-9a-f]{32}:1", hashed), hashed


class TestTemplateLookups:
    def test_positional_only_parameter_is_not_shadowed_by_a_kwargs_entry(self) -> None:
        """``def f(a, /, **kw)``: ``{a}`` is the parameter, even when ``kw`` has an ``a``.

        Before the fix ``f(1, a=5)`` and ``f(2, a=5)`` both keyed as ``k:5``: two holders.
        """

        def f(a: int, /, **kw: int) -> None: ...

        made = make_key_function("k:{a}", inspect.signature(f), task="t")
        assert made((1,), {"a": 5}) == "k:1"
        assert made((1,), {"a": 5}) != made((2,), {"a": 5})
        assert made((1,), {}) == "k:1"

    def test_digit_attribute_reads_an_int_key_as_json_would_deliver_it(self) -> None:
        """``{a.1}`` reads ``{1: x}`` as it reads ``{"1": x}`` (what json delivers for it).

        Before the fix the direct call failed (KeyError '1') and the json delivery keyed.
        """
        made = make_key_function("k:{a.1}", _sig("a"), task="t")
        assert made((), {"a": {1: "x"}}) == made((), {"a": _json({1: "x"})}) == "k:x"
        with pytest.raises(LeaseConfigError, match="both"):
            made((), {"a": {1: "x", "1": "y"}})


class TestMiscValues:
    @pytest.mark.parametrize("form", sorted(FORMS))
    def test_uuid_date_and_their_text_differ(self, form: str) -> None:
        """A UUID, a date, and their ISO/hex text are different values (json keeps the types)."""
        u = UUID(int=7)
        assert key(form, u) != key(form, str(u))
        assert key(form, _json(u)) == key(form, u)
        assert key(form, date(2024, 1, 2)) != key(form, "2024-01-02")
        assert key(form, _json(date(2024, 1, 2))) == key(form, date(2024, 1, 2))


class _BrokenJson:
    """An object whose ``__json__`` (kombu's hook) raises."""

    def __json__(self) -> object:
        raise ValueError("no json today")


class TestJsonHook:
    @pytest.mark.parametrize("form", sorted(FORMS))
    def test_a_failing_json_hook_is_a_config_error(self, form: str) -> None:
        """``__json__`` raising is a LeaseConfigError naming the argument (as a failing
        ``model_dump`` is), not the hook's own exception from deep inside the key code."""
        with pytest.raises(LeaseConfigError, match=r"argument 'a\[0\]'.*__json__.*no json today"):
            key(form, [_BrokenJson()])
