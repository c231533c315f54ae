"""The Celery layer: the locked task, its execution, settings, unique at enqueue, worker hooks.

See ``docs/internals.md`` for the threads, locks and fork resets of these modules.
"""
