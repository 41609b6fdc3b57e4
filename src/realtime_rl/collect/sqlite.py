"""The default event store: one SQLite file (`run_dir/events.sqlite`) in WAL mode.

Durability: `journal_mode=WAL` with `synchronous=FULL`, so every commit fsyncs the WAL before the
write returns: an acknowledged completion or feedback event survives a killed process and a power cut.
NORMAL would skip that fsync in WAL mode: a commit still survives a killed process (the WAL is in the
OS page cache), but the last commits may vanish on power failure, which would break "an acknowledged
event is on disk". FULL costs one fsync per transaction (3-5 ms here); the gateway's GroupCommitter
puts many requests' events in one transaction, so ingestion pays it once per group, not per event.

Writes are `BEGIN IMMEDIATE` transactions, which take the database's write lock, so writers from
several threads and processes are serialized and `seq` (the previous maximum + 1) is unique and
follows commit order. One connection serves every thread of the process behind a lock; waits are
bounded: the lock by `lock_timeout_s`, SQLite's own file locks (another process writing) by `busy_timeout_s`.

Not here: retention or pruning.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from realtime_rl.collect.sql import SqlEventStore


class SqliteEventStore(SqlEventStore):
    def __init__(self, path: str | Path, busy_timeout_s: float = 10.0, lock_timeout_s: float = 30.0) -> None:
        super().__init__(lock_timeout_s)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: no implicit transactions; we BEGIN and COMMIT ourselves.
        self._conn = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None,
                                     check_same_thread=False)
        try:
            mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise ValueError(f"{self.path}: SQLite refused WAL mode (got {mode}); is it on a network filesystem?")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.execute("PRAGMA foreign_keys=ON")
            self._create_schema(blob="BLOB")
        except BaseException:
            self._conn.close()
            raise

    def _begin_write(self, conn: sqlite3.Connection, table: str) -> None:
        conn.execute("BEGIN IMMEDIATE")

    def _in_ids(self, column: str, ids: list[str]) -> tuple[str, tuple[Any, ...]]:
        return f"{column} IN (SELECT value FROM json_each(?))", (json.dumps(ids),)

    def pragma(self, name: str) -> str | int:
        """A PRAGMA's current value (tests check journal_mode and synchronous)."""
        if name not in ("journal_mode", "synchronous", "foreign_keys"):
            raise ValueError(f"unknown pragma {name!r}")
        with self._locked() as conn:
            return conn.execute(f"PRAGMA {name}").fetchone()[0]
