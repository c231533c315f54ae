"""Fenced writes for SQLAlchemy 2, Core and ORM (docs/fencing.md): :func:`fenced_update` on any
database, :func:`fenced_upsert` as one ``INSERT ... ON CONFLICT DO UPDATE ... WHERE fence <=
token`` (PostgreSQL, SQLite 3.24+). ``where`` is the primary key or one unique constraint.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

try:
    import sqlalchemy  # noqa: F401  (imported first only to name the extra when it is missing)
except ModuleNotFoundError as exc:
    if exc.name != "sqlalchemy":
        raise  # SQLAlchemy is installed, but a module it imports is not
    raise ModuleNotFoundError(
        "celery_lease.fencing.sqlalchemy needs SQLAlchemy 2, which is not installed:"
        " pip install 'celery-lease[sqlalchemy]'",
        name="sqlalchemy",
    ) from exc

from sqlalchemy import (
    Column,
    Connection,
    Engine,
    Integer,
    Table,
    UniqueConstraint,
    inspect,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Mapper, Session, scoped_session
from sqlalchemy.sql import ColumnElement

from celery_lease.errors import LeaseConfigError
from celery_lease.fencing import MissingRowError, StaleTokenError, resolve_token

__all__ = ["fenced_update", "fenced_upsert"]

Bind = Connection | Session | scoped_session[Any] | Engine
"""Where the write runs: a Connection or Session (its transaction), or an Engine (its own)."""

_INSERTS: dict[str, Callable[[Table], postgresql.Insert | sqlite.Insert]] = {
    "postgresql": postgresql.insert,
    "sqlite": sqlite.insert,
}


@dataclass(frozen=True)
class _Plan:
    """A fenced write, validated: the table, the columns given (as Column objects), the mapper."""

    table: Table
    where: tuple[tuple[Column[Any], Any], ...]  # the row's key columns and their values
    values: tuple[tuple[Column[Any], Any], ...]
    fence: Column[Any]
    mapper: Mapper[Any] | None
    resource: str


def fenced_update(
    bind: Bind,
    target: Table | type[Any],
    *,
    where: Mapping[str, Any],
    values: Mapping[str, Any],
    token: int | None = None,
    lock_key: str | None = None,
    fence: str = "fence",
) -> int:
    """Update the existing row ``where`` with ``values`` if no newer token wrote it; set its fence.

    Args:
        bind: a ``Connection`` or ``Session`` (the write joins its transaction; nothing is
            committed) or an ``Engine`` (a transaction of its own).
        target: the ``Table`` (names are its column keys), or a mapped class (attribute names).
        where: the row: the values of its primary key, or of one unique constraint's columns.
        values: the columns to set (not the fence, not the ``where`` columns).
        token, lock_key: the fencing token and its lock key (default: the current lease's).
        fence: the name of the integer fence column (default ``"fence"``).

    Returns:
        The token written as the row's fence.

    Raises:
        StaleTokenError: the row's fence is above ``token``: nothing was written.
        MissingRowError: no row ``where``: nothing was written.
        LeaseConfigError: a bad argument (unknown column, ``where`` not a unique key, no token).
    """
    _check_bind(bind)
    plan = _plan(target, where, values, fence)
    fencing = resolve_token(token, lock_key)
    fence_col = plan.fence
    stmt = (
        update(plan.table)
        .where(*_matches(plan), _fence_allows(fence_col, fencing.token))
        .values({**dict(plan.values), fence_col: fencing.token})
        .execution_options(preserve_rowcount=True)
    )

    def write(conn: Connection | Session | scoped_session[Any]) -> int:
        written = _rowcount(conn.execute(stmt))
        if written == 1:
            _expire(conn, plan)
            return fencing.token
        current = _read_fence(conn, plan)
        if current is _MISSING:
            raise MissingRowError(plan.resource)
        raise StaleTokenError(fencing.key, fencing.token, current, plan.resource)

    return _run(bind, write)


def fenced_upsert(
    bind: Bind,
    target: Table | type[Any],
    *,
    where: Mapping[str, Any],
    values: Mapping[str, Any],
    token: int | None = None,
    lock_key: str | None = None,
    fence: str = "fence",
) -> int:
    """Create the row ``where`` with ``values``, or update it if no newer token wrote it.

    One statement: racing writers never fail on the unique key and the highest token wins.
    Arguments as :func:`fenced_update`; ``values`` holds every column the insert needs.

    Returns:
        The token written as the row's fence.

    Raises:
        StaleTokenError: the row's fence is above ``token``: nothing was written.
        LeaseConfigError: a bad argument, or a database other than PostgreSQL and SQLite (use
            :func:`fenced_update` there, on a row created beforehand).
    """
    _check_bind(bind)
    plan = _plan(target, where, values, fence)
    fencing = resolve_token(token, lock_key)
    table, fence_col = plan.table, plan.fence

    def write(conn: Connection | Session | scoped_session[Any]) -> int:
        dialect = _dialect(conn, plan)
        row = {**dict(plan.where), **dict(plan.values), fence_col: fencing.token}
        targets = [col for col, _ in plan.where]
        updated = [*(col for col, _ in plan.values), fence_col]
        if dialect not in _INSERTS:
            raise LeaseConfigError(
                f"fenced_upsert() supports PostgreSQL and SQLite, not {dialect!r}: create the row"
                " first and use fenced_update()"
            )
        insert = _INSERTS[dialect](table).values(row)
        stmt = insert.on_conflict_do_update(
            index_elements=targets,
            set_={col: insert.excluded[col.key] for col in updated},
            where=_fence_allows(fence_col, insert.excluded[fence_col.key]),
        )
        written = _rowcount(conn.execute(stmt.execution_options(preserve_rowcount=True)))
        if written == 1:
            _expire(conn, plan)
            return fencing.token
        current = _read_fence(conn, plan)
        raise StaleTokenError(
            fencing.key, fencing.token, None if current is _MISSING else current, plan.resource
        )

    return _run(bind, write)


def _check_bind(bind: object) -> None:
    if not isinstance(bind, (Engine, Connection, Session, scoped_session)):
        raise LeaseConfigError(
            f"bind={bind!r} must be a sqlalchemy Connection, Session, scoped_session or Engine"
        )


def _plan(
    target: Table | type[Any], where: Mapping[str, Any], values: Mapping[str, Any], fence: str
) -> _Plan:
    mapper: Mapper[Any] | None = None
    if isinstance(target, Table):
        table = target
        columns: Mapping[str, Column[Any]] = {c.key: c for c in table.columns}
    else:
        found = inspect(target, raiseerr=False) if isinstance(target, type) else None
        if not isinstance(found, Mapper) or not isinstance(found.local_table, Table):
            raise LeaseConfigError(
                f"target={target!r} must be a sqlalchemy Table or a mapped class"
            )
        mapper, table = found, found.local_table
        columns = {
            attr: col
            for attr, col in found.columns.items()
            if isinstance(col, Column) and col.table is table
        }
    if not isinstance(fence, str) or fence not in columns:
        raise LeaseConfigError(
            f"fence={fence!r} is not a column of {table.name}: name its integer fence column"
            f" (one of {sorted(columns)})"
        )
    fence_col = columns[fence]
    if not isinstance(fence_col.type, Integer):
        raise LeaseConfigError(
            f"fence={fence!r}: column {table.name}.{fence_col.name} is {fence_col.type}, not an"
            " integer type: tokens must compare as numbers"
        )
    _check_names(table, columns, where, values)
    if not where:
        raise LeaseConfigError(f"where={dict(where)!r} must name the row (its primary key)")
    if fence in where or fence in values:
        raise LeaseConfigError(
            f"the fence column {fence!r} is set by the helper to the token: leave it out of"
            " where= and values="
        )
    both = sorted(set(where) & set(values))
    if both:
        raise LeaseConfigError(f"values= sets {both}, which where= already names: leave them out")
    nulls = sorted(k for k, v in where.items() if v is None)
    if nulls:
        raise LeaseConfigError(
            f"where={dict(where)!r}: {nulls} is None, and NULL never names one row"
        )
    where_names = frozenset(columns[k].name for k in where)
    keys = _unique_keys(table)
    if where_names not in keys:
        raise LeaseConfigError(
            f"where={dict(where)!r} must name exactly the primary key or one unique constraint"
            f" of {table.name} (columns {sorted(sorted(k) for k in keys)}), so the write can"
            " only touch one row"
        )
    return _Plan(
        table=table,
        where=tuple((columns[k], v) for k, v in where.items()),
        values=tuple((columns[k], v) for k, v in values.items()),
        fence=fence_col,
        mapper=mapper,
        resource=f"{table.name} " + " ".join(f"{k}={v!r}" for k, v in where.items()),
    )


def _check_names(
    table: Table,
    columns: Mapping[str, Column[Any]],
    where: Mapping[str, Any],
    values: Mapping[str, Any],
) -> None:
    for name, given in (("where", where), ("values", values)):
        if not isinstance(given, Mapping):
            raise LeaseConfigError(f"{name}={given!r} must be a mapping of column names to values")
        unknown = sorted(str(k) for k in given if k not in columns)
        if unknown:
            raise LeaseConfigError(
                f"{name}={dict(given)!r} names {unknown}, not columns of {table.name}"
                f" (allowed: {sorted(columns)})"
            )


def _unique_keys(table: Table) -> set[frozenset[str]]:
    """Column-name sets that identify one row (primary key, unique constraints, full indexes)."""
    keys = {frozenset(c.name for c in table.primary_key.columns)}
    for constraint in table.constraints:
        if isinstance(constraint, UniqueConstraint):
            keys.add(frozenset(c.name for c in constraint.columns))
    for index in table.indexes:
        partial = any(
            name.endswith("_where") and value is not None
            for name, value in index.dialect_kwargs.items()
        )
        if index.unique and not partial and all(isinstance(e, Column) for e in index.expressions):
            keys.add(frozenset(c.name for c in index.columns))
    for column in table.columns:
        if column.unique:
            keys.add(frozenset({column.name}))
    keys.discard(frozenset())
    return keys


def _matches(plan: _Plan) -> list[ColumnElement[bool]]:
    return [col == value for col, value in plan.where]


def _fence_allows(fence: Column[Any], token: Any) -> ColumnElement[bool]:
    """The stored fence is NULL or not above ``token`` (a value, or ``excluded.fence``)."""
    return or_(fence.is_(None), fence <= token)


_MISSING: Any = object()


def _run(bind: Bind, write: Any) -> int:
    if isinstance(bind, Engine):
        with bind.begin() as conn:
            return int(write(conn))
    return int(write(bind))


def _rowcount(result: Any) -> int:
    count = getattr(result, "rowcount", None)
    if not isinstance(count, int) or count < 0:
        raise RuntimeError(
            f"the database driver did not report how many rows the fenced write matched"
            f" (rowcount={count!r}): the fence cannot be checked"
        )
    if count > 1:
        raise RuntimeError(f"a fenced write matched {count} rows, expected at most 1")
    return count


def _read_fence(conn: Connection | Session | scoped_session[Any], plan: _Plan) -> Any:
    """The row's fence now (an int, ``None`` for NULL), or ``_MISSING`` when there is no row."""
    row = conn.execute(select(plan.fence).where(*_matches(plan))).first()
    if row is None:
        return _MISSING
    return None if row[0] is None else int(row[0])


def _dialect(conn: Connection | Session | scoped_session[Any], plan: _Plan) -> str:
    if isinstance(conn, Connection):
        return str(conn.dialect.name)
    bound = conn.get_bind(mapper=plan.mapper) if plan.mapper is not None else conn.get_bind()
    return str(bound.dialect.name)


def _expire(conn: Connection | Session | scoped_session[Any], plan: _Plan) -> None:
    """Expire the ORM instance of the written row, if the session holds one (it is stale)."""
    if plan.mapper is None or isinstance(conn, Connection):
        return
    mapper = plan.mapper
    given = {col.name: value for col, value in plan.where}
    pk_names = [c.name for c in mapper.primary_key]
    if set(pk_names) == set(given):
        identity = mapper.identity_key_from_primary_key(tuple(given[n] for n in pk_names))
        obj = conn.identity_map.get(identity)
        if obj is not None:
            conn.expire(obj)
        return
    attrs = {mapper.get_property_by_column(col).key: value for col, value in plan.where}
    for obj in list(conn.identity_map.values()):  # a unique key: match its loaded values
        if isinstance(obj, mapper.class_):
            loaded = inspect(obj).dict
            if all(loaded.get(attr, _MISSING) == value for attr, value in attrs.items()):
                conn.expire(obj)
