"""The SQL both stores share: the schema, and every read and write, written once over a DB-API connection.

`SqliteEventStore` and `PostgresEventStore` differ only in how they connect, how a write transaction
starts (SQLite: `BEGIN IMMEDIATE` takes the database's write lock; Postgres: `BEGIN`, then an advisory
lock on the table, held to the commit), the placeholder (`?` or `%s`) and how a list of ids is passed.
Writers of a table are serialized across threads and processes, so `seq` (the previous maximum + 1)
follows commit order: a reader's cursor never skips a row that commits later with a smaller seq.

One connection per store object, shared by the process's threads behind a lock whose wait is bounded
(`lock_timeout_s`). The gateway writes feedback through a GroupCommitter (group.py): many requests,
one transaction, one fsync.
"""

from __future__ import annotations

import contextlib
import threading
import time
from abc import abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from realtime_rl.collect.base import (
    CHOICE_COLUMNS, COMPLETION_COLUMNS, EVENT_COLUMNS, ChoiceRecord, CompletionRecord, EventBatchResult, EventStore,
    FeedbackEvent, choice_from_row, choice_row, completion_from_row, completion_row, event_from_row, event_row,
)

# Portable DDL: the same statements run on SQLite and PostgreSQL; {blob} is BLOB or BYTEA.
SCHEMA = """
CREATE TABLE IF NOT EXISTS completions (
    completion_id TEXT PRIMARY KEY,
    seq BIGINT NOT NULL UNIQUE,
    created_at DOUBLE PRECISION NOT NULL,
    recorded_at DOUBLE PRECISION NOT NULL,
    user_id TEXT,
    session_id TEXT,
    api_key_name TEXT,
    model_name TEXT NOT NULL,
    model_version BIGINT NOT NULL,
    prompt_token_ids TEXT NOT NULL,
    request_json TEXT NOT NULL,
    num_choices INTEGER NOT NULL,
    stream BOOLEAN NOT NULL,
    latency_s DOUBLE PRECISION NOT NULL,
    queued_s DOUBLE PRECISION NOT NULL,
    first_token_s DOUBLE PRECISION NOT NULL,
    arm TEXT NOT NULL DEFAULT 'champion'
);
CREATE INDEX IF NOT EXISTS completions_created_at ON completions (created_at);
CREATE TABLE IF NOT EXISTS completion_choices (
    completion_id TEXT NOT NULL REFERENCES completions (completion_id),
    choice_index INTEGER NOT NULL,
    finish_reason TEXT NOT NULL,
    token_ids TEXT NOT NULL,
    logprobs TEXT NOT NULL,
    raw_logprobs TEXT NOT NULL,
    versions TEXT NOT NULL,
    text TEXT NOT NULL,
    content TEXT,
    tool_calls TEXT NOT NULL,
    tool_call_errors TEXT NOT NULL,
    malformed_tool_calls INTEGER NOT NULL,
    routing {blob},
    routing_shape TEXT,
    routing_dtype TEXT,
    PRIMARY KEY (completion_id, choice_index)
);
CREATE TABLE IF NOT EXISTS feedback_events (
    event_id TEXT PRIMARY KEY,
    seq BIGINT NOT NULL UNIQUE,
    type TEXT NOT NULL,
    completion_id TEXT,
    session_id TEXT,
    choice_index INTEGER,
    name TEXT,
    value DOUBLE PRECISION,
    window_s DOUBLE PRECISION,
    tool_call_id TEXT,
    tool_name TEXT,
    error_type TEXT,
    user_id TEXT,
    attributes TEXT NOT NULL,
    occurred_at DOUBLE PRECISION,
    recorded_at DOUBLE PRECISION NOT NULL,
    api_key_name TEXT
);
CREATE INDEX IF NOT EXISTS feedback_events_completion ON feedback_events (completion_id);
CREATE INDEX IF NOT EXISTS feedback_events_session ON feedback_events (session_id);
CREATE INDEX IF NOT EXISTS feedback_events_recorded_at ON feedback_events (recorded_at)
"""
# No foreign key from feedback_events to completions: an event may arrive before its completion.

# Columns added after the first release, with the DDL that adds each to a database created before it.
ADDED_COLUMNS = {
    ("completions", "arm"): "ALTER TABLE completions ADD COLUMN arm TEXT NOT NULL DEFAULT 'champion'",
}


def schema_statements(blob: str) -> list[str]:
    return [s.strip() for s in SCHEMA.format(blob=blob).split(";") if s.strip()]


def _columns(columns: tuple[str, ...], prefix: str = "") -> str:
    return ", ".join(prefix + c for c in columns)


def _time_window(where: list[str], args: list[Any], column: str, since: float | None, until: float | None) -> None:
    """Add `since <= column < until` (either bound optional) to a WHERE clause being built."""
    if since is not None:
        where.append(f"{column} >= ?")
        args.append(since)
    if until is not None:
        where.append(f"{column} < ?")
        args.append(until)


class SqlEventStore(EventStore):
    placeholder = "?"

    def __init__(self, lock_timeout_s: float) -> None:
        self.lock_timeout_s = lock_timeout_s
        self._lock = threading.Lock()
        self._conn: Any = None

    # ------------------------------------------------------------------ what each backend supplies

    @abstractmethod
    def _begin_write(self, conn: Any, table: str) -> None:
        """Start a transaction that holds `table`'s write lock (across processes) until it ends."""

    @abstractmethod
    def _in_ids(self, column: str, ids: list[str]) -> tuple[str, tuple[Any, ...]]:
        """A WHERE fragment "column is one of ids" and its parameters."""

    def _clock(self, conn: Any) -> float:
        """Now, in unix seconds, as this store stamps `recorded_at` and reads `event_horizon`: one clock for both,
        so that "stamped before the horizon" means what it says. This process's (SQLite: one host)."""
        return time.time()

    def _insert_events(self, conn: Any, rows: list[tuple[Any, ...]]) -> None:
        """Insert rows of EVENT_COLUMNS whose ids are known to be new (checked under the write lock)."""
        cur = conn.cursor()
        cur.executemany(self._q(f"INSERT INTO feedback_events ({_columns(EVENT_COLUMNS)}) "
                                f"VALUES ({', '.join('?' for _ in EVENT_COLUMNS)})"), rows)
        cur.close()

    def _close_connection(self, conn: Any) -> None:
        conn.close()

    # ------------------------------------------------------------------ plumbing

    def _q(self, sql: str) -> str:
        return sql if self.placeholder == "?" else sql.replace("?", self.placeholder)

    @contextmanager
    def _locked(self) -> Iterator[Any]:
        if not self._lock.acquire(timeout=self.lock_timeout_s):
            raise TimeoutError(f"event store busy for more than {self.lock_timeout_s} s")
        try:
            if self._conn is None:
                raise RuntimeError("the event store is closed")
            yield self._conn
        finally:
            self._lock.release()

    @contextmanager
    def _write(self, table: str) -> Iterator[Any]:
        """A write transaction on `table`: committed (durably) when the block ends, rolled back on error."""
        with self._locked() as conn:
            try:
                self._begin_write(conn, table)  # inside: a lock wait that times out leaves no open transaction
                yield conn
                conn.execute("COMMIT")  # inside too: a COMMIT that fails (busy, I/O) must not leave it open
            except BaseException:
                with contextlib.suppress(Exception):  # a broken connection cannot roll back; keep the first error
                    conn.execute("ROLLBACK")
                raise

    def _create_schema(self, blob: str) -> None:
        """Create missing tables, and add the columns a database of an older schema lacks (in one
        transaction under the schema lock, so stores opening at once never both add a column)."""
        with self._write("schema") as conn:
            for statement in schema_statements(blob):
                conn.execute(statement)
            for (table, column), alter in ADDED_COLUMNS.items():
                cur = conn.execute(f"SELECT * FROM {table} WHERE 1 = 0")
                if column not in {d[0] for d in cur.description}:
                    conn.execute(alter)

    def close(self) -> None:
        """Idempotent; waits for a running call (bounded by lock_timeout_s)."""
        if not self._lock.acquire(timeout=self.lock_timeout_s):
            raise TimeoutError(f"event store busy for more than {self.lock_timeout_s} s")
        try:
            if self._conn is not None:
                self._close_connection(self._conn)
                self._conn = None
        finally:
            self._lock.release()

    # ------------------------------------------------------------------ completions

    def add_completion(self, record: CompletionRecord) -> int:
        q = self._q
        with self._write("completions") as conn:
            if conn.execute(q("SELECT 1 FROM completions WHERE completion_id = ?"), (record.completion_id,)).fetchone():
                raise ValueError(f"completion {record.completion_id} is already recorded")
            seq = conn.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM completions").fetchone()[0]
            recorded_at = self._clock(conn)
            row = completion_row(record)
            conn.execute(q(f"INSERT INTO completions ({_columns(COMPLETION_COLUMNS)}) "
                           f"VALUES ({', '.join('?' for _ in COMPLETION_COLUMNS)})"),
                         (row[0], seq, row[2], recorded_at, *row[4:]))
            cur = conn.cursor()
            cur.executemany(q(f"INSERT INTO completion_choices ({_columns(CHOICE_COLUMNS)}) "
                              f"VALUES ({', '.join('?' for _ in CHOICE_COLUMNS)})"),
                            [self._choice_row(record.completion_id, c) for c in record.choices])
            cur.close()
        record.seq, record.recorded_at = seq, recorded_at
        return seq

    def _choices(self, conn: Any, completion_ids: list[str]) -> dict[str, list[ChoiceRecord]]:
        if not completion_ids:
            return {}
        where, args = self._in_ids("completion_id", completion_ids)
        rows = conn.execute(self._q(f"SELECT {_columns(CHOICE_COLUMNS)} FROM completion_choices WHERE {where} "
                                    "ORDER BY completion_id, choice_index"), args).fetchall()
        out: dict[str, list[ChoiceRecord]] = {}
        for r in rows:
            out.setdefault(r[0], []).append(self._choice_from_row(r))
        return out

    def _choice_row(self, completion_id: str, choice: ChoiceRecord) -> tuple[Any, ...]:
        """A choice as its table row (a backend whose text cannot hold some characters encodes them here)."""
        return choice_row(completion_id, choice)

    def _choice_from_row(self, row: tuple[Any, ...]) -> ChoiceRecord:
        return choice_from_row(row)

    def get_completion(self, completion_id: str) -> CompletionRecord | None:
        with self._locked() as conn:
            row = conn.execute(self._q(f"SELECT {_columns(COMPLETION_COLUMNS)} FROM completions "
                                       "WHERE completion_id = ?"), (completion_id,)).fetchone()
            if row is None:
                return None
            return completion_from_row(row, self._choices(conn, [completion_id])[completion_id])

    def list_completions(self, *, since: float | None = None, until: float | None = None, after_seq: int = 0,
                         limit: int = 1000) -> list[CompletionRecord]:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        where, args = ["seq > ?"], [after_seq]
        _time_window(where, args, "created_at", since, until)
        with self._locked() as conn:
            rows = conn.execute(self._q(f"SELECT {_columns(COMPLETION_COLUMNS)} FROM completions "
                                        f"WHERE {' AND '.join(where)} ORDER BY seq LIMIT ?"), (*args, limit)).fetchall()
            choices = self._choices(conn, [r[0] for r in rows])
            return [completion_from_row(r, choices[r[0]]) for r in rows]

    def count_completions(self) -> int:
        with self._locked() as conn:
            return conn.execute("SELECT COUNT(*) FROM completions").fetchone()[0]

    # ------------------------------------------------------------------ feedback events

    def add_event_batches(self, batches: list[list[FeedbackEvent]]) -> list[EventBatchResult]:
        ids = list({e.event_id for batch in batches for e in batch})
        results = [EventBatchResult() for _ in batches]
        written: list[tuple[FeedbackEvent, int]] = []
        with self._write("feedback_events") as conn:
            # Only ids already stored come back (retries: few); a new event's content is never compared.
            where, args = self._in_ids("event_id", ids)
            known = {r[0]: event_from_row(r).content_key() for r in conn.execute(
                self._q(f"SELECT {_columns(EVENT_COLUMNS)} FROM feedback_events WHERE {where}"), args).fetchall()}
            seq = conn.execute("SELECT COALESCE(MAX(seq), 0) FROM feedback_events").fetchone()[0]
            recorded_at = self._clock(conn)
            rows = []
            for batch, result in zip(batches, results):
                new: dict[str, FeedbackEvent] = {}
                for e in batch:
                    prior = known.get(e.event_id)
                    if prior is None and e.event_id in new:
                        prior = new[e.event_id].content_key()
                    if prior is None:
                        new[e.event_id] = e
                    elif prior == e.content_key():
                        result.duplicates.append(e.event_id)
                    else:
                        result.conflicts.append(e.event_id)
                if result.conflicts:  # the batch is atomic: none of it is written
                    result.duplicates = []
                    continue
                for event_id, e in new.items():
                    seq += 1
                    rows.append(event_row(e, seq, recorded_at))
                    written.append((e, seq))
                    known[event_id] = e.content_key()
                    result.stored.append(event_id)
            if rows:
                self._insert_events(conn, rows)
        for e, s in written:  # only once committed
            e.seq, e.recorded_at = s, recorded_at
        return results

    def _event_filter(self, completion_id: str | None, session_id: str | None, since: float | None,
                      until: float | None, after_seq: int, limit: int, joined: bool) -> tuple[str, list[Any]]:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        where, args = ["e.seq > ?"], [after_seq]
        if completion_id is not None:
            where.append("e.completion_id = ?")
            args.append(completion_id)
        if session_id is not None:
            where.append("(e.session_id = ? OR c.session_id = ?)" if joined else "e.session_id = ?")
            args += [session_id, session_id] if joined else [session_id]
        _time_window(where, args, "e.recorded_at", since, until)
        return " AND ".join(where), [*args, limit]

    def list_events(self, *, completion_id: str | None = None, session_id: str | None = None,
                    since: float | None = None, until: float | None = None, after_seq: int = 0,
                    limit: int = 1000) -> list[FeedbackEvent]:
        where, args = self._event_filter(completion_id, session_id, since, until, after_seq, limit, joined=False)
        with self._locked() as conn:
            rows = conn.execute(self._q(f"SELECT {_columns(EVENT_COLUMNS, 'e.')} FROM feedback_events e "
                                        f"WHERE {where} ORDER BY e.seq LIMIT ?"), args).fetchall()
        return [event_from_row(r) for r in rows]

    def join_events(self, *, completion_id: str | None = None, session_id: str | None = None,
                    since: float | None = None, until: float | None = None, after_seq: int = 0,
                    limit: int = 1000) -> list[tuple[FeedbackEvent, CompletionRecord | None]]:
        where, args = self._event_filter(completion_id, session_id, since, until, after_seq, limit, joined=True)
        n = len(EVENT_COLUMNS)
        with self._locked() as conn:
            rows = conn.execute(self._q(
                f"SELECT {_columns(EVENT_COLUMNS, 'e.')}, {_columns(COMPLETION_COLUMNS, 'c.')} FROM feedback_events e "
                f"LEFT JOIN completions c ON c.completion_id = e.completion_id WHERE {where} ORDER BY e.seq LIMIT ?"),
                args).fetchall()
            choices = self._choices(conn, list({r[n] for r in rows if r[n] is not None}))
        completions = {cid: completion_from_row(r[n:], choices[cid]) for r in rows if (cid := r[n]) is not None}
        return [(event_from_row(r[:n]), completions.get(r[n])) for r in rows]

    def count_events(self) -> int:
        with self._locked() as conn:
            return conn.execute("SELECT COUNT(*) FROM feedback_events").fetchone()[0]

    def event_horizon(self) -> float:
        # Taken under the events' write lock, which each write holds from its stamp to its commit: any write
        # stamped earlier has committed (visibly, before its lock went) by the time this one holds it.
        with self._write("feedback_events") as conn:
            return self._clock(conn)
