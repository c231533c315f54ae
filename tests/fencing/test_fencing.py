"""celery_lease.fencing: StaleTokenError and MissingRowError (re-exported here) survive pickle
and Celery's result backends, and resolve_token picks the token of the current lease."""

from __future__ import annotations

import pickle

import pytest
from celery.backends.base import Backend

from celery_lease import LeaseConfigError, LeaseError, MemoryLockStore, lease
from celery_lease.fencing import FencingToken, MissingRowError, StaleTokenError, resolve_token

ERRORS = [
    StaleTokenError("account:1", 4, 5, "accounts id=1"),
    StaleTokenError(None, 4, None),
    MissingRowError("accounts id=42"),
]


@pytest.mark.parametrize("err", ERRORS, ids=lambda e: f"{type(e).__name__}{e.args}")
class TestRoundTrip:
    def test_pickle(self, err: LeaseError) -> None:
        """Pickling keeps the type, the args, the attributes and the message."""
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err)
        assert back.args == err.args and vars(back) == vars(err)
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
        assert back.args == err.args and vars(back) == vars(err)


class TestStaleTokenError:
    def test_attributes_and_message(self) -> None:
        """key, token, current and resource are kept; the message names them."""
        err = StaleTokenError("account:1", 4, 5, "accounts id=1")
        assert (err.key, err.token, err.current, err.resource) == (
            "account:1",
            4,
            5,
            "accounts id=1",
        )
        assert err.code == "STALE_TOKEN" and isinstance(err, LeaseError)
        assert str(err) == (
            "the write to accounts id=1 with token 4 of the lease on 'account:1' was refused: a"
            " newer holder (token 5) already wrote, so this holder's lease was lost"
        )

    def test_missing_row_is_a_lookup_error(self) -> None:
        """MissingRowError is a LeaseError and a LookupError."""
        assert issubclass(MissingRowError, LookupError) and issubclass(MissingRowError, LeaseError)


class TestResolveToken:
    def test_current_lease_token_and_key(self) -> None:
        """Without token=, the innermost lease's token and key; outside, LeaseConfigError."""
        store = MemoryLockStore()
        with lease("outer", store=store) as outer:
            assert resolve_token() == FencingToken(outer.token, "outer")
            with lease("inner", store=store) as inner:
                assert resolve_token() == FencingToken(inner.token, "inner")
                assert resolve_token(lock_key="other") == FencingToken(inner.token, "other")
                assert resolve_token(outer.token) == FencingToken(
                    outer.token, None
                )  # not the innermost
                assert resolve_token(inner.token) == FencingToken(inner.token, "inner")
        with pytest.raises(LeaseConfigError, match=r"token=None"):
            resolve_token()

    def test_explicit_token_outside_a_lease(self) -> None:
        """An explicit token works outside any lease, its key unknown unless given."""
        assert resolve_token(12) == FencingToken(12, None)
        assert resolve_token(12, "k") == FencingToken(12, "k")

    @pytest.mark.parametrize("token", [0, -1, True, 1.0, "5"])
    def test_bad_token(self, token: object) -> None:
        """Only positive ints (not bool) are tokens; the message names token=."""
        with pytest.raises(LeaseConfigError, match=rf"token={token!r}"):
            resolve_token(token)  # type: ignore[arg-type]

    @pytest.mark.parametrize("lock_key", ["", 5])
    def test_bad_lock_key(self, lock_key: object) -> None:
        """lock_key= must be a non-empty string; the message names lock_key=."""
        with pytest.raises(LeaseConfigError, match=r"lock_key="):
            resolve_token(1, lock_key)  # type: ignore[arg-type]
