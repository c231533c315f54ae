"""Importing a fencing helper whose driver is not installed says which extra to install."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

# Runs in a fresh interpreter: there the driver was never imported, and ``None`` in sys.modules
# makes importing it fail as if it were not installed.
PROBE = textwrap.dedent(
    """
    import json, sys
    sys.modules[{driver!r}] = None
    try:
        import {module}
    except ImportError as exc:
        print(json.dumps([type(exc).__name__, exc.name, str(exc)]))
    else:
        print(json.dumps(None))
    """
)


@pytest.mark.parametrize(
    ("module", "driver", "extra"),
    [
        ("celery_lease.fencing.sqlalchemy", "sqlalchemy", "sqlalchemy"),
        ("celery_lease.fencing.django", "django", "django"),
    ],
)
def test_importing_a_helper_without_its_driver_names_the_extra(
    module: str, driver: str, extra: str
) -> None:
    """The error is still a ModuleNotFoundError for the driver (``except ImportError`` and
    ``exc.name`` keep working), and its message gives the pip command of the extra."""
    probe = PROBE.format(driver=driver, module=module)
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    caught = json.loads(done.stdout)
    assert caught is not None, f"{module} imported without {driver}"
    kind, name, message = caught
    assert (kind, name) == ("ModuleNotFoundError", driver)
    assert f"pip install 'celery-lease[{extra}]'" in message
    assert module in message
