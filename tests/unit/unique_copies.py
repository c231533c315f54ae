"""Helpers for unique tests: define a task, publish a copy, deliver its message as a worker would.

A delivery is run as the worker's tracer runs it (a request pushed with ``called_directly=False``,
then the task called), and a competing call can be made at a chosen store operation.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from celery.app.task import Context

from celery_lease import LockedTask
from celery_lease._celery import unique as unique_module
from celery_lease._celery.unique import common as unique_common
from tests.unit.conftest import Published, SpyStore

Hook = Callable[[], None]


def define_task(app: Celery, name: str, **options: Any) -> Any:
    """A LockedTask ``name`` keyed ``k:{n}``, returning ``n + extra``, with ``options``."""

    @app.task(name=name, base=LockedTask, lock_key="k:{n}", shared=False, **options)
    def body(n: int, extra: int = 0) -> int:
        return n + extra

    return body._get_current_object()  # the Task itself: the worker's hooks get no proxy


def hook_once(
    monkeypatch: pytest.MonkeyPatch,
    store: SpyStore,
    op: str,
    when: Callable[..., bool],
    hook: Hook,
    *,
    after: bool = False,
) -> list[bool]:
    """Run ``hook`` once, before (or after) the first ``store.<op>(...)`` that ``when`` accepts."""
    real = getattr(store, op)
    fired: list[bool] = []

    def wrapper(*args: Any) -> Any:
        go = not fired and when(*args)
        if go:
            fired.append(True)
            if not after:
                hook()
        result = real(*args)
        if go and after:
            hook()
        return result

    monkeypatch.setattr(store, op, wrapper)
    return fired


def request_of(message_headers: dict[str, Any]) -> Context:
    """The worker's request of a published copy (its headers as attributes, as Celery does)."""
    return Context(
        id=message_headers["id"],
        is_eager=False,
        called_directly=False,
        **{unique_common.HEADER: message_headers[unique_common.HEADER]},
    )


class Bodies:
    """The executions of a ``define_recorded`` task's body: ``(task id, retries)`` each."""

    def __init__(self) -> None:
        self.runs: list[tuple[str | None, int]] = []
        self.lock = threading.Lock()


def define_recorded(app: Celery, name: str, bodies: Bodies, **options: Any) -> Any:
    """A bound LockedTask ``name`` keyed ``k:{n}`` (``lock_wait=0``) whose body records itself in
    ``bodies`` and returns ``n``."""

    @app.task(
        name=name,
        base=LockedTask,
        lock_key="k:{n}",
        lock_wait=0,
        shared=False,
        bind=True,
        **options,
    )
    def body(self: Any, n: int) -> int:
        with bodies.lock:
            bodies.runs.append((self.request.id, int(self.request.retries or 0)))
        return n

    return body._get_current_object()


def until_done_copy(
    app: Celery, published: Published, name: str, **options: Any
) -> tuple[Bodies, Any, Any, dict[str, Any]]:
    """An until_done task ``name`` (``define_recorded``) with one copy published,
    ``task.delay(1)``: the task's bodies, the task, the copy's AsyncResult and the headers of its
    message."""
    bodies = Bodies()
    task = define_recorded(app, name, bodies, lock_unique="until_done", **options)
    first = task.delay(1)
    return bodies, task, first, published.headers[0]


def deliver(
    task: Any, headers: dict[str, Any], *, deferred: bool | int, retries: int = 0, **request: Any
) -> Any:
    """Run one delivery of the published message ``headers`` as the worker's tracer does: a
    request pushed for it (its custom headers as attributes), then the task called."""
    extra: dict[str, Any] = {unique_common.HEADER: headers[unique_common.HEADER]}
    if deferred:
        extra[unique_common.DEFERRED] = int(deferred)  # the header is the count the worker writes
    task.push_request(
        id=headers["id"],
        args=[1],
        kwargs={},
        retries=retries,
        is_eager=False,
        called_directly=False,
        delivery_info={"exchange": "", "routing_key": "celery", "priority": 0},
        **extra,
        **request,
    )
    try:
        return task(1)
    finally:
        task.pop_request()


def start_copy(
    task: Any,
    request: Any,
    store: Any,
    key: str,
    settings: Any,
    unique: Any,
    ttl: float,
    cooldown: float,
) -> Any:
    """The worker's hooks at a copy's start, in the engine's order: ``on_arrival`` (before the
    run lease), then, the run lease held, the claim re-asserted and ``on_start``; what
    ``on_start`` returns. The claim is left held (the engine frees it when the run ends)."""
    arrival = unique_module.on_arrival(task, request, store, key, settings, unique, ttl)
    if arrival is not None:
        arrival.confirm(task, request)
    return unique_module.on_start(task, request, store, key, settings, unique, ttl, cooldown)
