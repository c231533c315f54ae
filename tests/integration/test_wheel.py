"""The built wheel, installed into a fresh venv: no top-level ``example_project``, and a user's
typed file sees our types under ``mypy --strict``; the README's editable install too.

Dependencies of the wheel come from the configured package index (``pip install``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests.unit.test_types import EXPECTED, USER_FILE  # one typed user file for both

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow]

COPY_IGNORE = (
    ".git",
    "build",
    "dist",
    "site",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    ".hypothesis",
)

TIMEOUT = 540  # seconds for a pip command (it downloads Celery and its dependencies)


# pytest-xdist's workers put the repository on PYTHONPATH (xdist/remote.py), which would let the
# fresh venvs import example_project and our package from the clone instead of the wheel.
CLEAN_ENV = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}


def run(*cmd: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=CLEAN_ENV,
    )


def make_venv(path: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    return path / "bin" / "python"


def mypy_user_file(python: Path, tmp_path: Path) -> list[str]:
    """mypy --strict on USER_FILE against ``python``'s site-packages: the error lines."""
    user = tmp_path / "user.py"
    user.write_text(USER_FILE)
    result = run(
        sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--config-file", "",
        "--cache-dir", tmp_path / "mypy-cache", "--python-executable", python, user,
        cwd=tmp_path,
    )  # fmt: skip
    return [line for line in result.stdout.splitlines() if ": error:" in line]


def assert_expected_errors(errors: list[str]) -> None:
    """Exactly the bad values of USER_FILE are errors (our types are seen, Celery's absence of
    types is silenced in site-packages)."""
    got = {int(line.split("user.py:", 1)[1].split(":", 1)[0]): line for line in errors}
    assert sorted(got) == sorted(EXPECTED), errors
    for number, needle in EXPECTED.items():
        assert needle in got[number], got[number]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy: pip builds in the source tree (build/, *.egg-info), and the clone may be
    # shared with other work.
    source = tmp_path_factory.mktemp("src") / "celery-lease"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*COPY_IGNORE))
    out = tmp_path_factory.mktemp("dist")
    result = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", out, source)
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = out.glob("celery_lease-*.whl")
    return built


def test_wheel_ships_only_celery_lease(wheel: Path) -> None:
    """Every file of the wheel is under celery_lease/ (or its metadata), py.typed included."""
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/", 1)[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"celery_lease"}, sorted(tops)
    assert "celery_lease/py.typed" in names
    assert "celery_lease/types.py" in names


def test_installed_wheel_has_no_example_project_and_types_for_mypy(
    wheel: Path, tmp_path: Path
) -> None:
    """In a fresh venv with the wheel: ``import example_project`` fails, celery_lease imports,
    and mypy --strict reports exactly the bad values in a user's file."""
    python = make_venv(tmp_path / "venv")
    result = run(python, "-m", "pip", "install", "-q", wheel)
    assert result.returncode == 0, result.stdout + result.stderr
    probe = run(python, "-c", "import example_project", cwd=tmp_path)
    assert probe.returncode != 0 and "No module named 'example_project'" in probe.stderr
    probe = run(python, "-c", "import celery_lease.types, celery_lease.metrics", cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    assert_expected_errors(mypy_user_file(python, tmp_path))


def test_readme_editable_install_is_seen_by_mypy(tmp_path: Path) -> None:
    """The README's editable install (``editable_mode=compat``) is visible to mypy: setuptools'
    default editable finder is an import hook that static checkers cannot follow."""
    python = make_venv(tmp_path / "venv")
    result = run(
        python, "-m", "pip", "install", "-q", "--no-deps", "-e", ROOT,
        "--config-settings", "editable_mode=compat",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert_expected_errors(mypy_user_file(python, tmp_path))


def test_clone_help_shows_the_demo_options() -> None:
    """From the clone, ``python -m example_project --help`` prints the demo's own options."""
    result = run(sys.executable, "-m", "example_project", "--help", cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "run the broker and the lease store on this Redis" in result.stdout, result.stdout
