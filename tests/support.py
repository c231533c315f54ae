"""Shared helpers for the test suite (not fixtures: plain functions)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import NoReturn

import celery
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The repository root (the working directory of scripts that import ``tests``)."""

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

CELERY_MINOR: tuple[int, int] = (int(celery.VERSION.major), int(celery.VERSION.minor))
"""The installed Celery's ``(major, minor)``: tests of behaviour that differs between the Celery
releases celery-lease supports branch or skip on it, saying why."""

needs_celery_pydantic = pytest.mark.skipif(
    CELERY_MINOR < (5, 6),
    reason="Celery 5.4 has no pydantic=True (the option is ignored); Celery 5.5 validates only"
    " annotations that are classes, not the strings of 'from __future__ import annotations'",
)


def service_missing(what: str, how: str) -> NoReturn:
    """Skip locally, fail in CI: a test that needs a service must never silently skip in CI.

    Args:
        what: the missing thing ("redis-server binary on PATH").
        how: how to get it ("apt-get update && apt-get install -y redis-server").
    """
    message = f"{what} is missing: {how}"
    if IN_CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def complete_lines(path: Path) -> list[str]:
    """The whole lines of a marker file (each writer appends ``line + "\\n"`` in one write).

    A file is seen between its creation and its write, empty, and a write may be seen before it
    ends: only the text up to the last newline counts. Missing file: no lines.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return text[: text.rfind("\n") + 1].splitlines()
