"""Lock keys from templates, callables and the digest of bound arguments."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import subprocess
import sys
import uuid
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal

import pydantic
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


# Issue 8, item 9: keys must neither collide nor split ---------------------------------------


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
    """An object whose ``str()`` is its address: a new key on every call before the fix."""


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


# Issue 8, item 16: pydantic models ---------------------------------------------------------


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
