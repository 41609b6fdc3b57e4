"""The default event store: one SQLite file (`run_dir/events.sqlite`) in WAL mode.

Durability: `journal_mode=WAL` with `synchronous=FULL`, so every commit fsyncs the WAL before
`add_completion` returns: an acknowledged completion survives a killed process and a power cut. (With
NORMAL a commit survives a killed process but the last ones may be lost on power failure, which would
break "an acknowledged event is on disk".) A record and its choices are written in one
`BEGIN IMMEDIATE` transaction, which also serializes writers from several processes, so `seq` (the
previous maximum + 1) is unique and increasing.

One connection serves every thread of the process behind a lock; waits are bounded: the lock by
`lock_timeout_s`, SQLite's own file locks (another process writing) by `busy_timeout_s`.

Not here: Postgres (several gateways and trainers; the real-time loop issue), retention or pruning.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from realtime_rl.collect.base import (
    CHOICE_COLUMNS, COMPLETION_COLUMNS, ChoiceRecord, CompletionRecord, EventStore, choice_from_row, choice_row,
    completion_from_row, completion_row,
)

# Portable SQL: the same types and statements are valid in PostgreSQL (with BYTEA for BLOB).
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
    first_token_s DOUBLE PRECISION NOT NULL
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
    routing BLOB,
    routing_shape TEXT,
    routing_dtype TEXT,
    PRIMARY KEY (completion_id, choice_index)
);
"""


def _placeholders(columns: tuple[str, ...]) -> str:
    return ", ".join("?" for _ in columns)


class SqliteEventStore(EventStore):
    def __init__(self, path: str | Path, busy_timeout_s: float = 10.0, lock_timeout_s: float = 30.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lock_timeout_s = lock_timeout_s
        self._lock = threading.Lock()
        # isolation_level=None: no implicit transactions; we BEGIN and COMMIT ourselves.
        self._conn: sqlite3.Connection | None = sqlite3.connect(
            self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise ValueError(f"{self.path}: SQLite refused WAL mode (got {mode}); is it on a network filesystem?")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        self._conn.executescript(SCHEMA)

    @contextmanager
    def _locked(self) -> Iterator[sqlite3.Connection]:
        if not self._lock.acquire(timeout=self.lock_timeout_s):
            raise TimeoutError(f"event store busy for more than {self.lock_timeout_s} s")
        try:
            if self._conn is None:
                raise RuntimeError("the event store is closed")
            yield self._conn
        finally:
            self._lock.release()

    def add_completion(self, record: CompletionRecord) -> int:
        with self._locked() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                if conn.execute("SELECT 1 FROM completions WHERE completion_id = ?",
                                (record.completion_id,)).fetchone():
                    raise ValueError(f"completion {record.completion_id} is already recorded")
                seq = conn.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM completions").fetchone()[0]
                row = completion_row(record)
                row = (row[0], seq, row[2], time.time(), *row[4:])
                conn.execute(f"INSERT INTO completions ({', '.join(COMPLETION_COLUMNS)}) "
                             f"VALUES ({_placeholders(COMPLETION_COLUMNS)})", row)
                conn.executemany(f"INSERT INTO completion_choices ({', '.join(CHOICE_COLUMNS)}) "
                                 f"VALUES ({_placeholders(CHOICE_COLUMNS)})",
                                 [choice_row(record.completion_id, c) for c in record.choices])
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        record.seq, record.recorded_at = seq, row[3]
        return seq

    def _choices(self, conn: sqlite3.Connection, completion_id: str) -> list[ChoiceRecord]:
        rows = conn.execute(f"SELECT {', '.join(CHOICE_COLUMNS)} FROM completion_choices "
                            "WHERE completion_id = ? ORDER BY choice_index", (completion_id,)).fetchall()
        return [choice_from_row(r) for r in rows]

    def get_completion(self, completion_id: str) -> CompletionRecord | None:
        with self._locked() as conn:
            row = conn.execute(f"SELECT {', '.join(COMPLETION_COLUMNS)} FROM completions WHERE completion_id = ?",
                               (completion_id,)).fetchone()
            return None if row is None else completion_from_row(row, self._choices(conn, completion_id))

    def list_completions(self, *, since: float | None = None, until: float | None = None, after_seq: int = 0,
                         limit: int = 1000) -> list[CompletionRecord]:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        where, args = ["seq > ?"], [after_seq]
        if since is not None:
            where.append("created_at >= ?")
            args.append(since)
        if until is not None:
            where.append("created_at < ?")
            args.append(until)
        with self._locked() as conn:
            rows = conn.execute(f"SELECT {', '.join(COMPLETION_COLUMNS)} FROM completions "
                                f"WHERE {' AND '.join(where)} ORDER BY seq LIMIT ?", (*args, limit)).fetchall()
            return [completion_from_row(r, self._choices(conn, r[0])) for r in rows]

    def count_completions(self) -> int:
        with self._locked() as conn:
            return conn.execute("SELECT COUNT(*) FROM completions").fetchone()[0]

    def pragma(self, name: str) -> str | int:
        """A PRAGMA's current value (tests check journal_mode and synchronous)."""
        if name not in ("journal_mode", "synchronous", "foreign_keys"):
            raise ValueError(f"unknown pragma {name!r}")
        with self._locked() as conn:
            return conn.execute(f"PRAGMA {name}").fetchone()[0]

    def close(self) -> None:
        """Idempotent; waits for a running call (bounded by lock_timeout_s)."""
        if not self._lock.acquire(timeout=self.lock_timeout_s):
            raise TimeoutError(f"event store busy for more than {self.lock_timeout_s} s")
        try:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        finally:
            self._lock.release()
