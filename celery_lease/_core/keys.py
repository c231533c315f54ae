"""Lock keys from a template, a callable, or a digest of the bound arguments.

Every argument is first mapped to one canonical value, so distinct values never share a key and
a value keeps its key through Celery's serializers; a template then encodes each field into
``FIELD_ALPHABET`` only, which makes the key injective. The full rule is in docs/internals.md
("Lock key encoding"). Core module: imports only the standard library.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import math
import re
import string
from collections.abc import Callable, Mapping
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from enum import Enum
from typing import Any
from uuid import UUID

from celery_lease.errors import LeaseConfigError

# ``key_function(args, kwargs) -> key``: builds the key of one execution from its arguments.
KeyFunction = Callable[[tuple[Any, ...], Mapping[str, Any]], str]
DIGEST_BYTES = 16  # Bytes of BLAKE2b digest in a default key (rendered as 32 hex characters).
# Longest template field written out; a longer one is ``~hash.<32 hex digits>`` of its text, so a
# key stays under PostgreSQL's primary-key limit (about 2.7 kB) whatever its arguments.
MAX_KEY_FIELD_CHARS = 200
_FORMATTER = string.Formatter()
_BIG_INT_BITS = 2000  # wider ints are keyed by hex digits: str() may hit the digit limit
# Every character an encoded template field can contain; a separator needs one outside it.
FIELD_ALPHABET = frozenset(string.ascii_letters + string.digits + "-._~%")
_PLAIN = re.compile(r"[A-Za-z0-9._-]*")
_NUMERIC = re.compile(r"-?[0-9]+")
_DECIMAL = re.compile(r"-?[1-9][0-9]*|0")  # str(n) of an int: a mapping's int key in json
_SAFE_BYTES = frozenset((string.ascii_letters + string.digits + "-._").encode("ascii"))
_KEYABLE = (
    "None, bool, int, float, str, bytes, list, tuple, dict with str or int keys, set, frozenset,"
    " UUID, datetime, date, time, timedelta, Decimal, Enum, dataclasses, pydantic models and"
    " objects with __json__"
)


class _Uncanonical(Exception):
    """A value that has no canonical form (internal): where it is and why."""

    def __init__(self, path: str, value: object, why: str | None = None) -> None:
        super().__init__(path, value, why)
        self.path = path
        self.value = value
        kind = type(value).__qualname__
        self.why = why or f"a value of type {kind} has no canonical form (keyable: {_KEYABLE})"


def _json_view(value: object, path: str) -> tuple[bool, object]:
    """``(True, what Celery's json path delivers for value)``, or ``(False, None)``."""
    cls = type(value)
    if isinstance(value, type):
        return False, None
    if callable(getattr(cls, "model_dump", None)) and hasattr(cls, "__pydantic_fields__"):
        try:
            return True, value.model_dump(mode="json")  # type: ignore[attr-defined]
        except Exception as exc:
            raise _Uncanonical(
                path, value, f"model_dump(mode='json') of this {cls.__qualname__} failed: {exc!r}"
            ) from None
    reducer = getattr(value, "__json__", None)
    if callable(reducer):
        try:
            return True, reducer()
        except Exception as exc:
            raise _Uncanonical(
                path, value, f"__json__() of this {cls.__qualname__} failed: {exc!r}"
            ) from None
    return False, None


def _decimal_text(value: Decimal) -> str:
    """``value`` without trailing zeros, exactly (``Decimal.normalize`` rounds to 28 digits)."""
    if not value.is_finite():
        return str(value)
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)
    kept = list(digits)
    while len(kept) > 1 and kept[-1] == 0:
        kept.pop()
        exponent += 1
    if kept == [0]:
        return "0"
    return str(Decimal((sign, tuple(kept), exponent)))


def _qualified(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


_SURROGATE = re.compile("[\ud800-\udfff]")


def _text(value: str) -> str:
    """``value`` as a plain str, a surrogate pair joined into its character (as json does)."""
    text = str.__str__(value)
    if _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")


def _escape_key(name: str) -> str:
    return "$" + name if name.startswith("$") else name


def _canon_mapping(value: Mapping[Any, Any], path: str, active: set[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    originals: dict[str, object] = {}
    for key, item in value.items():
        if isinstance(key, str):
            name = _text(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            number = int.__index__(key)
            if number.bit_length() > _BIG_INT_BITS:
                raise _Uncanonical(
                    path, value, f"this mapping has an int key of {number.bit_length()} bits"
                )
            name = str(number)
        else:
            raise _Uncanonical(
                path,
                value,
                f"this mapping has a key {key!r} of type {type(key).__qualname__}; json carries"
                " mapping keys as str (an int key as its digits), so only str and int keys can be"
                " keyed",
            )
        escaped = _escape_key(name)
        if escaped in out:
            raise _Uncanonical(
                path,
                value,
                f"this mapping has both {originals[escaped]!r} and {key!r} as keys, which json"
                " delivers as one",
            )
        originals[escaped] = key
        out[escaped] = _canon(item, f"{path}[{key!r}]", active)
    return out


def _canon(value: object, path: str, active: set[int]) -> Any:
    """``value`` as its canonical JSON data (see the module docstring); raises ``_Uncanonical``."""
    if value is None or value is True or value is False:
        return value
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, int):
        number = int.__index__(value)
        return number if number.bit_length() <= _BIG_INT_BITS else {"$int": format(number, "x")}
    if isinstance(value, float):
        real = float.__float__(value)
        if math.isnan(real):
            return {"$float": "nan"}
        if math.isinf(real):
            return {"$float": "inf" if real > 0 else "-inf"}
        return real + 0.0  # -0.0 becomes 0.0
    if id(value) in active:
        raise _Uncanonical(path, value, f"this {type(value).__qualname__} contains itself")
    active.add(id(value))
    try:
        return _canon_compound(value, path, active)
    finally:
        active.discard(id(value))


def _offset(value: datetime | time, path: str) -> timedelta | None:
    """``value.utcoffset()``; none with microseconds (kombu's json drops it in transit)."""
    offset = value.utcoffset()
    if offset is not None and offset.microseconds:
        raise _Uncanonical(
            path,
            value,
            f"{value!r} has a UTC offset with microseconds, which fromisoformat (and so kombu's"
            " json) does not keep (CPython 3.11)",
        )
    return offset


def _canon_compound(value: object, path: str, active: set[int]) -> Any:
    if isinstance(value, (list, tuple)):
        return [_canon(item, f"{path}[{i}]", active) for i, item in enumerate(value)]
    if isinstance(value, Mapping):
        return _canon_mapping(value, path, active)
    converted, view = _json_view(value, path)
    if converted:
        return _canon(view, path, active)
    if isinstance(value, (set, frozenset)):
        items = [_canon(item, f"{path} item {item!r}", active) for item in value]
        return {"$set": sorted(items, key=_dumps)}
    return _canon_tagged(value, path, active)


def _canon_datetime(value: datetime, path: str) -> dict[str, str]:
    if _offset(value, path) is not None:
        try:
            value = value.astimezone(timezone.utc)
        except OverflowError:
            raise _Uncanonical(
                path, value, f"{value!r} has no UTC time within years 1 to 9999"
            ) from None
    return {"$datetime": datetime.isoformat(value)}


def _canon_tagged(value: object, path: str, active: set[int]) -> dict[str, Any]:
    """``value`` as its tag object (``{"$uuid": ...}``); raises ``_Uncanonical``."""
    if isinstance(value, UUID):
        return {"$uuid": str(value)}
    if isinstance(value, datetime):
        return _canon_datetime(value, path)
    if isinstance(value, date):
        return {"$date": date.isoformat(value)}
    if isinstance(value, time):
        _offset(value, path)
        return {"$time": time.isoformat(value)}
    if isinstance(value, timedelta):
        return {"$timedelta": [value.days, value.seconds, value.microseconds]}
    if isinstance(value, Decimal):
        return {"$decimal": _decimal_text(value)}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": bytes(value).hex()}
    if isinstance(value, Enum) and value.name is not None:
        return {"$enum": f"{_qualified(type(value))}:{value.name}"}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.compare}
        return {"$dataclass": [_qualified(type(value)), _canon_mapping(fields, path, active)]}
    raise _Uncanonical(path, value)


def _dumps(data: object) -> str:
    return json.dumps(
        data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def _config_error(exc: _Uncanonical, task: str | None) -> LeaseConfigError:
    base = re.split(r"[\[ .]", exc.path, maxsplit=1)[0]
    of_task = f" of task {task!r}" if task else ""
    return LeaseConfigError(
        f"cannot build the lock key{of_task} from argument {exc.path!r}: {exc.why}; pass `key`"
        f' in the lock options: a template naming a part that can be keyed (such as "name:'
        f'{{{base}.id}}") or a callable returning a str'
    )


def _canonical_argument(value: object, path: str, task: str | None) -> Any:
    try:
        return _canon(value, path, set())
    except _Uncanonical as exc:
        raise _config_error(exc, task) from None
    except RecursionError:
        raise _config_error(_Uncanonical(path, value, "it is nested too deeply"), task) from None


def _canonical_arguments(arguments: Mapping[str, object], task: str | None) -> str:
    data = {
        _escape_key(name): _canonical_argument(value, name, task)
        for name, value in arguments.items()
    }
    return _dumps(data)


def canonical_json(arguments: Mapping[str, object]) -> str:
    """The canonical JSON of bound arguments: sorted keys, no spaces, tagged special types
    (``Decimal("1.50")`` is ``Decimal("1.5")``, a tuple a list; a user key ``$x`` is ``$$x``).

    Raises:
        LeaseConfigError: naming the argument whose value has no canonical form, and its type.
    """
    return _canonical_arguments(arguments, None)


def _digest(task: str, arguments: Mapping[str, object]) -> str:
    """``"<task>:<32 hex digits>"``: BLAKE2b of the canonical JSON of ``arguments``."""
    text = _canonical_arguments(arguments, task)
    digest = hashlib.blake2b(
        text.encode("utf-8", "surrogatepass"), digest_size=DIGEST_BYTES
    ).hexdigest()
    return f"{task}:{digest}"


def _pct_bytes(data: bytes) -> str:
    return "".join(chr(b) if b in _SAFE_BYTES else f"%{b:02X}" for b in data)


def _pct(text: str) -> str:
    """``text`` percent-encoded from UTF-8, keeping ASCII letters, digits and ``-._``."""
    if _PLAIN.fullmatch(text):
        return text
    return _pct_bytes(text.encode("utf-8", "surrogatepass"))


def _esc(text: str) -> str:
    """An encoded item made safe to join with ``.`` (``%`` and ``.`` escaped)."""
    return text.replace("%", "%25").replace(".", "%2E")


def _items(nodes: list[Any]) -> str:
    return "".join("." + _esc(_render(node)) for node in nodes)


def _render_tag(name: str, payload: Any) -> str:
    text = payload if isinstance(payload, str) else ""
    if name in ("float", "int", "uuid"):
        return f"~{name}.{text}"
    if name == "datetime":  # ISO basic format, fixed widths: removing - and : keeps it injective
        text, zulu = (text[:-6], "Z") if text.endswith("+00:00") else (text, "")
        return "~dt." + text.replace("-", "").replace(":", "") + zulu
    if name == "date":
        return "~date." + text.replace("-", "")
    if name == "time":
        return "~time." + _pct(text.replace(":", ""))
    if name == "timedelta":
        return "~td." + ".".join(str(part) for part in payload)
    if name == "decimal":
        return "~dec." + _pct(text)
    if name == "bytes":
        return "~bytes." + _pct_bytes(bytes.fromhex(text))
    if name == "set":
        return "~set" + _items(payload)
    if name == "enum":
        return "~enum." + _pct(text)
    if name == "dataclass":
        qualified, fields = payload
        return f"~dc.{_esc(_pct(qualified))}.{_esc(_render(fields))}"
    raise AssertionError(f"unknown tag {name!r}")  # pragma: no cover - _canon makes no other


def _render(node: Any) -> str:
    """The template encoding of a canonical value: only characters of ``FIELD_ALPHABET``."""
    if node is None:
        return "~none"
    if node is True:
        return "~true"
    if node is False:
        return "~false"
    if isinstance(node, int):
        return str(node)
    if isinstance(node, float):
        return "~float." + _pct(repr(node))
    if isinstance(node, str):
        return f"~str.{node}" if not node or _NUMERIC.fullmatch(node) else _pct(node)
    if isinstance(node, list):
        return "~list" + _items(node)
    if len(node) == 1:
        ((name, payload),) = node.items()
        if name.startswith("$") and not name.startswith("$$"):
            return _render_tag(name[1:], payload)
    pairs = (
        "."
        + _esc(_render(key[1:] if key.startswith("$") else key))
        + "."
        + _esc(_render(node[key]))
        for key in sorted(node)
    )
    return "~dict" + "".join(pairs)


_SIMPLE_INT = 10**18


def _simple_field(value: object) -> str | None:
    """``_field(_canon(value))`` for a small int or a short plain str; else ``None``."""
    kind = type(value)
    if kind is int:
        if -_SIMPLE_INT < value < _SIMPLE_INT:  # type: ignore[operator]
            return str(value)
        return None
    if kind is str:
        text: str = value  # type: ignore[assignment]
        if (
            text
            and len(text) <= MAX_KEY_FIELD_CHARS
            and _PLAIN.fullmatch(text)
            and not _NUMERIC.fullmatch(text)
        ):
            return text
    return None


def _field(node: Any) -> str:
    """One template field: :func:`_render` of ``node``, hashed when longer than the limit."""
    text = _render(node)
    if len(text) <= MAX_KEY_FIELD_CHARS:
        return text
    digest = hashlib.blake2b(text.encode("ascii"), digest_size=DIGEST_BYTES).hexdigest()
    return "~hash." + digest


@dataclasses.dataclass(frozen=True)
class _Field:
    """One ``{...}`` of a template: the text inside the braces, its parameter, its lookups."""

    text: str
    name: str
    lookups: tuple[tuple[bool, int | str], ...]  # (is_attribute, name or index)


_ATTRIBUTE = re.compile(r"\.([^.\[]+)")


def _split_field(field: str, template: str) -> tuple[str, tuple[tuple[bool, int | str], ...]]:
    """``"a.b[0]"`` -> ``("a", ((True, "b"), (False, 0)))``, as ``str.format`` reads it."""
    head = re.match(r"[^.\[]*", field)
    assert head is not None
    base, rest = head.group(), field[head.end() :]
    lookups: list[tuple[bool, int | str]] = []
    while rest:
        attribute = _ATTRIBUTE.match(rest)
        if attribute is not None:
            lookups.append((True, attribute[1]))
            rest = rest[attribute.end() :]
            continue
        end = rest.find("]")
        if not rest.startswith("[") or end < 2 or rest[end + 1 : end + 2] not in ("", ".", "["):
            raise LeaseConfigError(
                f"key={template!r} has a malformed field {{{field}}}: write {{name}},"
                " {name.attribute} or {name[item]}"
            )
        item = rest[1:end]
        lookups.append((False, int(item) if item.isascii() and item.isdigit() else item))
        rest = rest[end + 1 :]
    return base, tuple(lookups)


def _parse(template: str, task: str | None = None) -> list[str | _Field]:
    """The template as literal texts and fields, checked (see the module docstring)."""
    where = f"key={template!r}" + (f" of task {task!r}" if task else "")
    try:
        parsed = list(_FORMATTER.parse(template))
    except ValueError as exc:
        raise LeaseConfigError(f"{where} is not a valid format template: {exc}") from exc
    parts: list[str | _Field] = []
    previous: _Field | None = None
    for literal, field, spec, conversion in parsed:
        if literal:
            parts.append(literal)
        if field is None:
            continue
        if conversion is not None or spec:
            written = (
                field + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            )
            raise LeaseConfigError(
                f"{where} writes {{{written}}}: a key field takes no conversion or format spec,"
                f" because every value is encoded canonically (see celery_lease._core.keys); write"
                f" {{{field}}}"
            )
        base, lookups = _split_field(field, template)
        if not base or base.isdigit():
            raise LeaseConfigError(
                f"{where} has a positional field {{{field}}}: name the task's parameter,"
                ' as in "account:{account_id}"'
            )
        current = _Field(field, base, lookups)
        if previous is not None and not (set(literal) - FIELD_ALPHABET):
            raise LeaseConfigError(
                f"{where}: fields {{{previous.text}}} and {{{current.text}}} are separated by"
                f" {literal!r}, and a field's value can contain every character of that, so two"
                " different pairs of values could make one key; separate them with a character"
                " other than letters, digits and -._~% (such as ':' or '/')"
            )
        parts.append(current)
        previous = current
    return parts


def template_fields(template: str) -> list[str]:
    """The parameter names a key template refers to, in order (``"{a.b}"`` gives ``"a"``).

    Raises:
        LeaseConfigError: malformed, positional (``{}``, ``{0}``), a conversion or format spec
            (``{a!r}``), or two fields without a separator no value contains (``{a}-{b}``).
    """
    return [part.name for part in _parse(template) if isinstance(part, _Field)]


def validate_template(template: str, signature: inspect.Signature, *, task: str) -> None:
    """Check ``template`` (as :func:`template_fields` does) and that its fields are parameters
    of ``signature`` (the body as called, without ``self``) of task ``task``.

    Raises:
        LeaseConfigError: naming the template, the bad field and the task's parameters.
    """
    params = signature.parameters
    has_var_keyword = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for part in _parse(template, task):
        if not isinstance(part, _Field):
            continue
        name = part.name
        if name in params and params[name].kind is not params[name].VAR_KEYWORD:
            continue
        if has_var_keyword:
            continue  # may come in through **kwargs; checked when the key is built
        known = ", ".join(params) or "none"
        raise LeaseConfigError(
            f"key={template!r} of task {task!r} refers to {{{name}}}, which is not a parameter"
            f" of the task; its parameters are: {known}"
        )


_NATIVE = (str, int, float, list, tuple, Mapping)


def _look_up(value: object, is_attribute: bool, name: int | str, path: str) -> object:
    if value is not None and not isinstance(value, _NATIVE):
        converted, view = _json_view(value, path)
        if converted:
            value = view  # a model is read as the dict it arrives as over json
    if isinstance(value, Mapping):
        twin: int | str | None = str(name) if isinstance(name, int) else None
        if isinstance(name, str) and _DECIMAL.fullmatch(name):
            twin = int(name)  # {a.1} and {a[1]} read {1: x} as json delivers it, {"1": x}
        names = (name,) if twin is None else (name, twin)
        found = [value[k] for k in names if k in value]
        if not found:
            raise KeyError(name)
        if len(found) == 2 and _canon(found[0], path, set()) != _canon(found[1], path, set()):
            raise KeyError(f"both {name!r} and {twin!r}")
        return found[0]
    if is_attribute:
        assert isinstance(name, str)
        return getattr(value, name)
    return value[name]  # type: ignore[index]


def _bind(signature: inspect.Signature, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


_Arguments = Callable[[tuple[Any, ...], Mapping[str, Any]], dict[str, Any]]


def _fit(
    names: tuple[str, ...],
    defaults: tuple[Any, ...],
    positional: int,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> dict[str, Any] | None:
    """The bound arguments of a call that simply fits ordinary parameters, else ``None``."""
    given = len(args)
    if given > positional:
        return None
    values: dict[str, Any] = {}
    used = 0
    for index, name in enumerate(names):
        if index < given:
            if name in kwargs:
                return None  # given twice
            values[name] = args[index]
        elif name in kwargs:
            values[name] = kwargs[name]
            used += 1
        elif defaults[index] is not inspect.Parameter.empty:
            values[name] = defaults[index]
        else:
            return None  # missing
    return values if used == len(kwargs) else None  # else: an unknown name


def _binder(signature: inspect.Signature) -> _Arguments:
    """``arguments(args, kwargs)``: ``Signature.bind`` + ``apply_defaults()``, faster."""

    def slow(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        return dict(_bind(signature, args, kwargs).arguments)

    params = list(signature.parameters.values())
    ordinary = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if any(p.kind not in ordinary for p in params):
        return slow
    positional = sum(1 for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = tuple(p.name for p in params)
    defaults = tuple(p.default for p in params)

    def general(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        values = _fit(names, defaults, positional, args, kwargs)
        return slow(args, kwargs) if values is None else values

    if positional == len(params) and all(d is inspect.Parameter.empty for d in defaults):

        def exact(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
            if not kwargs and len(args) == positional:
                return dict(zip(names, args, strict=True))  # the usual call: all by position
            return general(args, kwargs)

        return exact
    return general


def _template_function(
    template: str, parts: list[str | _Field], signature: inspect.Signature, task: str
) -> KeyFunction:
    var_keyword = next(
        (p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None
    )

    def field_value(part: _Field, values: Mapping[str, Any]) -> str:
        try:
            value = values[part.name]
        except KeyError:
            raise LeaseConfigError(
                f"key={template!r} of task {task!r} refers to {{{part.name}}}, which this"
                f" call does not pass; arguments given: {', '.join(values) or 'none'}"
            ) from None
        if not part.lookups:
            simple = _simple_field(value)
            if simple is not None:
                return simple
        path = part.name
        try:
            for is_attribute, name in part.lookups:
                path += f".{name}" if is_attribute else f"[{name!r}]"
                value = _look_up(value, is_attribute, name, path)
        except _Uncanonical as exc:
            raise _config_error(exc, task) from None
        except (LookupError, AttributeError, TypeError) as exc:
            raise LeaseConfigError(
                f"key={template!r} of task {task!r}: cannot read {{{part.text}}} from argument"
                f" {part.name!r} ({type(values[part.name]).__qualname__}): {exc!r}"
            ) from None
        canonical = _canonical_argument(value, path, task)
        try:
            return _field(canonical)
        except RecursionError:
            why = "it is nested too deeply"
            raise _config_error(_Uncanonical(path, value, why), task) from None

    arguments = _binder(signature)

    def by_template(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        values = arguments(args, kwargs)
        if var_keyword is not None:
            for name, value in values.pop(var_keyword, {}).items():
                values.setdefault(name, value)  # a positional-only parameter keeps its value
        return "".join(
            part if isinstance(part, str) else field_value(part, values) for part in parts
        )

    return _by_position(parts, signature, by_template) or by_template


def _by_position(
    parts: list[str | _Field], signature: inspect.Signature, by_template: KeyFunction
) -> KeyFunction | None:
    """``by_template`` for a template of bare parameter names (no lookups) of a signature of
    parameters without defaults, all positional-or-keyword: a call passing each argument by
    position, each a small int or a short plain str (:func:`_simple_field`), is keyed without
    binding; any other call is ``by_template``'s. None for other templates."""
    params = list(signature.parameters.values())
    if any(p.kind is not p.POSITIONAL_OR_KEYWORD or p.default is not p.empty for p in params):
        return None
    position = {p.name: index for index, p in enumerate(params)}
    plan: list[str | int] = []  # a literal text, or the position of a field's argument
    for part in parts:
        if isinstance(part, str):
            plan.append(part)
        elif part.lookups or part.name not in position:
            return None
        else:
            plan.append(position[part.name])
    count = len(params)
    low, high = -_SIMPLE_INT, _SIMPLE_INT
    if len(plan) == 2 and isinstance(plan[0], str) and isinstance(plan[1], int):
        prefix, at = plan[0], plan[1]

        def by_prefixed_argument(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
            if not kwargs and len(args) == count:
                value = args[at]
                if type(value) is int and low < value < high:
                    return prefix + str(value)
                text = _simple_field(value)
                if text is not None:
                    return prefix + text
            return by_template(args, kwargs)

        return by_prefixed_argument

    def by_arguments(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        if not kwargs and len(args) == count:
            texts: list[str] = []
            for step in plan:
                if type(step) is str:
                    texts.append(step)
                    continue
                text = _simple_field(args[step])  # type: ignore[index]
                if text is None:
                    return by_template(args, kwargs)
                texts.append(text)
            return "".join(texts)
        return by_template(args, kwargs)

    return by_arguments


def make_key_function(
    key: str | Callable[..., str] | None, signature: inspect.Signature, *, task: str
) -> KeyFunction:
    """Build the function that turns one execution's ``(args, kwargs)`` into its lock key.

    Args:
        key: a template, a callable called as the task is (``fn(*args, **kwargs)``) returning
            a str, or ``None`` for the default ``"<task>:<digest of bound arguments>"``.
        signature: the signature of the task's body as it is called (without ``self``).
        task: the task's name (used in the default key and in error messages).

    The returned function raises ``TypeError`` for arguments that do not fit (as the call
    would) and :class:`LeaseConfigError` for a value without a canonical form, a failed
    lookup, or a callable not returning a non-empty str.

    Raises:
        LeaseConfigError: ``key`` is neither a str, a callable nor ``None``, or a template is
            malformed or refers to an unknown parameter.
    """
    if key is None:
        arguments = _binder(signature)

        def by_digest(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
            return _digest(task, arguments(args, kwargs))

        return by_digest

    if isinstance(key, str):
        if not key:
            raise LeaseConfigError(f"key={key!r} of task {task!r} must be a non-empty string")
        validate_template(key, signature, task=task)
        parts = _parse(key, task)
        if not any(isinstance(part, _Field) for part in parts):
            constant = "".join(part for part in parts if isinstance(part, str))

            def fixed(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
                return constant

            return fixed
        return _template_function(key, parts, signature, task)

    if callable(key):
        func = key

        def by_callable(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
            result = func(*args, **kwargs)
            if not isinstance(result, str) or not result:
                raise LeaseConfigError(
                    f"key={func!r} of task {task!r} returned {result!r}"
                    f" ({type(result).__name__}); a key function must return a non-empty str"
                )
            return result

        return by_callable

    raise LeaseConfigError(
        f"key={key!r} ({type(key).__name__}) of task {task!r} is not allowed: use a template"
        ' str such as "account:{account_id}", a callable returning a str, or None'
    )
