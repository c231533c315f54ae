"""``config.default_sqlite_path()`` must not disturb a connection of its process to the file.

POSIX record locks belong to a process and an inode, and closing *any* descriptor of that inode
drops all of them. SQLite's connections (in WAL mode) keep a shared lock on the database file
for their lifetime; it is how another process, closing its own connection, learns it is not the
last one and must not checkpoint and delete the WAL. A process that opened and closed the file
outside SQLite lost that lock: the next process to close thought itself the last, deleted the
WAL, and this process went on committing into the deleted one, unseen: two holders of one key.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_lease import LeaseConfigError
from celery_lease._celery import settings as config
from celery_lease.stores.sqlite import SQLiteLockStore

PROC_LOCKS = Path("/proc/locks")


@pytest.fixture
def tempdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``tempfile.gettempdir()`` is ``tmp_path``: the default store lives under it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


@pytest.fixture
def store(tempdir: Path) -> Iterator[SQLiteLockStore]:
    """A store on the default path, whose connection is open (it took a key)."""
    opened = SQLiteLockStore(config.default_sqlite_path())
    try:
        assert opened.acquire("first", "me", 30_000) is not None
        yield opened
    finally:
        opened.close()


def own_locks(path: str) -> list[str]:
    """This process's POSIX locks on ``path``, as ``/proc/locks`` lists them (the kernel's view,
    the one every other process is judged against)."""
    inode = os.stat(path).st_ino
    pid = str(os.getpid())
    return [
        " ".join(fields[1:])
        for fields in (line.split() for line in PROC_LOCKS.read_text().splitlines())
        if len(fields) >= 6 and fields[4] == pid and fields[5].endswith(f":{inode}")
    ]


def in_another_process(path: str, code: str) -> str:
    """Run ``code`` with ``store`` open on ``path`` in a new process, closing it after; its
    stdout."""
    script = (
        "from celery_lease.stores.sqlite import SQLiteLockStore\n"
        f"store = SQLiteLockStore({path!r})\n"
        f"{code}\n"
        "store.close()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout.strip()


class TestLocksOfAnOpenConnection:
    @pytest.mark.skipif(not PROC_LOCKS.exists(), reason="needs Linux /proc/locks")
    def test_its_locks_on_the_file_are_kept(self, store: SQLiteLockStore) -> None:
        """The shared lock SQLite holds on the file is still held after the call."""
        before = own_locks(store.path)
        assert before, "SQLite holds no lock on the database file: nothing to test"
        assert config.default_sqlite_path() == store.path
        assert own_locks(store.path) == before

    def test_a_key_it_takes_afterwards_is_seen_held_by_other_processes(
        self, store: SQLiteLockStore
    ) -> None:
        """After the call, another process opens and closes the store (it must not think itself
        the last connection: that would delete the WAL this process commits into); a key this
        process takes then is held for every other process, which cannot take it."""
        assert config.default_sqlite_path() == store.path
        assert in_another_process(store.path, "print(store.get('first').owner)") == "me"
        token = store.acquire("second", "me", 30_000)
        assert token is not None
        seen = in_another_process(
            store.path,
            "info = store.get('second')\n"
            "print(None if info is None else info.token, store.acquire('second', 'other', 30_000))",
        )
        assert seen == f"{token} None"


class TestFileMode:
    def test_a_new_file_is_0o600_whatever_the_umask(self, tempdir: Path) -> None:
        old = os.umask(0)
        try:
            path = config.default_sqlite_path()
        finally:
            os.umask(old)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600

    def test_an_existing_file_is_made_0o600(self, tempdir: Path) -> None:
        path = config.default_sqlite_path()
        os.chmod(path, 0o644)
        assert config.default_sqlite_path() == path
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600

    def test_a_symlink_in_its_place_is_refused_and_its_target_left_alone(
        self, tempdir: Path
    ) -> None:
        target = tempdir / "elsewhere"
        target.write_text("")
        target.chmod(0o644)
        path = Path(config.default_sqlite_dir()) / config.SQLITE_FILE
        Path(config.default_sqlite_dir()).mkdir(mode=0o700)
        path.symlink_to(target)
        with pytest.raises(LeaseConfigError, match="not a regular file"):
            config.default_sqlite_path()
        assert stat.S_IMODE(target.stat().st_mode) == 0o644


class TestRequireSharedStore:
    def test_the_host_local_file_is_refused_naming_the_setting(self, tempdir: Path) -> None:
        """``lease_require_shared_store = True``: the app's store is never the host-local file;
        the error names the setting and what to set instead."""
        from celery import Celery

        app = Celery("require", broker="amqp://guest@localhost//", set_as_current=False)
        app.conf.lease_require_shared_store = True
        with pytest.raises(LeaseConfigError, match="lease_require_shared_store=True refuses it"):
            config.get_store(app)
        app.conf.lease_store = f"sqlite:///{tempdir / 'shared.db'}"  # named: the user's choice
        config.reset(app)
        assert isinstance(config.get_store(app), SQLiteLockStore)

    def test_a_value_that_is_not_a_bool_is_refused(self) -> None:
        """Like every boolean setting: ``True`` or ``False``, naming the setting."""
        from celery import Celery

        app = Celery("require", broker="amqp://guest@localhost//", set_as_current=False)
        app.conf.lease_require_shared_store = "yes"
        with pytest.raises(LeaseConfigError, match="lease_require_shared_store='yes'"):
            config.get_settings(app)


class TestSettingsReadBeforeTheAppIsConfigured:
    """Settings read while the app had no configuration yet (a helper module imported first)
    do not outlive ``app.config_from_object``: its tasks then use the configured store."""

    def test_config_from_object_after_a_read_is_seen(self) -> None:
        from celery import Celery

        from celery_lease import MemoryLockStore

        app = Celery("read-too-early", set_as_current=False)
        try:
            assert config.get_settings(app).key_prefix == ""
            store = MemoryLockStore()

            class Conf:
                lease_store = store
                lease_key_prefix = "proj:"

            app.config_from_object(Conf)
            assert config.get_settings(app).key_prefix == "proj:"
            assert config.get_store(app) is store
        finally:
            config.reset(app)

    def test_the_same_settings_read_again_keep_the_store(self) -> None:
        """Settings read again with the same values (a recheck at worker start) keep the store
        already built: leases held in it go on being renewed in the store tasks use."""
        from celery import Celery

        app = Celery("read-again", set_as_current=False)
        app.conf.lease_store = "memory://"
        try:
            built = config.get_store(app)
            config.recheck(app)
            assert config.get_store(app) is built
        finally:
            config.reset(app)
