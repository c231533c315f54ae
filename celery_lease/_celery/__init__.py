"""The Celery layer: the locked task, its execution, settings, unique at enqueue, worker hooks.
Threads, locks and fork resets: ``docs/internals.md``."""
