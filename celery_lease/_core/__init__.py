"""The core: leases, renewal, owners, keys and options, with no Celery in it.

See ``docs/internals.md`` for the threads, locks and fork resets of these modules.
"""
