"""Errors carry their context and survive pickle and Celery's json result serializer."""

from __future__ import annotations

import pickle

import pytest
from celery.backends.base import Backend

from celery_lease import (
    LeaseConfigError,
    LeaseError,
    LockLostError,
    LockNotAcquiredError,
    ReplicaLagError,
    RestartGraceError,
    StoreUnavailableError,
)


class TestAttributes:
    def test_not_acquired(self) -> None:
        """LockNotAcquiredError says which key, with a code, an HTTP status and is a rejection."""
        err = LockNotAcquiredError("account:1")
        assert (err.key, err.code, err.http_status, err.is_rejection) == (
            "account:1",
            "LOCK_NOT_ACQUIRED",
            409,
            True,
        )
        assert "account:1" in str(err)
        assert "cancelled" in str(LockNotAcquiredError("k", "cancelled"))

    def test_lost(self) -> None:
        """LockLostError carries the key, the reason and the code LOCK_LOST."""
        err = LockLostError("k", "expired")
        assert (err.key, err.reason, err.code) == ("k", "expired", "LOCK_LOST")
        assert "expired" in str(err)

    def test_tree(self) -> None:
        """Everything derives from LeaseError; bad configuration is also a ValueError."""
        for cls in (LockNotAcquiredError, LockLostError, StoreUnavailableError, LeaseConfigError):
            assert issubclass(cls, LeaseError)
        assert issubclass(LeaseConfigError, ValueError)
        assert issubclass(ReplicaLagError, StoreUnavailableError)
        assert issubclass(RestartGraceError, StoreUnavailableError)


ERRORS = [
    LockNotAcquiredError("account:1"),
    LockNotAcquiredError("k", "cancelled"),
    LockLostError("k", "taken"),
    StoreUnavailableError("redis down"),
    ReplicaLagError("acquire 'k' not confirmed"),
    RestartGraceError("acquire 'k' refused: restart grace", 1_800_000_000.5),
    LeaseConfigError("ttl=0 must be > 0 seconds"),
]


@pytest.mark.parametrize("err", ERRORS, ids=lambda e: type(e).__name__)
class TestRoundTrip:
    def test_pickle(self, err: LeaseError) -> None:
        """Pickling keeps the type, the args and the attributes."""
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err)
        assert back.args == err.args
        assert getattr(back, "key", None) == getattr(err, "key", None)
        assert str(back) == str(err)

    @pytest.mark.parametrize("serializer", ["json", "pickle"])
    def test_celery_result_backend(self, err: LeaseError, serializer: str) -> None:
        """Celery's backend rebuilds the exception with its attributes under json and pickle."""
        from celery import Celery

        app = Celery("t", set_as_current=False)
        app.conf.result_serializer = serializer
        app.conf.accept_content = [serializer]
        backend = Backend(app)
        stored = backend.prepare_exception(err, serializer)
        back = backend.exception_to_python(stored)
        assert type(back) is type(err)
        assert back.args == err.args
        assert getattr(back, "key", None) == getattr(err, "key", None)
