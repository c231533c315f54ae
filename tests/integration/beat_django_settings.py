"""Django settings of the django-celery-beat test: its models in the database ``BEAT_DJANGO_DB``
(a PostgreSQL URL)."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

_url = urlsplit(os.environ["BEAT_DJANGO_DB"])

SECRET_KEY = "leased-beat-tests"
INSTALLED_APPS = ["django_celery_beat"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _url.path.lstrip("/"),
        "USER": _url.username or "",
        "HOST": _url.hostname or "127.0.0.1",
        "PORT": str(_url.port or 5432),
    }
}
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
