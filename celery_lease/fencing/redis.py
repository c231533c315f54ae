"""Fenced ``SET`` and ``HSET`` for Redis: one Lua script compares the fence and writes, atomically.

A string key's fence lives in a companion key (default ``<name>:fence``), a hash's in one of its
fields (default ``"fence"``); neither ever gets an expiry (an expired fence would let a stale
holder write). On Redis Cluster a key and its fence key need one hash tag, else ``CROSSSLOT``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery_lease.errors import LeaseConfigError
from celery_lease.fencing import StaleTokenError, resolve_token

__all__ = ["FENCED_HSET_SCRIPT", "FENCED_SET_SCRIPT", "fenced_hset", "fenced_set"]

_NEWER = """
-- newer(a, b): a > b for decimal integer strings, exact at any size (Lua numbers are doubles).
local function newer(a, b)
  if #a ~= #b then return #a > #b end
  for i = 1, #a do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x > y end
  end
  return false
end
local function is_integer(s)
  return s == '0' or string.match(s, '^[1-9]%d*$') ~= nil
end
"""

FENCED_SET_SCRIPT = (
    """
-- KEYS[1]: the string key to write; KEYS[2]: its fence key.
-- ARGV[1]: the token (decimal); ARGV[2]: the value.
-- Returns {1, token} when written, {0, fence} when a newer fence (> token) refused it, both
-- as decimal strings; an error when the fence key holds something else than an integer.
"""
    + _NEWER
    + """
local fence = redis.call('GET', KEYS[2])
if fence then
  if not is_integer(fence) then
    return redis.error_reply('fence key ' .. KEYS[2] .. ' does not hold an integer: ' .. fence)
  end
  if newer(fence, ARGV[1]) then
    return {0, fence}
  end
end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[1])
return {1, ARGV[1]}
"""
)
"""``SET`` the value and the fence key if the fence allows the token."""

FENCED_HSET_SCRIPT = (
    """
-- KEYS[1]: the hash to write.
-- ARGV[1]: the token (decimal); ARGV[2]: the fence field; ARGV[3..]: field, value, field, ...
-- Returns {1, token} when written, {0, fence} when a newer fence (> token) refused it, both
-- as decimal strings; an error when the fence field holds something else than an integer.
"""
    + _NEWER
    + """
local fence = redis.call('HGET', KEYS[1], ARGV[2])
if fence then
  if not is_integer(fence) then
    return redis.error_reply('fence field ' .. ARGV[2] .. ' of ' .. KEYS[1]
      .. ' does not hold an integer: ' .. fence)
  end
  if newer(fence, ARGV[1]) then
    return {0, fence}
  end
end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[1], unpack(ARGV, 3))
return {1, ARGV[1]}
"""
)
"""``HSET`` the fields and the fence field if the fence allows the token."""

_Value = str | bytes | int | float


def fenced_set(
    client: Any,
    name: str,
    value: _Value,
    *,
    token: int | None = None,
    lock_key: str | None = None,
    fence_key: str | None = None,
) -> int:
    """``SET name value`` if no newer token wrote it; its fence key becomes the token.

    Args:
        client: a ``redis.Redis`` or ``redis.RedisCluster``.
        name: the key to write.
        value: what to write (``str``, ``bytes``, ``int`` or ``float``).
        token, lock_key: the fencing token and its lock key (default: the current lease's).
        fence_key: where the fence is kept (default ``f"{name}:fence"``).

    Returns:
        The token written as the fence.

    Raises:
        StaleTokenError: the fence is above ``token``: nothing was written.
        LeaseConfigError: a bad argument, or no token outside any lease.
        redis.RedisError: the server could not be reached or refused the script.
    """
    _check_name("name", name)
    _check_value("value", value)
    fence = f"{name}:fence" if fence_key is None else fence_key
    _check_name("fence_key", fence)
    if fence == name:
        raise LeaseConfigError(f"fence_key={fence_key!r} must differ from name={name!r}")
    fencing = resolve_token(token, lock_key)
    script = client.register_script(FENCED_SET_SCRIPT)
    reply = script(keys=[name, fence], args=[fencing.token, value])
    return _outcome(reply, fencing.key, fencing.token, f"redis key {name!r}")


def fenced_hset(
    client: Any,
    name: str,
    mapping: Mapping[str, _Value],
    *,
    token: int | None = None,
    lock_key: str | None = None,
    fence_field: str = "fence",
) -> int:
    """``HSET name`` the fields of ``mapping`` if no newer token wrote it; its fence field too.

    ``mapping``: fields and values to set (at least one; not the fence field);
    ``fence_field``: the hash field that keeps the fence (default ``"fence"``). Otherwise as
    :func:`fenced_set`, whose returns and raises it shares.
    """
    _check_name("name", name)
    _check_name("fence_field", fence_field)
    if not isinstance(mapping, Mapping) or not mapping:
        raise LeaseConfigError(f"mapping={mapping!r} must be a non-empty mapping of fields")
    if fence_field in mapping:
        raise LeaseConfigError(
            f"mapping sets the fence field {fence_field!r}: the helper sets it to the token"
        )
    args: list[_Value] = []
    for field, value in mapping.items():
        _check_name("a field of mapping", field)
        _check_value(f"mapping[{field!r}]", value)
        args += [field, value]
    fencing = resolve_token(token, lock_key)
    script = client.register_script(FENCED_HSET_SCRIPT)
    reply = script(keys=[name], args=[fencing.token, fence_field, *args])
    return _outcome(reply, fencing.key, fencing.token, f"redis hash {name!r}")


def _check_name(what: str, name: object) -> None:
    if not isinstance(name, str) or not name:
        raise LeaseConfigError(f"{what}={name!r} must be a non-empty string")


def _check_value(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (str, bytes, int, float)):
        raise LeaseConfigError(f"{what}={value!r} must be str, bytes, int or float")


def _outcome(reply: Any, key: str | None, token: int, resource: str) -> int:
    written, fence = int(reply[0]), int(reply[1])
    if written == 1:
        return token
    raise StaleTokenError(key, token, fence, resource)
