"""Lock keys from a template, a callable, or a digest of the bound arguments.

Three ways to say which executions exclude each other, all evaluated where the task runs:

- a template, ``"account:{account_id}"``: formatted with the task's arguments bound to its
  parameters by name (defaults applied, ``**kwargs`` entries usable by name);
- a callable, ``fn(*args, **kwargs) -> str``: called exactly as the task is;
- nothing: ``"<task name>:<digest>"``, the digest of the canonical JSON of every bound argument,
  the same across processes, argument order and positional/keyword spelling.

This module is part of the core: it imports only the standard library.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import string
from collections.abc import Callable, Mapping
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from enum import Enum
from typing import Any
from uuid import UUID

from celery_lease.errors import LeaseConfigError

__all__ = [
    "KeyFunction",
    "canonical_json",
    "digest_key",
    "make_key_function",
    "template_fields",
    "validate_template",
]

KeyFunction = Callable[[tuple[Any, ...], Mapping[str, Any]], str]
"""``key_function(args, kwargs) -> key``: builds the key of one execution from its arguments."""

DIGEST_BYTES = 16
"""Bytes of BLAKE2b digest in a default key (rendered as 32 hex characters)."""

_FORMATTER = string.Formatter()


class _Uncanonical(Exception):
    """An argument value that has no canonical JSON form (internal)."""

    def __init__(self, path: str, value: object) -> None:
        super().__init__(path, value)
        self.path = path
        self.value = value


def template_fields(template: str) -> list[str]:
    """The parameter names a key template refers to, in order (``"{a.b}"`` gives ``"a"``).

    Raises:
        LeaseConfigError: the template is malformed or uses positional fields (``{}``, ``{0}``).
    """
    try:
        parsed = list(_FORMATTER.parse(template))
    except ValueError as exc:
        raise LeaseConfigError(f"key={template!r} is not a valid format template: {exc}") from exc
    names: list[str] = []
    for _, field, _, _ in parsed:
        if field is None:
            continue
        base = field.split(".", 1)[0].split("[", 1)[0]
        if not base or base.isdigit():
            raise LeaseConfigError(
                f"key={template!r} has a positional field {{{field}}}: name the task's parameter,"
                ' as in "account:{account_id}"'
            )
        names.append(base)
    return names


def validate_template(template: str, signature: inspect.Signature, *, task: str) -> None:
    """Check that every field of ``template`` names a parameter of ``signature``.

    Args:
        template: the key template, e.g. ``"account:{account_id}"``.
        signature: the signature of the task's body as it is called (without ``self``).
        task: the task's name, for the error message.

    Raises:
        LeaseConfigError: naming the unknown field and the parameters the task has.
    """
    params = signature.parameters
    has_var_keyword = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for name in template_fields(template):
        if name in params and params[name].kind is not params[name].VAR_KEYWORD:
            continue
        if has_var_keyword:
            continue  # may come in through **kwargs; checked when the key is built
        known = ", ".join(params) or "none"
        raise LeaseConfigError(
            f"key={template!r} of task {task!r} refers to {{{name}}}, which is not a parameter"
            f" of the task; its parameters are: {known}"
        )


def _normalise(value: object, path: str) -> Any:
    """``value`` as plain JSON data with a stable form; raises ``_Uncanonical``."""
    if value is None or isinstance(value, (bool, int, str)):
        if isinstance(value, Enum):  # IntEnum, StrEnum: by class and name, not by value
            return {"$enum": f"{type(value).__qualname__}.{value.name}"}
        return value
    if isinstance(value, float):
        return value if value == value else {"$float": "nan"}
    if isinstance(value, Enum):
        return {"$enum": f"{type(value).__qualname__}.{value.name}"}
    if isinstance(value, (list, tuple)):
        return [_normalise(item, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value):
            return {k: _normalise(v, f"{path}[{k!r}]") for k, v in value.items()}
        pairs = [
            [_normalise(k, f"{path} key {k!r}"), _normalise(v, f"{path}[{k!r}]")]
            for k, v in value.items()
        ]
        return {"$map": sorted(pairs, key=_dumps)}
    if isinstance(value, (set, frozenset)):
        items = [_normalise(item, f"{path} item {item!r}") for item in value]
        return {"$set": sorted(items, key=_dumps)}
    if isinstance(value, UUID):
        return {"$uuid": str(value)}
    if isinstance(value, datetime):
        if value.tzinfo is not None and value.utcoffset() is not None:
            value = value.astimezone(timezone.utc)
        return {"$datetime": value.isoformat()}
    if isinstance(value, date):
        return {"$date": value.isoformat()}
    if isinstance(value, time):
        return {"$time": value.isoformat()}
    if isinstance(value, timedelta):
        return {"$timedelta": [value.days, value.seconds, value.microseconds]}
    if isinstance(value, Decimal):
        return {"$decimal": str(value.normalize()) if value.is_finite() else str(value)}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": bytes(value).hex()}
    raise _Uncanonical(path, value)


def _dumps(data: object) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_json(arguments: Mapping[str, object]) -> str:
    """The canonical JSON of bound arguments: sorted keys, no spaces, tagged special types.

    ``UUID``, ``datetime`` (aware ones in UTC), ``date``, ``time``, ``timedelta``, ``Decimal``
    (normalised: ``Decimal("1.50")`` and ``Decimal("1.5")`` agree), ``bytes``, sets, enums and
    mappings with non-string keys get a stable tagged form; tuples are lists.

    Raises:
        LeaseConfigError: naming the argument whose value has no canonical form.
    """
    try:
        data = {name: _normalise(value, name) for name, value in arguments.items()}
    except _Uncanonical as exc:
        raise LeaseConfigError(
            f"cannot build a lock key from argument {exc.path!r}: a value of type"
            f" {type(exc.value).__name__} has no canonical JSON form; pass `key` (a template"
            f' such as "name:{{{exc.path.split("[", 1)[0].split(" ", 1)[0]}}}" or a callable'
            " returning a str) to the task's lock options"
        ) from None
    return _dumps(data)


def digest_key(task_name: str, arguments: Mapping[str, object]) -> str:
    """``"<task name>:<32 hex digits>"``: BLAKE2b of :func:`canonical_json` of ``arguments``."""
    digest = hashlib.blake2b(
        canonical_json(arguments).encode("utf-8"), digest_size=DIGEST_BYTES
    ).hexdigest()
    return f"{task_name}:{digest}"


def _bind(signature: inspect.Signature, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def make_key_function(
    key: str | Callable[..., str] | None,
    signature: inspect.Signature,
    *,
    task: str,
) -> KeyFunction:
    """Build the function that turns one execution's ``(args, kwargs)`` into its lock key.

    Args:
        key: a template, a callable called as the task is (``fn(*args, **kwargs)``) returning
            a str, or ``None`` for the default ``"<task>:<digest of bound arguments>"``.
        signature: the signature of the task's body as it is called (without ``self``).
        task: the task's name (used in the default key and in error messages).

    Templates are validated against ``signature`` here, at definition time. The returned
    function raises ``TypeError`` when the arguments do not fit the signature (as the call
    itself would) and :class:`LeaseConfigError` for an argument the default key cannot
    canonicalise or a callable that does not return a non-empty str.

    Raises:
        LeaseConfigError: ``key`` is neither a str, a callable nor ``None``, or a template
            refers to an unknown parameter.
    """
    if key is None:

        def by_digest(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
            return digest_key(task, _bind(signature, args, kwargs).arguments)

        return by_digest

    if isinstance(key, str):
        if not key:
            raise LeaseConfigError(f"key={key!r} of task {task!r} must be a non-empty string")
        validate_template(key, signature, task=task)
        if not template_fields(key):
            constant = key

            def fixed(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
                return constant

            return fixed
        var_keyword = next(
            (p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None
        )

        def by_template(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
            values = dict(_bind(signature, args, kwargs).arguments)
            if var_keyword is not None:
                values.update(values.pop(var_keyword, {}))
            try:
                return _FORMATTER.vformat(key, (), values)
            except KeyError as exc:
                raise LeaseConfigError(
                    f"key={key!r} of task {task!r} refers to {{{exc.args[0]}}}, which this"
                    f" call does not pass; arguments given: {', '.join(values) or 'none'}"
                ) from None

        return by_template

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
