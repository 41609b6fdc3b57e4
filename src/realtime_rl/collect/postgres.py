"""The Postgres event store (psycopg 3): one database for several gateways and trainers.

    store = PostgresEventStore("postgresql://127.0.0.1:5432/test")
    store = PostgresEventStore("postgresql://127.0.0.1:5432/test?options=-csearch_path%3Drun42")  # a schema

Tables live in the connection's current schema (the first of `search_path` that exists; pass
`options=-csearch_path=NAME` in the URL to pick one, which must exist) and are created if missing.

Durability: the session sets `synchronous_commit = on`, so COMMIT returns only after the WAL record is
flushed to disk, whatever the server's default; an acknowledged write survives a killed gateway and a
crashed or powered-off database server. A server running with `fsync = off` cannot keep that promise:
the store logs a warning when it sees one.

Concurrency: every write transaction takes a transaction-scoped advisory lock named after its table
(and schema) before choosing `seq`, so writers from any number of processes are serialized and `seq`
follows commit order (readers are never blocked: MVCC). Every statement is bounded by
`statement_timeout_s` (lock waits included); a broken connection is replaced on the next call.

A choice's text and content may hold NUL (U+0000), which PostgreSQL's text cannot: such a text (or one
starting with TEXT_MARK) is stored as TEXT_MARK + its JSON string and read back exactly.

Not here: a connection pool (one connection per store object; the gateway groups its writes),
retention or pruning.
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

from realtime_rl.collect.base import CHOICE_COLUMNS, EVENT_COLUMNS, ChoiceRecord
from realtime_rl.collect.sql import SqlEventStore

log = logging.getLogger(__name__)


def redact(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


TEXT_MARK = "\x01rtrl-json:"
"""Prefix of a choice's text (or content) stored as its JSON string: PostgreSQL's text cannot hold NUL (U+0000),
which a model can generate (a byte-level tokenizer has a token for it). A text that starts with the mark is
stored so too, so that a stored text starting with it is always an encoded one."""
_CHOICE_TEXTS = (CHOICE_COLUMNS.index("text"), CHOICE_COLUMNS.index("content"))


def stored_text(text: str | None) -> str | None:
    if text is None or ("\x00" not in text and not text.startswith(TEXT_MARK)):
        return text
    return TEXT_MARK + json.dumps(text)  # JSON escapes every control character: no NUL is left


def read_text(stored: str | None) -> str | None:
    return json.loads(stored[len(TEXT_MARK):]) if stored is not None and stored.startswith(TEXT_MARK) else stored


class PostgresEventStore(SqlEventStore):
    placeholder = "%s"

    def __init__(self, url: str, connect_timeout_s: float = 10.0, statement_timeout_s: float = 60.0,
                 lock_timeout_s: float = 90.0) -> None:
        super().__init__(lock_timeout_s)
        self.url = url
        self.connect_timeout_s = connect_timeout_s
        self.statement_timeout_s = statement_timeout_s
        self._conn = self._connect()
        try:
            schema = self._conn.execute("SELECT current_schema()").fetchone()[0]
            if schema is None:
                raise ValueError(f"{redact(url)}: no schema of the search_path exists; create it first "
                                 "(CREATE SCHEMA name) or leave search_path at its default")
            self.schema: str = schema
            if self._conn.execute("SHOW fsync").fetchone()[0] == "off":
                log.warning("the Postgres server runs with fsync=off: acknowledged events may be lost if it crashes")
            self._create_schema(blob="BYTEA")
        except BaseException:
            self._conn.close()
            raise

    def _connect(self) -> psycopg.Connection:
        # A server that vanishes (a failover, a host powered off) fails a write within about statement_timeout,
        # not when the kernel gives up on the socket (15 minutes with data unacknowledged, hours idle): the
        # server's statement_timeout cannot fire when the server is gone.
        timeout_ms = int(self.statement_timeout_s * 1000)
        try:
            conn = psycopg.connect(self.url, autocommit=True, connect_timeout=max(1, round(self.connect_timeout_s)),
                                   tcp_user_timeout=timeout_ms, keepalives=1, keepalives_idle=10,
                                   keepalives_interval=5, keepalives_count=3)
        except psycopg.Error as e:
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise ValueError(f"cannot open the Postgres event store at {redact(self.url)}: {reason}") from None
        try:
            conn.execute("SET synchronous_commit = on")
            # float8 as text: 3 round-trips on every server version (12+ defaults to 1; a role or database may set 0:
            # 15 digits, so a retry's 0.1 + 0.2 read back as 0.3 was a conflict, and stored times were rounded)
            conn.execute("SET extra_float_digits = 3")
            conn.execute(f"SET statement_timeout = {timeout_ms}")
        except BaseException:
            conn.close()
            raise
        return conn

    @contextmanager
    def _locked(self) -> Iterator[Any]:
        with super()._locked() as conn:
            if conn.broken or conn.closed:  # the server restarted or the network dropped: reconnect once
                log.warning("the Postgres connection is broken; reconnecting")
                self._conn = conn = self._connect()
            yield conn

    def _choice_row(self, completion_id: str, choice: ChoiceRecord) -> tuple[Any, ...]:
        row = list(super()._choice_row(completion_id, choice))
        for i in _CHOICE_TEXTS:
            row[i] = stored_text(row[i])
        return tuple(row)

    def _choice_from_row(self, row: tuple[Any, ...]) -> ChoiceRecord:
        row = list(row)
        for i in _CHOICE_TEXTS:
            row[i] = read_text(row[i])
        return super()._choice_from_row(tuple(row))

    def _clock(self, conn: psycopg.Connection) -> float:
        # The server's: gateways and the trainer on several hosts stamp and read one clock, so an event stamped
        # before a horizon is committed by then whatever the hosts' clocks say (a gateway 3 s behind the trainer
        # stamped events the ledger then called late).
        return float(conn.execute("SELECT EXTRACT(EPOCH FROM clock_timestamp())").fetchone()[0])

    def _begin_write(self, conn: psycopg.Connection, table: str) -> None:
        # READ COMMITTED whatever the role's default: under REPEATABLE READ the snapshot would be taken by the lock's
        # SELECT, before the wait ends, and miss the previous writer's rows (a retry then broke the primary key)
        conn.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"{self.schema}.{table}.realtime_rl",))

    def _in_ids(self, column: str, ids: list[str]) -> tuple[str, tuple[Any, ...]]:
        return f"{column} = ANY(%s)", (ids,)

    def _insert_events(self, conn: psycopg.Connection, rows: list[tuple[Any, ...]]) -> None:
        # COPY: one statement for the whole group (a multi-row INSERT plans and runs row by row); the ids
        # are known to be new, so no ON CONFLICT is needed.
        with conn.cursor() as cur, cur.copy(f"COPY feedback_events ({', '.join(EVENT_COLUMNS)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)

    def setting(self, name: str) -> str:
        """A setting of this store's session (tests check synchronous_commit)."""
        if name not in ("synchronous_commit", "fsync", "search_path", "statement_timeout"):
            raise ValueError(f"unknown setting {name!r}")
        with self._locked() as conn:
            return conn.execute(f"SHOW {name}").fetchone()[0]
