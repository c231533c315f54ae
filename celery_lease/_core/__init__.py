"""The core: leases, renewal, owners, keys and options, with no Celery in it.

Importing it installs the awaiting half of ``async with lease(...)``
(:mod:`celery_lease._core.aio`, which builds on :mod:`celery_lease._core.lease`) into the
lease's context, so the two modules import each other in one direction only.

See ``docs/internals.md`` for the threads, locks and fork resets of these modules.
"""

from celery_lease._core import aio, lease

lease.install_async_path(aio.ASYNC_PATH)
