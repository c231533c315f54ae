"""A result backend that reads this process's deferred release replies before it writes a
result: the release of an execution whose result is stored can then go out without waiting, its
reply read just before the write, after the backend built the result and read the task's current
state (Redis: its ``GET``), so that round trip overlaps the backend's own work and the key is
still free before the result is visible.

Only key-value backends whose write path is Celery's own qualify (``Backend.mark_as_done`` ->
``Backend.store_result`` -> ``BaseKeyValueStoreBackend._store_result`` -> ``_set_with_state``:
Redis, Sentinel, cache, filesystem, S3 and the other key-value backends); their instance's
``_set_with_state`` is wrapped once. Any other backend (database, RPC, MongoDB, a backend of the
user's that writes its own way) keeps the synchronous release."""

from __future__ import annotations

from collections.abc import Callable

from celery_lease._celery import compat

# In a backend instance's own attributes: True once its writes read the replies first, False
# when they cannot (read from ``vars()``: a proxy's ``__getattr__`` or a mock answers anything).
_MARK = "_celery_lease_reads_releases_first"
_write_path_is_celerys: dict[type, bool] = {}


def reads_releases_first(backend: object, read_replies: Callable[[], None]) -> bool:
    """Whether ``backend`` calls ``read_replies`` before every result it writes; made so here
    (once per instance) when its write path is Celery's key-value one. False, never an error,
    for anything else (a backend that fails to answer included)."""
    try:
        own = vars(backend)
    except TypeError:  # no instance attributes: not a Celery backend
        return False
    marked = own.get(_MARK)
    if marked is not None:
        return marked is True
    try:
        qualifies = _qualifies(backend, own)
        if qualifies:
            compat.call_before_result_writes(backend, read_replies)
    except Exception:
        qualifies = False
    own[_MARK] = qualifies
    return qualifies


def _qualifies(backend: object, own: dict[str, object]) -> bool:
    """Whether a result of ``backend`` reaches its store only through ``_set_with_state``
    (nothing of that path replaced on the instance either)."""
    if any(name in own for name in compat.RESULT_WRITE_STEPS):
        return False
    cls = type(backend)
    qualifies = _write_path_is_celerys.get(cls)
    if qualifies is None:
        qualifies = _write_path_is_celerys[cls] = compat.writes_results_through_set_with_state(cls)
    return qualifies
