"""A module whose import fails with no ``ImportError``, as django-celery-beat's does without
Django settings (``ImproperlyConfigured``)."""

raise RuntimeError("Requested setting USE_TZ, but settings are not configured")
