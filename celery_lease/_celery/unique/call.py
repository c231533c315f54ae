"""One ``apply_async`` call of a unique task, resolved once: publish the copy, or answer as a
duplicate."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from celery_lease import signals
from celery_lease._celery.unique.common import HEADER, fail_quietly, logger, release_quietly
from celery_lease._core.owners import queued_owner
from celery_lease._core.unique_options import UniqueOptions
from celery_lease.errors import AlreadyQueuedError
from celery_lease.stores.base import LockStore, SupportsInspection

if TYPE_CHECKING:
    from celery_lease._celery.protocols import AsyncResultLike, UniqueTask


class InspectableStore(LockStore, SupportsInspection, Protocol):
    """A store that can read a key's holder: what ``lock_unique`` needs."""


# Options whose duplicate always raises: callbacks, a chain's next steps, and group or chord members
# (published under a pre-assigned id their group or chord waits for; Celery ignores what
# ``apply_async`` returns). ``chain`` counts even empty: Celery publishes a chain's last step with
# ``chain=[]`` (``celery/app/trace.py``).
CALLBACKS = ("link", "link_error", "chain", "chord", "group_id")


@dataclass(frozen=True)
class Call:
    """A call of a unique task: the copy it would publish and the keys it decides on."""

    task: UniqueTask
    unique: UniqueOptions
    store: InspectableStore
    key: str
    """The run lease's key (prefixed); ``qkey`` the queued lease's; ``now`` wall-clock seconds."""
    qkey: str
    prefix: str
    task_id: str
    args: Iterable[object] | None
    kwargs: Mapping[str, object] | None
    options: dict[str, Any]  # apply_async options: values of any kind
    now: float
    queue_ttl: float

    def owner(self, at: float | None = None) -> str:
        return queued_owner(
            self.task.name, self.task_id, int((self.now if at is None else at) * 1000)
        )

    def send(self, **options: Any) -> AsyncResultLike:
        """Publish the copy (``options`` over the call's) without a queued lease."""
        return self.task.publish_copy(
            self.args, self.kwargs, self.task_id, **{**self.options, **options}
        )

    def publish(
        self, owner: str, *, free: bool = True, fail: bool = False, **options: Any
    ) -> AsyncResultLike:
        """Publish with the queued lease ``owner`` in the header; a failure frees it (``free``)
        and is stored as the copy's FAILURE (``fail``)."""
        headers = dict(self.options.get("headers") or {})
        headers[HEADER] = [self.qkey, owner]
        try:
            return self.send(**options, headers=headers)
        except BaseException as exc:
            if free:
                release_quietly(self.store, self.qkey, owner, "the publish failed")
            if fail and isinstance(exc, Exception):
                fail_quietly(self.task, self.task_id, exc)
            raise

    def duplicate(self, existing: str | None) -> AsyncResultLike:
        """Nothing published: ``existing``'s result, or ``AlreadyQueuedError``."""
        task, key, task_id = self.task, self.key, self.task_id
        signals.send(
            signals.lock_duplicate, task, key=key, task_id=task_id, existing_task_id=existing
        )
        logger.debug(
            "celery-lease: %s[%s] not published: %r held by %s", task.name, task_id, key, existing
        )
        if (
            self.unique.on_duplicate == "raise"
            or existing is None
            or any(self.options.get(c) for c in CALLBACKS)
            or "chain" in self.options  # a chain's last step: Celery publishes it with chain=[]
        ):
            raise AlreadyQueuedError(key, existing)
        return task.AsyncResult(existing)
