"""Fenced writes for the Django ORM (docs/fencing.md, "Django ORM"): one fenced
``QuerySet.update()``; the upsert creates a missing row in a savepoint and, when a racing writer
created it first, updates once more. ``where`` is the pk, a unique field or one unconditional
unique constraint.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

try:
    import django  # noqa: F401  (imported first only to name the extra when it is missing)
except ModuleNotFoundError as exc:
    if exc.name != "django":
        raise  # Django is installed, but a module it imports is not
    raise ModuleNotFoundError(
        "celery_lease.fencing.django needs Django, which is not installed:"
        " pip install 'celery-lease[django]'",
        name="django",
    ) from exc

from django.db import IntegrityError, OperationalError, models, router, transaction

from celery_lease.errors import LeaseConfigError
from celery_lease.fencing import FencingToken, MissingRowError, StaleTokenError, resolve_token

__all__ = ["fenced_update", "fenced_upsert"]


def fenced_update(
    model: type[models.Model],
    *,
    where: Mapping[str, Any],
    values: Mapping[str, Any],
    token: int | None = None,
    lock_key: str | None = None,
    fence: str = "fence",
    using: str | None = None,
) -> int:
    """Update the existing row ``where`` with ``values`` if no newer token wrote it; set its fence.

    Args:
        model: the model class.
        where: the row: its primary key (``{"pk": 1}`` or the field's name), or the fields of one
            unique constraint.
        values: the fields to set (not the fence, not the ``where`` fields).
        token, lock_key: the fencing token and its lock key (default: the current lease's).
        fence: the name of the integer fence field (default ``"fence"``).
        using: the database alias (default: the router's choice for writing ``model``).

    Returns:
        The token written as the row's fence.

    Raises:
        StaleTokenError: the row's fence is above ``token``: nothing was written.
        MissingRowError: no row ``where``: nothing was written.
        LeaseConfigError: a bad argument (unknown field, ``where`` not a unique key, no token).
    """
    plan = _Plan(model, where, values, fence, using)
    fencing = resolve_token(token, lock_key)
    if plan.update(fencing.token) == 1:
        return fencing.token
    current = plan.read_fence()
    if current is _MISSING:
        raise MissingRowError(plan.resource)
    raise StaleTokenError(fencing.key, fencing.token, current, plan.resource)


def fenced_upsert(
    model: type[models.Model],
    *,
    where: Mapping[str, Any],
    values: Mapping[str, Any],
    token: int | None = None,
    lock_key: str | None = None,
    fence: str = "fence",
    using: str | None = None,
) -> int:
    """Create the row ``where`` with ``values``, or update it if no newer token wrote it.

    Arguments as :func:`fenced_update`; ``values`` are also what a new row is created with.

    Returns:
        The token written as the row's fence.

    Raises:
        StaleTokenError: the row's fence is above ``token``: nothing was written.
        LeaseConfigError: a bad argument (unknown field, ``where`` not a unique key, no token).
        django.db.IntegrityError: the create broke a constraint other than the row's key; or,
            inside the caller's transaction under REPEATABLE READ or SERIALIZABLE, a racing
            writer created the row after its snapshot (retry that transaction). Outside a
            transaction it is retried once in a new one, where the fence decides.
        django.db.OperationalError: likewise for a serialization failure (SQLSTATE 40001);
            any other operational error as Django raises it.
    """
    plan = _Plan(model, where, values, fence, using)
    fencing = resolve_token(token, lock_key)
    if transaction.get_connection(plan.using).in_atomic_block:
        return _upsert(plan, fencing)
    try:
        return _upsert(plan, fencing)
    except (IntegrityError, OperationalError) as exc:
        if isinstance(exc, OperationalError) and not _serialization_failure(exc):
            raise
        # A racing writer's row was committed after our snapshot; a new one sees it.
        return _upsert(plan, fencing)


def _serialization_failure(exc: OperationalError) -> bool:
    """Whether the driver error has SQLSTATE 40001 (psycopg 3 ``sqlstate``, psycopg2 ``pgcode``)."""
    cause = exc.__cause__
    return "40001" in (getattr(cause, "sqlstate", None), getattr(cause, "pgcode", None))


def _upsert(plan: _Plan, fencing: FencingToken) -> int:
    """One transaction (a savepoint inside the caller's) of :func:`fenced_upsert`."""
    with transaction.atomic(using=plan.using):
        if plan.update(fencing.token) == 1:
            return fencing.token
        current = plan.read_fence()
        if current is _MISSING:
            try:
                with transaction.atomic(using=plan.using):  # a savepoint: undone alone
                    plan.create(fencing.token)
                return fencing.token
            except IntegrityError:
                if plan.read_fence() is _MISSING:
                    raise  # not the row's key: another constraint refused the values
            # a racing writer created it between our update and create: its fence decides
            if plan.update(fencing.token) == 1:
                return fencing.token
            current = plan.read_fence()
    raise StaleTokenError(
        fencing.key, fencing.token, None if current is _MISSING else current, plan.resource
    )


_MISSING: Any = object()


class _Plan:
    """A fenced write on ``model``, every name checked before anything is sent."""

    def __init__(
        self,
        model: type[models.Model],
        where: Mapping[str, Any],
        values: Mapping[str, Any],
        fence: str,
        using: str | None,
    ) -> None:
        if not (isinstance(model, type) and issubclass(model, models.Model)):
            raise LeaseConfigError(f"model={model!r} must be a Django model class")
        meta = model._meta
        fields = {f.name: f for f in meta.concrete_fields}
        fields.update({f.attname: f for f in meta.concrete_fields})
        if not isinstance(fence, str) or fence not in fields:
            raise LeaseConfigError(
                f"fence={fence!r} is not a field of {meta.label}: name its integer fence field"
                f" (one of {sorted(f.name for f in meta.concrete_fields)})"
            )
        _check_names(meta, fields, where, values)
        if not where:
            raise LeaseConfigError(f"where={dict(where)!r} must name the row (its primary key)")
        pk = meta.pk
        assert pk is not None

        def field_of(name: str) -> Any:
            return pk if name == "pk" else fields[name]

        fence_field = fields[fence]
        if not isinstance(fence_field, models.IntegerField):
            raise LeaseConfigError(
                f"fence={fence!r}: field {meta.label}.{fence_field.name} is a"
                f" {type(fence_field).__name__}, not an integer field: tokens must compare as"
                " numbers"
            )
        if fence_field in {field_of(k) for k in (*where, *values)}:
            raise LeaseConfigError(
                f"the fence field {fence!r} is set by the helper to the token: leave it out of"
                " where= and values="
            )
        both = sorted({field_of(k).name for k in where} & {field_of(k).name for k in values})
        if both:
            raise LeaseConfigError(
                f"values= sets {both}, which where= already names: leave them out"
            )
        nulls = sorted(str(k) for k, v in where.items() if v is None)
        if nulls:
            raise LeaseConfigError(
                f"where={dict(where)!r}: {nulls} is None, and NULL never names one row"
            )
        named = frozenset(field_of(k).name for k in where)
        keys = _unique_keys(model)
        if named not in keys:
            raise LeaseConfigError(
                f"where={dict(where)!r} must name exactly the primary key or one unique"
                f" constraint of {meta.label} (one of {sorted(sorted(k) for k in keys)}), so"
                " the write can only touch one row"
            )
        self.model = model
        self.where = dict(where)
        self.values = dict(values)
        self.fence = fence_field.name
        self.using = using or router.db_for_write(model)
        self.resource = f"{meta.db_table} " + " ".join(f"{k}={v!r}" for k, v in where.items())

    def _rows(self) -> models.QuerySet[Any]:
        rows: models.QuerySet[Any] = self.model._default_manager.using(self.using).filter(
            **self.where
        )
        return rows

    def update(self, token: int) -> int:
        """The fenced UPDATE; returns how many rows it matched (0 or 1)."""
        allows = models.Q(**{f"{self.fence}__isnull": True}) | models.Q(
            **{f"{self.fence}__lte": token}
        )
        count = self._rows().filter(allows).update(**self.values, **{self.fence: token})
        if count > 1:  # pragma: no cover - where= is checked to be a unique key
            raise RuntimeError(f"a fenced update matched {count} rows, expected at most 1")
        return int(count)

    def create(self, token: int) -> None:
        self.model._default_manager.using(self.using).create(
            **self.where, **self.values, **{self.fence: token}
        )

    def read_fence(self) -> Any:
        """The row's fence now (an int, ``None`` for NULL), or ``_MISSING`` when there is none."""
        found = list(self._rows().values_list(self.fence, flat=True)[:1])
        if not found:
            return _MISSING
        return None if found[0] is None else int(found[0])


def _check_names(
    meta: Any, fields: Mapping[str, Any], where: Mapping[str, Any], values: Mapping[str, Any]
) -> None:
    for name, given in (("where", where), ("values", values)):
        if not isinstance(given, Mapping):
            raise LeaseConfigError(f"{name}={given!r} must be a mapping of field names")
        unknown = sorted(str(k) for k in given if k != "pk" and k not in fields)
        if unknown:
            raise LeaseConfigError(
                f"{name}={dict(given)!r} names {unknown}, not fields of {meta.label}"
                f" (allowed: {sorted(f.name for f in meta.concrete_fields)})"
            )


def _unique_keys(model: type[models.Model]) -> set[frozenset[str]]:
    """Field-name sets that identify one row: pk, unique fields, unconditional constraints."""
    meta = model._meta
    keys: set[frozenset[str]] = set()
    for field in meta.concrete_fields:
        if field.primary_key or field.unique:
            keys.add(frozenset({field.name}))
    for together in meta.unique_together:
        keys.add(frozenset(together))
    for constraint in meta.constraints:
        if (
            isinstance(constraint, models.UniqueConstraint)
            and constraint.fields
            and constraint.condition is None
            and not constraint.expressions
        ):
            keys.add(frozenset(constraint.fields))
    return keys
