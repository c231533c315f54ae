"""Lock keys from templates, callables and the digest of bound arguments."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import pickle
import re
import subprocess
import sys
import unicodedata
import uuid
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any
from uuid import UUID
from zoneinfo import ZoneInfo

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kombu import serialization
from kombu.utils.json import dumps, loads

from celery_lease._core import keys
from celery_lease._core.keys import canonical_json, make_key_function, template_fields
from celery_lease.errors import LeaseConfigError


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
            "from celery_lease._core.keys import make_key_function\n"
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


# Keys must neither collide nor split ----------------------------------------------------------


def template_key(template: str, **values: object) -> str:
    """The key ``template`` gives for a task taking exactly the fields in ``values``."""
    params = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY) for name in values]
    return make_key_function(template, inspect.Signature(params), task="t")((), values)


def digest(**values: object) -> str:
    """The default key of a task taking exactly the parameters in ``values``."""
    params = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY) for name in values]
    return make_key_function(None, inspect.Signature(params), task="t")((), values)


class Color(enum.IntEnum):
    RED = 1


class Mode(enum.Enum):
    FAST = "fast"


class Opaque:
    """An object whose ``str()`` is its address: keyed by ``str()``, a new key on every call."""


@dataclasses.dataclass
class Point:
    x: int
    y: int


@dataclasses.dataclass
class Size:
    x: int
    y: int


class TestTemplateEncoding:
    def test_readable_common_case(self) -> None:
        """An int and a plain identifier string render as themselves."""
        assert template_key("account:{a}", a=42) == "account:42"
        assert template_key("account:{a}", a="eu-west_1.b") == "account:eu-west_1.b"

    def test_separator_inside_a_value_cannot_imitate_the_template(self) -> None:
        """``("x:y", "z")`` and ``("x", "y:z")`` get two keys."""
        assert template_key("acct:{a}:{b}", a="x:y", b="z") != template_key(
            "acct:{a}:{b}", a="x", b="y:z"
        )
        assert template_key("acct:{a}", a="x:y") == "acct:x%3Ay"

    def test_str_and_int_do_not_collide(self) -> None:
        """The str ``"42"`` is tagged so it differs from the int 42; ``"-7"`` and ``""`` too."""
        assert template_key("k:{a}", a="42") == "k:~str.42"
        assert template_key("k:{a}", a="-7") != template_key("k:{a}", a=-7)
        assert template_key("k:{a}", a="") == "k:~str."

    def test_tag_character_in_a_str_is_escaped(self) -> None:
        """A str cannot spell another type's tagged form."""
        assert template_key("k:{a}", a="~none") != template_key("k:{a}", a=None)
        assert template_key("k:{a}", a="~none") == "k:%7Enone"

    def test_equal_dicts_in_another_order_share_a_key(self) -> None:
        """Key order of a mapping does not matter."""
        assert template_key("k:{a}", a={"x": 1, "y": 2}) == template_key(
            "k:{a}", a={"y": 2, "x": 1}
        )

    def test_tuple_and_list_share_a_key(self) -> None:
        """A tuple from a direct call and the list json delivers give one key."""
        assert template_key("k:{a}", a=(1, "x")) == template_key("k:{a}", a=[1, "x"])

    def test_object_without_canonical_form_is_an_error_naming_it(self) -> None:
        """An object with no canonical form fails at call time, naming argument and type."""
        with pytest.raises(LeaseConfigError, match=r"argument 'a'.*Opaque.*`key`"):
            template_key("k:{a}", a=Opaque())

    def test_types_are_tagged(self) -> None:
        """None, bools, floats, UUIDs, datetimes, Decimals and bytes each get a tag."""
        u = uuid.UUID("12345678-1234-5678-1234-567812345678")
        assert template_key("k:{a}", a=None) == "k:~none"
        assert template_key("k:{a}", a=True) == "k:~true"
        assert template_key("k:{a}", a=1.5) == "k:~float.1.5"
        assert template_key("k:{a}", a=u) == "k:~uuid.12345678-1234-5678-1234-567812345678"
        aware = datetime(2024, 1, 2, 13, 4, 5, tzinfo=timezone(timedelta(hours=1)))
        assert template_key("k:{a}", a=aware) == "k:~dt.20240102T120405Z"
        assert template_key("k:{a}", a=datetime(2024, 1, 2, 3, 4, 5)) == "k:~dt.20240102T030405"
        assert template_key("k:{a}", a=date(2024, 1, 2)) == "k:~date.20240102"
        assert template_key("k:{a}", a=Decimal("1.50")) == "k:~dec.1.5"
        assert template_key("k:{a}", a=b"ab") == "k:~bytes.ab"
        assert template_key("k:{a}", a=[1, "x"]) == "k:~list.1.x"

    def test_adjacent_fields_need_a_separator_values_cannot_produce(self) -> None:
        """``{a}{b}`` and ``{a}-{b}`` are refused at definition time, naming the template."""
        for template in ("{a}{b}", "{a}-{b}", "x{a}._{b}y"):
            with pytest.raises(LeaseConfigError, match=r"key='.*' .*\{a\} and \{b\}"):
                make_key_function(template, inspect.signature(lambda a, b: None), task="t")
        make_key_function("{a}:-{b}", inspect.signature(lambda a, b: None), task="t")

    def test_conversions_and_format_specs_are_refused(self) -> None:
        """``{a!r}`` and ``{a:>5}`` have no canonical meaning and fail at definition time."""
        for template in ("k:{a!r}", "k:{a:>5}", "k:{a!s:x}"):
            with pytest.raises(LeaseConfigError, match="conversion or format spec"):
                make_key_function(template, inspect.signature(lambda a: None), task="t")

    def test_lookups_resolve_then_encode(self) -> None:
        """``{a[0]}`` and ``{a.b}`` read the value, then encode it; ``.name`` reads a mapping."""
        assert template_key("k:{a[0]}", a=["x:y"]) == "k:x%3Ay"
        assert template_key("k:{a.id}", a={"id": 7}) == "k:7"
        assert template_key("k:{a[1]}", a={"1": "json"}) == template_key("k:{a[1]}", a={1: "json"})
        with pytest.raises(LeaseConfigError, match=r"\{a.nope\}.*task 't'"):
            template_key("k:{a.nope}", a={"id": 7})


class TestCanonicalEquivalence:
    """What counts as one value (one key) and what as two, in both key forms."""

    @pytest.mark.parametrize("form", ["template", "digest"])
    def test_decisions(self, form: str) -> None:
        """The documented decisions: which values are one key and which are two."""

        def key(value: object) -> str:
            return template_key("k:{a}", a=value) if form == "template" else digest(a=value)

        assert key(-0.0) == key(0.0)
        assert key(float("nan")) == key(float("nan"))
        assert key(Decimal("-0")) == key(Decimal("0.00"))
        assert key({3, 1, 2}) == key(frozenset({2, 3, 1}))
        assert key(1) != key(1.0)
        assert key(True) != key(1)
        assert key(b"a") != key("a")
        assert key([1]) != key({1})
        assert key(Color.RED) == key(1)  # json delivers an IntEnum as its int
        assert key(Mode.FAST) != key("fast")
        a = Decimal("1.00000000000000000000000000001")
        b = Decimal("1.000000000000000000000000000012")
        assert key(a) != key(b)  # beyond the default context's 28 digits
        assert key(Point(1, 2)) == key(Point(1, 2))
        assert key(Point(1, 2)) != key(Size(1, 2))
        assert key({1: "a"}) == key({"1": "a"})  # json turns int keys into str keys
        assert key("\ud83d\ude00") == key("\U0001f600")  # json's decoder joins the pair

    @pytest.mark.parametrize("form", ["template", "digest"])
    def test_uncanonical_values_are_errors(self, form: str) -> None:
        """Cycles, keys json cannot carry, clashing keys and unrepresentable instants fail."""

        def key(value: object) -> str:
            return template_key("k:{a}", a=value) if form == "template" else digest(a=value)

        cyclic: list[object] = []
        cyclic.append(cyclic)
        with pytest.raises(LeaseConfigError, match="contains itself"):
            key(cyclic)
        with pytest.raises(LeaseConfigError, match=r"argument 'a'.*key.*tuple"):
            key({(1, 2): "x"})
        with pytest.raises(LeaseConfigError, match="both"):
            key({1: "x", "1": "y"})
        with pytest.raises(LeaseConfigError, match="UTC"):
            key(datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=5))))
        with pytest.raises(LeaseConfigError, match="offset with microseconds"):
            key(time(0, tzinfo=timezone(timedelta(microseconds=1))))  # json would drop it

    @pytest.mark.parametrize("form", ["template", "digest"])
    def test_awkward_values_that_key(self, form: str) -> None:
        """Lone surrogates and ints too long for str() are keyed, not crashed on."""

        def key(value: object) -> str:
            return template_key("k:{a}", a=value) if form == "template" else digest(a=value)

        assert key("\ud800") != key("\ud801")
        assert key(10**5000) != key(10**5000 + 1)


class TestDigestEscaping:
    def test_user_dict_cannot_forge_a_type_tag(self) -> None:
        """A UUID and a dict ``{"$uuid": "..."}`` hash differently."""
        u = uuid.UUID("12345678-1234-5678-1234-567812345678")
        assert digest(a=u) != digest(a={"$uuid": str(u)})
        assert canonical_json({"a": {"$uuid": "x", "$$": 1}}) == '{"a":{"$$$":1,"$$uuid":"x"}}'

    def test_plain_arguments_keep_their_pinned_digest(self) -> None:
        """Arguments without tags or ``$`` keys are their plain JSON; the digest is pinned (a
        change would move every default key in the stores)."""
        assert make_key_function(None, SIG, task="app.t")((1,), {}) == (
            "app.t:6cc62b368cd6e2b51d86d6e0269a584d"
        )
        assert canonical_json(
            {"a": 1, "b": "x", "c": [1.5, None, True, {"k": "v"}], "d": "café"}
        ) == ('{"a":1,"b":"x","c":[1.5,null,true,{"k":"v"}],"d":"café"}')


# Pydantic models ------------------------------------------------------------------------------


class Order(pydantic.BaseModel):
    id: int
    placed: datetime = datetime(2024, 1, 1, tzinfo=timezone.utc)


class TestPydanticModels:
    def test_model_keys_as_its_json_dump(self) -> None:
        """A model is keyed as ``model_dump(mode="json")``: the form Celery's json delivers."""
        model = Order(id=1)
        dumped = model.model_dump(mode="json")
        assert digest(a=model) == digest(a=dumped)
        assert template_key("k:{a}", a=model) == template_key("k:{a}", a=dumped)
        assert template_key("k:{a.placed}", a=model) == template_key("k:{a.placed}", a=dumped)
        assert digest(a=Order(id=1)) != digest(a=Order(id=2))

    def test_model_default_of_a_pydantic_task_keys(self) -> None:
        """``pydantic=True`` with a model default: the default and the equal dict share a key."""
        from celery import Celery

        from celery_lease import LockedTask, MemoryLockStore

        app = Celery("t", broker="memory://", backend="cache+memory://", set_as_current=False)
        app.conf.lease_store = MemoryLockStore()
        app.conf.task_eager_propagates = True

        @app.task(base=LockedTask, pydantic=True, shared=False)
        def ship(order: Order = Order(id=1)) -> str:  # noqa: B008 - the case under test
            return str(ship.request.lock_key)

        try:
            by_default = ship.apply().get()
            explicit = ship.apply(kwargs={"order": Order(id=1).model_dump(mode="json")}).get()
            assert by_default == explicit
            assert ship.apply(kwargs={"order": {"id": 2}}).get() != by_default
        finally:
            app.close()


# Distinct values never share a key; equal values share one after every installed serializer ---
#
# The template encoding is decoded back by an independent decoder (decodable means injective), and
# values cross every serializer kombu has installed (json, pickle, yaml, msgpack).


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

        Keyed as its exact instant, the aware datetime would arrive through json a microsecond
        away: another key for the same call.
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


# Unkeyable values, long arguments and template lookups -------------------------------------------
#
# A value that cannot be keyed is a LeaseConfigError at call time, never another exception; a key
# stays within what every store accepts (PostgreSQL's btree index rows: about 2.7 kB).


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

    A 3 kB string written out in ``"doc:{text}"`` would make a 3 kB key, and the PostgreSQL store
    would fail every acquire with ``index row size 4016 exceeds btree version 4 maximum 2704``
    (``StoreUnavailableError``): a task that works for short arguments would fail for long ones.
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

        Read from ``kw``, ``f(1, a=5)`` and ``f(2, a=5)`` would both key as ``k:5``: two holders.
        """

        def f(a: int, /, **kw: int) -> None: ...

        made = make_key_function("k:{a}", inspect.signature(f), task="t")
        assert made((1,), {"a": 5}) == "k:1"
        assert made((1,), {"a": 5}) != made((2,), {"a": 5})
        assert made((1,), {}) == "k:1"

    def test_digit_attribute_reads_an_int_key_as_json_would_deliver_it(self) -> None:
        """``{a.1}`` reads ``{1: x}`` as it reads ``{"1": x}`` (what json delivers for it).

        The direct call must key as the json delivery does, not fail with KeyError '1'.
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
