"""SQLAlchemy 2 fenced writes, Core and ORM, against a real PostgreSQL and an SQLite file."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import (
    BigInteger,
    Column,
    Engine,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    event,
    select,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session

from celery_lease import LeaseConfigError, SQLiteLockStore, lease
from celery_lease.fencing import MissingRowError, StaleTokenError
from celery_lease.fencing.sqlalchemy import fenced_update, fenced_upsert
from tests.fencing.conftest import JOIN_TIMEOUT, in_thread, poll, takeover

pytestmark = pytest.mark.filterwarnings("error")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """An engine on an SQLite file, or on the session's throwaway PostgreSQL database."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'data.sqlite3'}"
    else:
        dsn: str = request.getfixturevalue("pg_database_dsn")
        url = dsn.replace("postgresql://", "postgresql+psycopg://", 1)
    engine = create_engine(url)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def tables(engine: Engine) -> Iterator[dict[str, Table]]:
    """Fresh tables, uniquely named (the PostgreSQL database is shared by the session):
    ``accounts`` (fence nullable, the PK names the row), ``slots`` (a unique name names it),
    ``plain`` (no fence column), ``textfence`` (a fence that is not an integer)."""
    suffix = secrets.token_hex(4)
    metadata = MetaData()
    found = {
        "accounts": Table(
            f"accounts_{suffix}",
            metadata,
            Column("id", Integer, primary_key=True, autoincrement=False),
            Column("balance", Integer, nullable=False),
            Column("fence", BigInteger, nullable=True),
        ),
        "slots": Table(
            f"slots_{suffix}",
            metadata,
            Column("id", Integer, primary_key=True),
            Column("name", String(40), nullable=False, unique=True),
            Column("owner", String(40), nullable=False),
            Column("fence", BigInteger, nullable=False, server_default="0"),
        ),
        "plain": Table(
            f"plain_{suffix}",
            metadata,
            Column("id", Integer, primary_key=True, autoincrement=False),
            Column("balance", Integer),
        ),
        "textfence": Table(
            f"textfence_{suffix}",
            metadata,
            Column("id", Integer, primary_key=True, autoincrement=False),
            Column("balance", Integer),
            Column("fence", String(20)),
        ),
        "keyed": Table(  # column keys that differ from the column names
            f"keyed_{suffix}",
            metadata,
            Column("account_id", Integer, key="id", primary_key=True, autoincrement=False),
            Column("cents", Integer, key="balance", nullable=False),
            Column("fence_token", BigInteger, key="fence"),
        ),
        "partial": Table(  # a unique index only over part of the rows: not a row's key
            f"partial_{suffix}",
            metadata,
            Column("id", Integer, primary_key=True, autoincrement=False),
            Column("email", String(40), nullable=False),
            Column("active", Integer, nullable=False),
            Column("fence", BigInteger),
        ),
    }
    partial = found["partial"]
    Index(
        f"partial_email_{suffix}",
        partial.c.email,
        unique=True,
        postgresql_where=partial.c.active == 1,
        sqlite_where=partial.c.active == 1,
    )
    metadata.create_all(engine)
    try:
        yield found
    finally:
        metadata.drop_all(engine)


def row(engine: Engine, table: Table, **where: Any) -> tuple[Any, ...] | None:
    with engine.connect() as conn:
        found = conn.execute(
            select(table).where(*(table.c[k] == v for k, v in where.items()))
        ).first()
    return None if found is None else tuple(found)


def make_orm(table: Table) -> type[Any]:
    """A mapped class over ``accounts`` whose attribute names differ from the column names."""

    class Base(DeclarativeBase):
        pass

    class Account(Base):
        __table__ = table
        account_id: Mapped[int] = table.c.id  # type: ignore[assignment]
        cents: Mapped[int] = table.c.balance  # type: ignore[assignment]
        token: Mapped[int | None] = table.c.fence  # type: ignore[assignment]

    return Account


class TestTakeover:
    """A paused holder's late write is refused once a newer holder has written."""

    def test_core_upsert_refuses_the_old_holders_late_write(
        self, engine: Engine, tables: dict[str, Table], lease_store: SQLiteLockStore
    ) -> None:
        """Core upsert: the new holder's row stays; the old write raises with .current = new."""
        accounts = tables["accounts"]
        balances = {"new": 150, "old": 90}

        def write(who: str) -> None:
            with engine.begin() as conn:
                fenced_upsert(conn, accounts, where={"id": 1}, values={"balance": balances[who]})

        story = takeover(lease_store, "account:1", write)
        assert story.old_error is not None
        assert (story.old_error.key, story.old_error.token, story.old_error.current) == (
            "account:1",
            story.old_token,
            story.new_token,
        )
        assert row(engine, accounts, id=1) == (1, 150, story.new_token)

    def test_core_update_refuses_the_old_holders_late_write(
        self, engine: Engine, tables: dict[str, Table], lease_store: SQLiteLockStore
    ) -> None:
        """Core update of an existing row, Engine as the bind: the same refusal."""
        accounts = tables["accounts"]
        with engine.begin() as conn:
            conn.execute(accounts.insert().values(id=1, balance=100, fence=None))
        balances = {"new": 150, "old": 90}

        def write(who: str) -> None:
            fenced_update(engine, accounts, where={"id": 1}, values={"balance": balances[who]})

        story = takeover(lease_store, "account:1", write)
        assert story.old_error is not None and story.old_error.current == story.new_token
        assert row(engine, accounts, id=1) == (1, 150, story.new_token)

    @pytest.mark.parametrize("helper", [fenced_update, fenced_upsert])
    def test_orm_session_refuses_the_old_holders_late_write(
        self,
        engine: Engine,
        tables: dict[str, Table],
        lease_store: SQLiteLockStore,
        helper: Any,
    ) -> None:
        """ORM: a mapped class with its own attribute names, written through a Session."""
        account_cls = make_orm(tables["accounts"])
        with Session(engine) as session, session.begin():
            session.add(account_cls(account_id=1, cents=100, token=None))
        balances = {"new": 150, "old": 90}

        def write(who: str) -> None:
            with Session(engine) as session, session.begin():
                loaded = session.get(account_cls, 1)
                helper(
                    session,
                    account_cls,
                    where={"account_id": 1},
                    values={"cents": balances[who]},
                    fence="token",
                )
                assert loaded.cents == balances[who]  # the loaded instance was expired

        story = takeover(lease_store, "account:1", write)
        assert story.old_error is not None and story.old_error.current == story.new_token
        with Session(engine) as session:
            stored = session.get(account_cls, 1)
            assert (stored.cents, stored.token) == (150, story.new_token)


class TestRule:
    def test_equal_token_is_accepted_and_lower_refused(
        self, engine: Engine, tables: dict[str, Table]
    ) -> None:
        """The same token writes again (the same holder retrying); a lower one is refused."""
        accounts = tables["accounts"]
        assert fenced_upsert(engine, accounts, where={"id": 1}, values={"balance": 1}, token=7) == 7
        assert fenced_upsert(engine, accounts, where={"id": 1}, values={"balance": 2}, token=7) == 7
        assert fenced_update(engine, accounts, where={"id": 1}, values={"balance": 3}, token=7) == 7
        assert row(engine, accounts, id=1) == (1, 3, 7)
        for helper in (fenced_update, fenced_upsert):
            with pytest.raises(StaleTokenError) as caught:
                helper(engine, accounts, where={"id": 1}, values={"balance": 4}, token=6)
            assert (caught.value.token, caught.value.current, caught.value.key) == (6, 7, None)
        assert row(engine, accounts, id=1) == (1, 3, 7)

    def test_a_higher_token_overwrites(self, engine: Engine, tables: dict[str, Table]) -> None:
        """A higher token writes over a lower one and moves the fence."""
        accounts = tables["accounts"]
        fenced_upsert(engine, accounts, where={"id": 1}, values={"balance": 1}, token=3)
        fenced_update(engine, accounts, where={"id": 1}, values={"balance": 2}, token=9)
        assert row(engine, accounts, id=1) == (1, 2, 9)

    def test_null_fence_accepts_any_token(self, engine: Engine, tables: dict[str, Table]) -> None:
        """A row never fenced (fence NULL) takes the first token."""
        accounts = tables["accounts"]
        with engine.begin() as conn:
            conn.execute(accounts.insert().values(id=1, balance=0, fence=None))
        fenced_update(engine, accounts, where={"id": 1}, values={"balance": 5}, token=1)
        assert row(engine, accounts, id=1) == (1, 5, 1)

    def test_unique_constraint_names_the_row(
        self, engine: Engine, tables: dict[str, Table]
    ) -> None:
        """where= may be a unique column instead of the PK (the ON CONFLICT target)."""
        slots = tables["slots"]
        fenced_upsert(engine, slots, where={"name": "a"}, values={"owner": "x"}, token=2)
        fenced_upsert(engine, slots, where={"name": "a"}, values={"owner": "y"}, token=3)
        with pytest.raises(StaleTokenError):
            fenced_update(engine, slots, where={"name": "a"}, values={"owner": "z"}, token=1)
        assert row(engine, slots, name="a")[1:] == ("a", "y", 3)  # type: ignore[index]

    def test_column_keys_that_differ_from_names(
        self, engine: Engine, tables: dict[str, Table]
    ) -> None:
        """Names are the Table's column keys, also when a key differs from the column's name."""
        keyed = tables["keyed"]
        fenced_upsert(engine, keyed, where={"id": 1}, values={"balance": 10}, token=4)
        fenced_update(engine, keyed, where={"id": 1}, values={"balance": 11}, token=4)
        with pytest.raises(StaleTokenError):
            fenced_upsert(engine, keyed, where={"id": 1}, values={"balance": 12}, token=3)
        assert row(engine, keyed, id=1) == (1, 11, 4)

    def test_update_of_a_missing_row_raises_missing_row(
        self, engine: Engine, tables: dict[str, Table]
    ) -> None:
        """fenced_update never creates the row: MissingRowError, nothing written."""
        accounts = tables["accounts"]
        with pytest.raises(MissingRowError) as caught:
            fenced_update(engine, accounts, where={"id": 42}, values={"balance": 1}, token=1)
        assert "id=42" in str(caught.value)
        assert row(engine, accounts, id=42) is None

    def test_refusal_leaves_the_callers_transaction_usable(
        self, engine: Engine, tables: dict[str, Table]
    ) -> None:
        """A refused write in a Connection's transaction: the transaction goes on and commits."""
        accounts = tables["accounts"]
        fenced_upsert(engine, accounts, where={"id": 1}, values={"balance": 1}, token=5)
        with engine.begin() as conn:
            with pytest.raises(StaleTokenError):
                fenced_upsert(conn, accounts, where={"id": 1}, values={"balance": 2}, token=4)
            conn.execute(accounts.insert().values(id=2, balance=7, fence=None))
        assert row(engine, accounts, id=2) == (2, 7, None)

    def test_token_and_key_of_the_current_lease(
        self, engine: Engine, tables: dict[str, Table], lease_store: SQLiteLockStore
    ) -> None:
        """Without token=, the innermost lease's token is written; its key is in the error."""
        accounts = tables["accounts"]
        with lease("account:1", store=lease_store) as held:
            assert fenced_upsert(engine, accounts, where={"id": 1}, values={"balance": 1}) == (
                held.token
            )
        assert row(engine, accounts, id=1) == (1, 1, held.token)
        fenced_update(engine, accounts, where={"id": 1}, values={"balance": 2}, token=2**62)
        with lease("account:1", store=lease_store), pytest.raises(StaleTokenError) as caught:
            fenced_upsert(engine, accounts, where={"id": 1}, values={"balance": 3})
        assert caught.value.key == "account:1" and caught.value.current == 2**62


class TestFirstRow:
    def test_upsert_creates_the_missing_row(self, engine: Engine, tables: dict[str, Table]) -> None:
        """The first write creates the row, with the token as its fence."""
        accounts = tables["accounts"]
        fenced_upsert(engine, accounts, where={"id": 3}, values={"balance": 30}, token=11)
        assert row(engine, accounts, id=3) == (3, 30, 11)

    @pytest.mark.parametrize("newer_first", [True, False], ids=["newer-first", "older-first"])
    def test_racing_first_rows_create_one_row_and_the_newest_wins(
        self, engine: Engine, tables: dict[str, Table], newer_first: bool
    ) -> None:
        """Two connections insert the missing row at once: the second waits on the first's
        uncommitted row; one row results, and the older token is refused if it comes second."""
        accounts = tables["accounts"]
        first_token, second_token = (8, 5) if newer_first else (5, 8)
        second_thread: dict[str, int] = {}
        about_to_write = threading.Event()

        def announce(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if threading.get_ident() == second_thread.get("ident") and "INSERT" in statement:
                about_to_write.set()

        event.listen(engine, "before_cursor_execute", announce)
        first = engine.connect()
        try:
            first.begin()
            fenced_upsert(
                first, accounts, where={"id": 1}, values={"balance": 1}, token=first_token
            )
            pid: list[int] = []

            def second() -> int:
                second_thread["ident"] = threading.get_ident()
                with engine.begin() as conn:
                    if engine.dialect.name == "postgresql":
                        pid.append(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())
                    return fenced_upsert(
                        conn, accounts, where={"id": 1}, values={"balance": 2}, token=second_token
                    )

            thread, outcome = in_thread(second)
            assert about_to_write.wait(JOIN_TIMEOUT)
            if engine.dialect.name == "postgresql":
                poll(lambda: _waits_on_a_lock(engine, pid[0]), "the second insert to block")
            first.commit()
        finally:
            first.close()
            event.remove(engine, "before_cursor_execute", announce)
        thread.join(JOIN_TIMEOUT)
        assert outcome.done.is_set()
        with engine.connect() as conn:
            assert conn.execute(select(accounts)).all() == [(1, 1 if newer_first else 2, 8)]
        if newer_first:
            assert isinstance(outcome.error, StaleTokenError), outcome.error
            assert (outcome.error.token, outcome.error.current) == (5, 8)
        else:
            assert outcome.error is None and outcome.result == 8


def _waits_on_a_lock(engine: Engine, pid: int) -> bool:
    """Whether PostgreSQL backend ``pid`` waits on a lock (a fresh transaction per look: the
    activity view is a snapshot per transaction)."""
    with engine.connect() as probe:
        found = probe.execute(
            text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}
        ).scalar()
    return bool(found == "Lock")


class TestBadInput:
    """Wrong input fails at call time, before any SQL, naming the parameter."""

    def test_no_lease_and_no_token(self, engine: Engine, tables: dict[str, Table]) -> None:
        """Outside any lease and without token=: LeaseConfigError naming token=."""
        with pytest.raises(LeaseConfigError, match=r"token=None"):
            fenced_upsert(engine, tables["accounts"], where={"id": 1}, values={"balance": 1})
        assert row(engine, tables["accounts"], id=1) is None

    @pytest.mark.parametrize(
        ("kwargs", "names"),
        [
            ({"where": {"id": 1}, "values": {"balanse": 1}}, r"values=.*balanse"),
            ({"where": {"idd": 1}, "values": {"balance": 1}}, r"where=.*idd"),
            ({"where": {"id": 1}, "values": {"balance": 1}, "fence": "fnce"}, r"fence='fnce'"),
            ({"where": {"id": 1}, "values": {"fence": 9}}, r"fence column 'fence'"),
            ({"where": {"balance": 1}, "values": {}}, r"where=.*primary key or one unique"),
            ({"where": {}, "values": {"balance": 1}}, r"where=\{\} must name the row"),
            ({"where": {"id": None}, "values": {"balance": 1}}, r"where=.*None"),
            ({"where": {"id": 1}, "values": {"balance": 1}, "token": 0}, r"token=0"),
            ({"where": {"id": 1}, "values": {"balance": 1}, "token": True}, r"token=True"),
            (
                {"where": {"id": 1}, "values": {"balance": 1}, "token": 1, "lock_key": ""},
                r"lock_key=''",
            ),
        ],
    )
    @pytest.mark.parametrize("helper", [fenced_update, fenced_upsert])
    def test_bad_names_are_refused(
        self,
        engine: Engine,
        tables: dict[str, Table],
        kwargs: dict[str, Any],
        names: str,
        helper: Any,
    ) -> None:
        """Unknown columns, the fence in values=, a where= that is not a key, bad tokens."""
        kwargs.setdefault("token", 1)
        with pytest.raises(LeaseConfigError, match=names):
            helper(engine, tables["accounts"], **kwargs)
        assert row(engine, tables["accounts"], id=1) is None

    @pytest.mark.parametrize("helper", [fenced_update, fenced_upsert])
    def test_table_without_a_fence_column(
        self, engine: Engine, tables: dict[str, Table], helper: Any
    ) -> None:
        """A table with no fence column: LeaseConfigError naming fence= and the columns."""
        with pytest.raises(LeaseConfigError, match=r"fence='fence' is not a column.*balance"):
            helper(engine, tables["plain"], where={"id": 1}, values={"balance": 1}, token=1)

    @pytest.mark.parametrize("helper", [fenced_update, fenced_upsert])
    def test_fence_column_that_is_not_an_integer(
        self, engine: Engine, tables: dict[str, Table], helper: Any
    ) -> None:
        """A text fence would compare as text: refused, naming fence=."""
        with pytest.raises(LeaseConfigError, match=r"fence='fence'.*integer"):
            helper(engine, tables["textfence"], where={"id": 1}, values={"balance": 1}, token=1)

    @pytest.mark.parametrize("helper", [fenced_update, fenced_upsert])
    def test_partial_unique_index_does_not_name_a_row(
        self, engine: Engine, tables: dict[str, Table], helper: Any
    ) -> None:
        """A unique index with a WHERE holds for some rows only: it cannot be where=."""
        partial = tables["partial"]
        with engine.begin() as conn:  # two rows with one email: the index allows it
            conn.execute(
                partial.insert(),
                [
                    {"id": 1, "email": "a@x", "active": 1, "fence": None},
                    {"id": 2, "email": "a@x", "active": 0, "fence": None},
                ],
            )
        with pytest.raises(LeaseConfigError, match=r"where=.*primary key or one unique"):
            helper(engine, partial, where={"email": "a@x"}, values={"active": 0}, token=1)
        with engine.connect() as conn:
            assert conn.execute(select(partial.c.fence)).scalars().all() == [None, None]

    def test_bad_bind_and_target(self, tables: dict[str, Table]) -> None:
        """bind= and target= are checked too."""
        with pytest.raises(LeaseConfigError, match=r"bind="):
            fenced_update("sqlite://", tables["accounts"], where={"id": 1}, values={}, token=1)  # type: ignore[arg-type]
        with pytest.raises(LeaseConfigError, match=r"target="):
            fenced_update(create_engine("sqlite://"), object, where={"id": 1}, values={}, token=1)
