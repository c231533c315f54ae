"""Redis Sentinel: the ``redis+sentinel://`` URL form, finding the master, following a failover.

Both Redis stores build their clients here (:func:`client_from_url`); a Sentinel-managed store
asks which server is the master before every acquire and renewal (:func:`follow_master`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import redis.sentinel
from redis.backoff import NoBackoff

from celery_lease.durations import to_seconds
from celery_lease.errors import LeaseConfigError
from celery_lease.stores._redis_common import (
    RETRIED,
    SOCKET_TIMEOUT,
    STORE_OPTIONS,
    check_restart_grace,
    describe_server,
    host_port,
    split_store_options,
    text,
)
from celery_lease.stores.base import redact_url, secrets_among

logger = logging.getLogger("celery_lease.stores.redis")

GET_MASTER = "SENTINEL GET-MASTER-ADDR-BY-NAME"
"""The one question asked of a Sentinel: the ``(host, port)`` of a service's master now."""


@dataclass(frozen=True)
class SentinelURL:
    """The parts of a ``redis+sentinel://`` URL (see :func:`parse_sentinel_url`)."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None
    socket_timeout: float = SOCKET_TIMEOUT
    socket_connect_timeout: float = SOCKET_TIMEOUT
    min_replicas: int | None = None
    replica_timeout: float | None = None
    restart_grace: float | None = None


_SENTINEL_OPTIONS = (
    "sentinel_password",
    "socket_timeout",
    "socket_connect_timeout",
    "min_replicas",
    "replica_timeout",
    "restart_grace",
)


def parse_sentinel_url(url: str) -> SentinelURL:
    """Parse ``redis+sentinel://[[user]:password@]host1:26379[,host2:26379]/service[/db]``.

    The port defaults to 26379 (IPv6 hosts in brackets), ``db`` to 0; ``user`` and ``password``
    authenticate to the master. Query: ``sentinel_password`` (Sentinel's own ``requirepass``),
    ``socket_timeout`` / ``socket_connect_timeout`` (seconds, default 5), and the store's
    ``min_replicas`` (an integer), ``replica_timeout`` and ``restart_grace`` (durations such as
    ``0.2`` or ``250ms``; a grace of 0 turns it off). ``LeaseConfigError`` names what is wrong.
    """
    parts = urlsplit(url)
    if parts.scheme.lower() != "redis+sentinel":
        raise LeaseConfigError(f"url={url!r} is not a redis+sentinel:// URL")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    sentinels = tuple(_parse_host(url, item) for item in hostlist.split(","))
    path = [unquote(p) for p in parts.path.split("/")[1:]]
    if path and path[-1] == "":
        path.pop()
    if not path or not path[0] or len(path) > 2:
        raise LeaseConfigError(
            f"url={url!r} must name the Sentinel service as its path: "
            "redis+sentinel://host:26379/service_name[/db]"
        )
    db = 0
    if len(path) == 2:
        if not path[1].isdigit():
            raise LeaseConfigError(f"url={url!r}: db={path[1]!r} must be a non-negative integer")
        db = int(path[1])
    options = {
        name: _sentinel_option(url, name, value)
        for name, value in parse_qsl(parts.query, keep_blank_values=True)
    }
    return SentinelURL(sentinels, path[0], db, username, password, **options)


def _sentinel_option(url: str, name: str, value: str) -> Any:
    """The value of query option ``name``; ``LeaseConfigError`` if unknown or bad."""
    if name == "sentinel_password":
        return value
    if name == "min_replicas":
        if not value.isdigit():
            raise LeaseConfigError(
                f"url={url!r}: min_replicas={value!r} must be a non-negative integer"
            )
        return int(value)
    if name == "replica_timeout":
        return to_seconds(value, name="replica_timeout", minimum=0.001)
    if name == "restart_grace":
        return check_restart_grace(value)
    if name in ("socket_timeout", "socket_connect_timeout"):
        try:
            return float(value)
        except ValueError:
            raise LeaseConfigError(
                f"url={url!r}: {name}={value!r} must be a number of seconds"
            ) from None
    raise LeaseConfigError(
        f"url={url!r} has an unknown option {name!r}; supported: " + ", ".join(_SENTINEL_OPTIONS)
    )


def _parse_host(url: str, item: str) -> tuple[str, int]:
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else rest
    else:
        host, _, port_text = item.partition(":")
    if not host:
        raise LeaseConfigError(f"url={url!r} has an empty Sentinel host in {item!r}")
    if not port_text:
        return host, 26379
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise LeaseConfigError(f"url={url!r}: port {port_text!r} of {host!r} is not a port")
    return host, int(port_text)


def sentinel_connection_kwargs(spec: SentinelURL, retry: Any) -> dict[str, Any]:
    """The keywords of the connections to the Sentinels themselves (sync and async alike)."""
    kwargs: dict[str, Any] = {
        "socket_timeout": spec.socket_timeout,
        "socket_connect_timeout": spec.socket_connect_timeout,
        "retry": retry,
    }
    if spec.sentinel_password is not None:
        kwargs["password"] = spec.sentinel_password
    return kwargs


def describe_sentinel_master(
    sentinels: Iterable[Mapping[str, Any]],
    service: str,
    db: object,
    master: tuple[str, int] | None,
) -> str:
    """``redis+sentinel://s1:26379,s2:26379/service/db (master host:port)``, for messages."""
    hosts = ",".join(host_port(kwargs) for kwargs in sentinels)
    known = f"master {master[0]}:{master[1]}" if master else "master not known yet"
    return f"redis+sentinel://{hosts}/{service}/{db} ({known})"


def describe_pool(pool: Any, sentinel_pool: Any | None, ssl_class: type) -> str:
    """The address, for messages, of a client's connection ``pool`` (``sentinel_pool``: the
    same pool when it is a Sentinel-managed master's); never a password."""
    kwargs = pool.connection_kwargs
    if sentinel_pool is None:
        return describe_server(kwargs, ssl=issubclass(pool.connection_class, ssl_class))
    sentinels = sentinel_pool.sentinel_manager.sentinels
    return describe_sentinel_master(
        (s.connection_pool.connection_kwargs for s in sentinels),
        sentinel_pool.service_name,
        kwargs.get("db", 0),
        sentinel_pool.master_address,
    )


def pool_secrets(kwargs: Mapping[str, Any], sentinels: Iterable[Any] = ()) -> tuple[str, ...]:
    """Every password a client may send (its server's, its Sentinels'), kept out of messages."""
    found = [s.connection_pool.connection_kwargs.get("password") for s in sentinels]
    return secrets_among([kwargs.get("password"), *found])


def master_address(reply: Any) -> tuple[str, int] | None:
    """The ``(host, port)`` of a :data:`GET_MASTER` reply, None for an unknown service."""
    if not reply:
        return None
    return text(reply[0]), int(reply[1])


def no_master_message(service: str, problems: Iterable[str]) -> str:
    """The ``MasterNotFoundError`` message, with each Sentinel's reason."""
    return f"No master found for {service!r}: " + "; ".join(problems)


def ask_sentinels(manager: redis.sentinel.Sentinel, service: str) -> tuple[str, int]:
    """The ``(host, port)`` the first answering Sentinel names as master of ``service``;
    ``MasterNotFoundError`` (a ``ConnectionError``) when none does."""
    problems: list[str] = []
    for sentinel in list(manager.sentinels):
        try:
            reply = sentinel.execute_command(GET_MASTER, service)  # type: ignore[no-untyped-call]
        except RETRIED as exc:
            reply = exc
        address = master_of(sentinel, reply, problems)
        if address is not None:
            return address
    raise redis.sentinel.MasterNotFoundError(no_master_message(service, problems))


def master_of(sentinel: Any, reply: Any, problems: list[str]) -> tuple[str, int] | None:
    """The master address in ``reply`` (or the error asking raised), or None with the reason
    added to ``problems``."""
    where = host_port(sentinel.connection_pool.connection_kwargs)
    if isinstance(reply, Exception):
        problems.append(f"{where}: {reply}")
        return None
    address = master_address(reply)
    if address is None:
        problems.append(f"{where}: no such service")
    return address


class Sentinel(redis.sentinel.Sentinel):
    """A Sentinel manager that discovers the master with :data:`GET_MASTER`, as the store's
    check does, so the pool moves at the first check that sees a new master (redis-py's
    ``SENTINEL MASTERS`` lags: docs/stores.md, Sentinel)."""

    def discover_master(self, service_name: str) -> tuple[str, int]:
        return ask_sentinels(self, service_name)


def follow_master(
    pool: redis.sentinel.SentinelConnectionPool,
    on_silence: Callable[[Exception], None] | None,
) -> None:
    """Make sure ``pool`` talks to the master a Sentinel names now (one :data:`GET_MASTER`;
    on a change the pool re-discovers and drops its idle connections). No Sentinel answering
    and a master known: ``on_silence`` is called and that master kept (for stores whose writes
    WAIT for replicas, which still refuses a write a failover would lose); without
    ``on_silence`` the error is raised (nothing else tells a stale master from the current)."""
    known = pool.master_address
    try:
        address = ask_sentinels(pool.sentinel_manager, pool.service_name)
    except redis.sentinel.MasterNotFoundError as exc:
        if on_silence is None or known is None:
            raise
        on_silence(exc)
        return
    if address != known:
        pool.get_master_address()  # type: ignore[no-untyped-call]
        if known is not None and pool.master_address != known:
            log_master_change(address, pool.service_name, known)


def log_master_change(address: tuple[str, int], service: str, known: tuple[str, int]) -> None:
    """Say that Sentinel names another master of ``service`` than ``known``."""
    logger.warning(
        "Redis store: Sentinel names %s as master of %r instead of %s:%s; leaving the old master",
        host_port({"host": address[0], "port": address[1]}),
        service,
        known[0],
        known[1],
    )


def client_from_url(
    url: str, client_class: Any, sentinel_class: Any, retry_class: Any
) -> tuple[Any, Any, dict[str, object]]:
    """The client a store URL names (built with the sync or ``redis.asyncio`` classes, not yet
    connected), its Sentinel manager (or None) and the store's own URL options. Clients get 5 s
    socket timeouts unless the URL sets them, and no redis-py retries (the stores retry once).
    ``LeaseConfigError`` for a URL of another scheme or one redis-py refuses."""
    scheme = urlsplit(url).scheme.lower()
    options: dict[str, object]
    if scheme == "redis+sentinel":
        spec = parse_sentinel_url(url)
        sentinel = sentinel_class(
            list(spec.sentinels),
            sentinel_kwargs=sentinel_connection_kwargs(spec, retry_class(NoBackoff(), 0)),
            socket_timeout=spec.socket_timeout,
            socket_connect_timeout=spec.socket_connect_timeout,
            retry=retry_class(NoBackoff(), 0),
        )
        client = sentinel.master_for(
            spec.service_name,
            db=spec.db,
            username=spec.username,
            password=spec.password,
            decode_responses=False,
        )
        options = {
            name: getattr(spec, name) for name in STORE_OPTIONS if getattr(spec, name) is not None
        }
        return client, sentinel, options
    if scheme not in ("redis", "rediss", "unix"):
        raise LeaseConfigError(
            f"url={redact_url(url)!r} is not a Redis URL; supported: redis://, rediss://, "
            "unix://, redis+sentinel://"
        )
    plain, options = split_store_options(url)
    try:
        # Options in the URL's query win over these keyword arguments.
        client = client_class.from_url(
            plain,
            socket_timeout=SOCKET_TIMEOUT,
            socket_connect_timeout=SOCKET_TIMEOUT,
            decode_responses=False,
            retry=retry_class(NoBackoff(), 0),
        )
    except ValueError as exc:
        raise LeaseConfigError(f"url={redact_url(url)!r} is not a valid Redis URL: {exc}") from exc
    return client, None, options
