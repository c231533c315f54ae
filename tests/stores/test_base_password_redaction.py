"""celery_lease.stores.base: a store URL or DSN with a password never shows it: not in an error,
not in a repr (stores built by store_from_url, every scheme)."""

from __future__ import annotations

import socket

import pytest

from celery_lease.errors import LeaseConfigError, StoreUnavailableError
from celery_lease.stores import store_from_url

SECRET = "s3cr3tPW"


class TestNoPasswordInMessages:
    """A store URL or DSN with a password never shows it in an error or a repr."""

    @pytest.mark.parametrize(
        "url",
        [
            f"postgress://app:{SECRET}@db.internal/prod",  # a typo in the scheme
            f"postgresql//app:{SECRET}@db.internal/prod",  # not a URL at all
            f"redis:/app:{SECRET}@cache/0",
        ],
    )
    def test_store_from_url_errors(self, url: str) -> None:
        with pytest.raises(LeaseConfigError) as caught:
            store_from_url(url)
        assert SECRET not in str(caught.value)
        assert "***" in str(caught.value)

    def test_a_lease_store_setting_that_is_not_a_url(self) -> None:
        from celery import Celery

        from celery_lease._celery.settings import get_settings

        app = Celery("redaction", set_as_current=False)
        app.conf.lease_store = f"app:{SECRET}@db.internal/prod"  # the scheme forgotten
        with pytest.raises(LeaseConfigError) as caught:
            get_settings(app)
        assert SECRET not in str(caught.value)

    @pytest.mark.parametrize(
        ("dsn", "secret"),
        [
            # libpq quotes the token it stopped at: part of the password
            ("host=db.internal password=se cretPW1 dbname=prod", "cretPW1"),
            ("host=db.internal password='secretPW2 dbname=prod", "secretPW2"),
            # a broken URL: libpq quotes all of it
            (f"postgresql://app:{SECRET}@[::1/prod", SECRET),
            ("postgresql://app:s%ZZcretPW3@db.internal/prod", "ZZcretPW3"),
            (f"postgresql://app:{SECRET}@db.internal/prod?bogus=1", SECRET),
        ],
    )
    def test_a_bad_dsn(self, dsn: str, secret: str) -> None:
        from celery_lease.stores.postgres import PostgresLockStore

        with pytest.raises(LeaseConfigError) as caught:
            PostgresLockStore(dsn)
        assert secret not in str(caught.value), str(caught.value)
        assert "not a valid PostgreSQL DSN" in str(caught.value)

    @pytest.mark.parametrize(
        "dsn",
        [
            "postgresql://app:pa@ssPW4@db.internal/prod",  # libpq: host 'ssPW4@db.internal'
            "postgresql://app:pa/ssPW4@db.internal/prod",  # libpq: host 'app', dbname 'ssPW4@...'
        ],
    )
    def test_a_url_with_an_unencoded_at_or_slash_in_the_password_is_refused(self, dsn: str) -> None:
        """libpq splits such a URL elsewhere and puts pieces of the password into the host or
        the database name, which every message and the repr then show: refused up front."""
        from celery_lease.stores.postgres import PostgresLockStore

        with pytest.raises(LeaseConfigError, match="percent-encode") as caught:
            PostgresLockStore(dsn)
        assert "ssPW4" not in str(caught.value)

    def test_a_connection_failure(self) -> None:
        """No server on the port: the error (a pool timeout with libpq's reason) hides it."""
        from celery_lease.stores.postgres import PostgresLockStore

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]  # bound, not listening: connections are refused
            for dsn in (
                f"postgresql://app:{SECRET}@127.0.0.1:{port}/prod",
                f"host=127.0.0.1 port={port} user=app password={SECRET} dbname=prod",
            ):
                store = PostgresLockStore(dsn, connect_timeout=0.5)
                try:
                    assert SECRET not in repr(store)
                    with pytest.raises(StoreUnavailableError) as caught:
                        store.acquire("k", "a", 1000)
                    assert SECRET not in str(caught.value)
                    assert "refused" in str(caught.value) or "no connection" in str(caught.value)
                finally:
                    store.close()
