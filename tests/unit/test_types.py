"""celery_lease.types: the typed aliases match the options the runtime accepts, our signatures
use them, and mypy --strict rejects a misspelled policy or a bad duration in a user's file."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

from celery_lease import types
from celery_lease._core import options, unique_options

ROOT = Path(__file__).resolve().parents[2]

USER_FILE = """
from datetime import timedelta

from celery_lease import LockedTask, MemoryLockStore, lease, locked
from celery_lease._core.options import LockOptions
from celery_lease.types import Duration, OnHeld, OnLost


def schedule(on_held: OnHeld, on_lost: OnLost, ttl: Duration) -> None: ...


schedule("skip", "revoke", "30s")
schedule("retry", "mark", 2.5)
locked(key="k", on_held="skip", on_lost="revoke", ttl="30s", wait=timedelta(seconds=1))
lease("k", store=MemoryLockStore(), ttl="30s", max_hold=None, cooldown=1.5)


class Report(LockedTask):
    lock_key = "report:{day}"
    lock_ttl = "30s"
    lock_on_held = "skip"


print(LockOptions(on_held="retry"), Report)
schedule("skp", "mark", 1)
locked(on_held="skp")
lease("k", store=MemoryLockStore(), ttl=[30])


class Bad(LockedTask):
    lock_on_lost = "revok"


LockOptions(on_lost="revok")
"""

_BAD = {  # a bad line of USER_FILE -> what mypy says there (the value, in our signatures)
    'schedule("skp"': "Literal['skp']",  # an alias in the user's own signature
    'locked(on_held="skp")': 'Argument "on_held" to "locked"',
    'lease("k", store=MemoryLockStore(), ttl=[30])': 'Argument "ttl" to "lease"',
    'lock_on_lost = "revok"': "defined the type as \"Literal['mark', 'revoke'] | None\"",
    'LockOptions(on_lost="revok")': 'Argument "on_lost" to "LockOptions"',
}
EXPECTED = {
    number: needle
    for number, line in enumerate(USER_FILE.splitlines(), start=1)
    for start, needle in _BAD.items()
    if line.strip().startswith(start)
}
"""Line number in USER_FILE -> a part of mypy's error there; every other line must pass."""


class TestAliases:
    def test_on_held_lists_exactly_the_allowed_policies(self) -> None:
        """OnHeld and options.ON_HELD (what validation accepts) are the same values."""
        assert typing.get_args(types.OnHeld) == options.ON_HELD

    def test_on_lost_lists_exactly_the_allowed_policies(self) -> None:
        """OnLost and options.ON_LOST are the same values."""
        assert typing.get_args(types.OnLost) == options.ON_LOST

    def test_unique_lists_exactly_the_allowed_values(self) -> None:
        """Unique and unique_options.UNIQUE (what lock_unique accepts) are the same values."""
        assert (
            typing.get_args(types.Unique) == unique_options.UNIQUE == ("while_queued", "until_done")
        )

    def test_on_duplicate_lists_exactly_the_allowed_policies(self) -> None:
        """OnDuplicate and unique_options.ON_DUPLICATE are the same values."""
        assert typing.get_args(types.OnDuplicate) == unique_options.ON_DUPLICATE

    def test_each_literal_type_is_defined_once(self) -> None:
        """Only celery_lease/types.py assigns a Literal alias; every other module imports it
        (typing caches Literal objects, so an identity check could not see a second copy)."""
        package = ROOT / "celery_lease"
        aliases = re.compile(r"^(\w+)(?:: [\w.]+)? = (?:typing\.)?Literal\[", re.MULTILINE)
        defined = {
            (str(path.relative_to(ROOT)), name)
            for path in package.rglob("*.py")
            for name in aliases.findall(path.read_text(encoding="utf-8"))
        }
        assert defined == {
            ("celery_lease/types.py", name)
            for name in ("OnDuplicate", "OnHeld", "OnLost", "Unique")
        }

    def test_duration_is_the_parser_alias(self) -> None:
        """Duration is the one alias of celery_lease.durations (not a second copy)."""
        from celery_lease.durations import Duration

        assert types.Duration is Duration


def test_mypy_strict_sees_the_types_in_our_signatures(tmp_path: Path) -> None:
    """A user's typed file: locked(), lease(), LockedTask's lock_* attributes and LockOptions
    take the aliases; the good uses pass, and exactly the bad values are errors."""
    api = pytest.importorskip("mypy.api")
    user = tmp_path / "user.py"
    user.write_text(USER_FILE)
    out, err, status = api.run(
        [
            "--strict",
            "--no-incremental",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--config-file",
            "",
            "--python-version",
            "3.10",
            str(user),
        ]
    )
    # Only the user's file: run from the clone, mypy also reports celery_lease's own imports of
    # untyped Celery (silenced in site-packages; tests/integration/test_wheel.py checks that).
    lines = [line for line in out.splitlines() if "user.py:" in line and ": error:" in line]
    assert status == 1, out + err
    got = {int(line.split("user.py:", 1)[1].split(":", 1)[0]): line for line in lines}
    assert sorted(got) == sorted(EXPECTED), out
    for number, needle in EXPECTED.items():
        assert needle in got[number], got[number]
