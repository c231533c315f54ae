"""What the PostgreSQL store and its asyncio twin share (``stores._postgres_common``): the
statements, the table's channel, reading a DSN, the options, rows and the texts of errors."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest

from celery_lease.errors import LeaseConfigError, StoreUnavailableError
from celery_lease.stores._postgres_common import (
    DEFAULT_TABLE,
    OVER_A_LIMIT,
    SCHEMA_SQL,
    ConnectFailures,
    channel_for,
    check_options,
    connect_kwargs,
    fold_pool_record,
    lease_info,
    missing_table_detail,
    notify_payload,
    parse_dsn,
    replace_plan,
    schema_sql,
    slot_plan,
    slot_range,
    statements,
    store_error,
    token_of,
)
from celery_lease.stores.base import LeaseInfo
from celery_lease.stores.slots import counter_key, marked, slot_key

_SQL = statements("leases")
_NAMES = {statement: name for name, statement in _SQL.items()}


def _drive(
    plan: Any, replies: dict[str, list[Any]]
) -> tuple[list[tuple[str, dict[str, Any]]], Any]:
    """Run a plan against canned replies (rows per statement name, ``[]`` when absent): the
    statements it sent, by name, and its result."""
    sent: list[tuple[str, dict[str, Any]]] = []
    rows: Any = None
    try:
        while True:
            statement, params = plan.send(rows)
            name = _NAMES[statement]
            sent.append((name, params))
            rows = replies.get(name, [])
    except StopIteration as stop:
        return sent, stop.value


class TestSlotPlan:
    """acquire_slot's transaction, decided from the rows of the key's slot range."""

    def test_the_counter_is_locked_before_the_slots_are_read(self) -> None:
        """Lock (create when missing), then read the range, then take the lowest free slot."""
        sent, got = _drive(
            slot_plan(_SQL, "k", "a", 1000, 2),
            {"take_slot": [(41,)]},
        )
        assert [name for name, _ in sent] == [
            "lock_counter",
            "create_counter",
            "slot_rows",
            "take_slot",
        ]
        assert sent[0][1] == {"key": counter_key("k")}
        assert sent[2][1] == slot_range("k") == {"first": "k\x1f", "end": "k "}
        assert sent[3][1]["key"] == slot_key("k", 0) and got == (0, 41)

    def test_every_live_slot_counts_and_only_canonical_slot_rows_are_slots(self) -> None:
        """A live slot above the limit counts; the counter, the ticket row and a row whose
        suffix is no canonical slot number are no slots; the counter's token and every slot's
        token floor the next one."""
        rows = [
            (counter_key("k"), None, 10, False),
            ("k\x1fticket", None, 99, False),
            ("k\x1f01", "x", 500, True),
            (slot_key("k", 0), None, 7, False),
            (slot_key("k", 5), "y", 12, True),
        ]
        sent, got = _drive(
            slot_plan(_SQL, "k", "a", 1000, 2),
            {"lock_counter": [(10,)], "slot_rows": rows, "take_slot": [(13,)]},
        )
        take = sent[-1][1]
        assert take["key"] == slot_key("k", 0) and take["last"] == 12 and got == (0, 13)
        _, refused = _drive(
            slot_plan(_SQL, "k", "a", 1000, 1),
            {"lock_counter": [(10,)], "slot_rows": rows},
        )
        assert refused is None

    def test_slots_read_expired_but_not_released_are_cleared_and_renewed_ones_read_again(
        self,
    ) -> None:
        """Such slots are cleared where still expired; one renewed since the read (not
        cleared) is read again and decides."""
        rows = [
            (slot_key("k", 0), "gone", 5, False),  # expired, not released: to clear
            (slot_key("k", 1), None, 6, False),  # released: free for sure
            (slot_key("k", 2), "x", 7, True),
            (slot_key("k", 3), "dead", 4, False),  # expired, not released: to clear
        ]
        sent, got = _drive(
            slot_plan(_SQL, "k", "a", 1000, 2),
            {
                "lock_counter": [(7,)],
                "slot_rows": rows,
                "clear_dead_slots": [(slot_key("k", 3), 4)],  # slot 0 was renewed meanwhile
                "recheck_slots": [(slot_key("k", 0), "gone", 5, True)],
            },
        )
        keys = [slot_key("k", 0), slot_key("k", 3)]
        assert sent[2] == ("clear_dead_slots", {"keys": keys})
        assert sent[3] == ("recheck_slots", {"keys": [slot_key("k", 0)]})
        assert got is None  # slots 0 and 2 held: limit 2 reached
        sent, got = _drive(
            slot_plan(_SQL, "k", "a", 1000, 2),
            {
                "lock_counter": [(7,)],
                "slot_rows": rows,
                "clear_dead_slots": [(slot_key("k", 0), 5), (slot_key("k", 3), 4)],
                "take_slot": [(8,)],
            },
        )
        assert [name for name, _ in sent] == [
            "lock_counter",
            "slot_rows",
            "clear_dead_slots",
            "take_slot",
        ]
        assert got == (0, 8)
        sent, _ = _drive(
            slot_plan(_SQL, "k", "a", 1000, 2),
            {"lock_counter": [(7,)], "slot_rows": rows[1:3], "take_slot": [(8,)]},
        )
        assert "clear_dead_slots" not in [name for name, _ in sent]

    def test_the_owner_again_renews_its_own_slot(self) -> None:
        """The owner's live slot: renewed, its token returned, nothing taken."""
        rows = [(slot_key("k", 0), "b", 5, True), (slot_key("k", 1), "a", 6, True)]
        sent, got = _drive(
            slot_plan(_SQL, "k", "a", 1000, 1),
            {"lock_counter": [(6,)], "slot_rows": rows, "extend": [(6,)]},
        )
        assert [name for name, _ in sent][-1] == "extend" and got == (1, 6)

    def test_an_own_slot_that_expired_meanwhile_is_free(self) -> None:
        """Renewing the owner's slot found it expired: the slot is free to take again."""
        rows = [(slot_key("k", 0), "a", 6, True)]
        sent, got = _drive(
            slot_plan(_SQL, "k", "a", 1000, 1),
            {"lock_counter": [(6,)], "slot_rows": rows, "extend": [], "take_slot": [(7,)]},
        )
        assert [name for name, _ in sent][-2:] == ["extend", "take_slot"] and got == (0, 7)

    def test_a_slot_found_live_at_the_write_is_a_refusal(self) -> None:
        """The guarded write took nothing (the slot was live after all): None."""
        _, got = _drive(slot_plan(_SQL, "k", "a", 1000, 1), {"lock_counter": [(1,)]})
        assert got is None


class TestReplacePlan:
    """mark_replaced's transaction: where the holder's token and the ticket go."""

    def test_a_free_key_draws_the_ticket_into_its_own_row(self) -> None:
        sent, got = _drive(
            replace_plan(_SQL, "k", None, None),
            {"lock_key": [(None, 5, False)], "draw_ticket": [(9,)]},
        )
        assert sent == [("lock_key", {"key": "k"}), ("draw_ticket", {"key": "k"})]
        assert got == (9, None, False)

    def test_marking_keeps_the_holders_token_before_the_ticket_is_drawn(self) -> None:
        sent, got = _drive(
            replace_plan(_SQL, "k", None, None),
            {"lock_key": [("a", 5, True)], "draw_ticket": [(9,)]},
        )
        assert sent[1:] == [
            ("save_holder", {"key": "k\x1fholder", "token": 5}),
            ("mark", {"key": "k", "owner": "a", "marked": marked("a")}),
            ("draw_ticket", {"key": "k"}),
        ]
        assert got == (9, "a", True)

    def test_a_given_ticket_draws_nothing_and_another_holder_is_left_alone(self) -> None:
        sent, got = _drive(replace_plan(_SQL, "k", 3, "b"), {"lock_key": [("a", 5, True)]})
        assert [name for name, _ in sent] == ["lock_key"] and got == (3, "a", False)

    def test_a_ticket_for_another_unmarked_holder_is_set_aside_in_the_holder_row(self) -> None:
        """The key's row carries that holder's token: the ticket goes to the holder row."""
        sent, got = _drive(
            replace_plan(_SQL, "k", None, "b"),
            {"lock_key": [("a", 5, True)], "set_aside_ticket": [(9,)]},
        )
        params = {"key": "k", "holder": "k\x1fholder"}
        assert sent[1:] == [("set_aside_ticket", params)] and got == (9, "a", False)

    def test_a_marked_holder_is_not_marked_twice_and_its_row_counts_tickets(self) -> None:
        sent, got = _drive(
            replace_plan(_SQL, "k", None, "x"),
            {"lock_key": [(marked("a"), 12, True)], "draw_ticket": [(13,)]},
        )
        assert [name for name, _ in sent] == ["lock_key", "draw_ticket"]
        assert got == (13, "a", False)
        sent, got = _drive(replace_plan(_SQL, "k", 3, "a"), {"lock_key": [(marked("a"), 5, True)]})
        assert [name for name, _ in sent] == ["lock_key"] and got == (3, "a", True)


class TestStatements:
    """One source of the store's SQL, rendered for a validated table."""

    def test_every_statement_names_the_quoted_table(self) -> None:
        """Each statement is rendered with the (schema-qualified) table quoted in."""
        rendered = statements("ops.leases")
        assert set(rendered) == {
            "acquire",
            "renew",
            "renew_many",
            "release",
            "force_release",
            "get",
            "list",
            "last_token",
            "schema",
            "release_slots",
            "lock_counter",
            "create_counter",
            "slot_rows",
            "clear_dead_slots",
            "recheck_slots",
            "extend",
            "take_slot",
            "lock_key",
            "draw_ticket",
            "set_aside_ticket",
            "save_holder",
            "mark",
            "key_collation",
        }
        assert all(b'"ops"."leases"' in statement for statement in rendered.values())

    def test_schema_of_the_default_table(self) -> None:
        """SCHEMA_SQL is schema_sql() of the default table."""
        assert schema_sql() == SCHEMA_SQL
        assert f'"{DEFAULT_TABLE}"' in SCHEMA_SQL

    def test_channels_are_readable_when_short_and_hashed_when_long(self) -> None:
        """pg_notify refuses channel names over 63 bytes: long table names are hashed."""
        assert channel_for("leases") == "celery_lease:leases"
        long = channel_for("s" * 40 + "." + "t" * 40)
        assert long.startswith("celery_lease:") and len(long) <= 63


class TestOptions:
    """Both stores refuse the same bad options, in the same order."""

    @pytest.mark.parametrize(
        ("options", "named"),
        [
            (("bad-name", 0, 0, "x"), "table="),
            ((DEFAULT_TABLE, 0, 0, "x"), "create_table="),
            ((DEFAULT_TABLE, 0, 0, None), "connect_timeout="),
            ((DEFAULT_TABLE, True, 8, None), "connect_timeout="),
            ((DEFAULT_TABLE, 5.0, 0, None), "max_connections="),
        ],
    )
    def test_the_first_bad_option_is_named(self, options: tuple[object, ...], named: str) -> None:
        """table, create_table, connect_timeout, max_connections: the first bad one is named."""
        with pytest.raises(LeaseConfigError, match=named):
            check_options(*options)

    def test_good_options_give_the_table(self) -> None:
        """The validated table name comes back."""
        assert check_options("ops.leases", 5.0, 8, None) == "ops.leases"


class TestDSNs:
    """A DSN or store URL is read once, the same way for both stores."""

    def test_create_table_leaves_the_url_and_the_rest_is_kept(self) -> None:
        """?create_table= is the store's; libpq gets the other options byte for byte."""
        parsed = parse_dsn("postgresql://u@h:5433/db?sslmode=disable&create_table=no", None)
        assert parsed.dsn == "postgresql://u@h:5433/db?sslmode=disable"
        assert parsed.create_table is False
        assert parsed.where == "host='h', port=5433, dbname='db'"
        assert parsed.application_name is True

    def test_the_keyword_wins_when_the_url_is_silent(self) -> None:
        """create_table= alone decides when the URL has no ?create_table=."""
        assert parse_dsn("postgresql://h/db", True).create_table is True
        assert parse_dsn("postgresql://h/db", None).create_table is None

    def test_a_contradiction_is_refused(self) -> None:
        """The keyword and the URL must not disagree."""
        with pytest.raises(LeaseConfigError, match="contradicts"):
            parse_dsn("postgresql://h/db?create_table=true", False)

    def test_every_form_of_the_password_is_kept_for_masking(self) -> None:
        """The raw (percent-encoded) and the decoded password, longest first."""
        parsed = parse_dsn("postgresql://u:p%2Fw@h/db", None)
        assert parsed.secrets == ("p%2Fw", "p/w")

    def test_a_dsn_naming_its_application_keeps_it(self) -> None:
        """The store names its connections only when the DSN does not."""
        parsed = parse_dsn("host=h dbname=db application_name=mine", None)
        assert parsed.application_name is False
        assert "application_name" not in connect_kwargs(5.0, parsed.application_name)
        assert connect_kwargs(0.2, True) == {
            "autocommit": True,
            "connect_timeout": 1,
            "application_name": "celery-lease",
        }


class TestRowsAndErrors:
    """Rows become leases and tokens; errors say what to do, never a password."""

    def test_rows(self) -> None:
        """(key, owner, token, expires_in) is a LeaseInfo; a RETURNING row is a token."""
        assert lease_info(("k", "o", "7", 1.5)) == LeaseInfo("k", "o", 7, 1.5)
        assert token_of((42,)) == 42
        assert token_of(None) is None

    def test_store_errors_mask_passwords(self) -> None:
        """Every secret is replaced in the message."""
        error = store_error("Store(pw)", "acquire 'k'", "failed: pw rejected", ("pw",))
        assert isinstance(error, StoreUnavailableError)
        assert str(error) == "Store(***) failed to acquire 'k': failed: *** rejected"

    def test_a_missing_table_says_how_to_create_it(self) -> None:
        """With create_table=False the message names schema_sql(); allowed: no refusal."""
        missing = psycopg.errors.UndefinedTable("relation does not exist")
        detail = missing_table_detail(missing, "leases", create_table=False)
        assert detail is not None and "PostgresLockStore.schema_sql('leases')" in detail
        assert missing_table_detail(missing, "leases", create_table=True) is None


class TestNotifyPayload:
    def test_a_key_up_to_1000_bytes_is_its_own_payload(self) -> None:
        assert notify_payload("job:1") == "job:1"
        assert notify_payload("é" * 500) == "é" * 500  # 1000 bytes

    def test_a_longer_key_is_announced_by_a_fixed_size_digest(self) -> None:
        """1001 bytes and 9000 bytes both become ``sha256:`` and 64 hex digits, per key."""
        long_a, long_b = "é" * 500 + "x", "x" * 9000
        assert notify_payload(long_a).startswith("sha256:") and len(notify_payload(long_a)) == 71
        assert len(notify_payload(long_b)) == 71
        assert notify_payload(long_b) != notify_payload(long_b + "y")


class TestServerLimits:
    def test_every_code_of_the_limit_class_is_never_retried(self) -> None:
        """Each psycopg error of SQLSTATE class 54 (a server limit exceeded) is in OVER_A_LIMIT,
        the errors the stores raise at once instead of retrying as a dropped connection."""
        class_54 = {
            error
            for error in vars(psycopg.errors).values()
            if isinstance(error, type)
            and issubclass(error, psycopg.Error)
            and str(getattr(error, "sqlstate", "") or "").startswith("54")
        }
        assert class_54, "psycopg names no error of class 54"
        assert class_54 == set(OVER_A_LIMIT)


class TestOutageLines:
    """psycopg_pool's records about the stores' own pools are folded into one line per outage."""

    @staticmethod
    def record(msg: str, *args: object, level: int = logging.WARNING) -> logging.LogRecord:
        return logging.LogRecord("psycopg.pool", level, "pool.py", 1, msg, args, None)

    def test_records_about_the_stores_own_pools_are_dropped(self) -> None:
        class Own:
            celery_lease_own_connection = True

        for dropped in (
            self.record("error connecting in %r: %s", "celery-lease", "refused"),
            self.record("error connecting in %r: %s", "celery-lease-async", "refused"),
            self.record("discarding broken connection: %s", Own()),
            self.record("discarding closed connection: %s", Own()),
            self.record("reconnection attempt in pool %r failed after %s sec", "celery-lease", 1.0),
        ):
            assert fold_pool_record(dropped) is False, dropped.getMessage()

    def test_records_about_other_pools_and_below_warning_are_kept(self) -> None:
        for kept in (
            self.record("error connecting in %r: %s", "the-apps-pool", "refused"),
            self.record("discarding broken connection: %s", object()),
            self.record("growing pool %r to %s", "celery-lease", 2, level=logging.INFO),
        ):
            assert fold_pool_record(kept) is True, kept.getMessage()

    def test_only_the_outage_records_of_the_stores_own_pools_are_dropped(self) -> None:
        """What ConnectFailures does not say instead is kept, even about the stores' own pools:
        a connection returned mid-query or in a transaction, a worker thread that would not
        stop; and a user's pool (one whose name only starts like ours too)."""

        class Own:
            celery_lease_own_connection = True

        for kept in (
            self.record("closing returned connection: %s", Own()),
            self.record("rolling back returned connection: %s", Own()),
            self.record("reconnection attempt in pool %r failed after %s sec", "the-apps", 300),
            self.record("couldn't stop thread %r within %s seconds", "celery-lease-worker-0", 5.0),
            self.record("error connecting in %r: %s", "celery-leases-orders", "refused"),
            self.record("error connecting in %r: %s", "celery-lease-async-orders", "refused"),
        ):
            assert fold_pool_record(kept) is True, kept.getMessage()

    def test_the_filter_is_on_psycopg_pools_logger(self) -> None:
        assert fold_pool_record in logging.getLogger("psycopg.pool").filters

    def test_one_warning_per_outage_and_one_line_when_it_ends(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        failures = ConnectFailures("PostgresLockStore(host='db')")
        with caplog.at_level(logging.INFO, logger="celery_lease.stores.postgres"):
            failures.connected()  # the first connect: nothing to say
            for _ in range(2):
                for _ in range(3):
                    failures.failed("connection failed: refused\n\tIs the server running?")
                failures.connected()
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 4, lines
        down, back = lines[0], lines[1]
        assert down.startswith("celery-lease: PostgresLockStore(host='db') cannot connect")
        assert "refused Is the server running?" in down  # one line
        assert back.endswith("connected again after 3 failed attempts")
        assert lines[2:] == [down, back]
        assert failures.last is None
