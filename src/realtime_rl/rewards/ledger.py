"""The delayed-reward ledger: each completion choice's reward stays pending until its windows close,
then is settled once, with its components, and never changes.

    ledger = RewardLedger(run_dir / "rewards.sqlite")
    result = ledger.update(store, rules)          # read new completions and events, settle what closed
    for r in ledger.settled(after_seq=cursor):    # the trainer's feed, in settlement order
        ...                                       # r.reward, r.model_version, r.components, r.status
    ledger.stats()                                # pending, settled, censored, late, held counts

The ledger is its own SQLite file (WAL, synchronous=FULL) beside the event store, so it survives
restarts. `update` reads the store incrementally by `seq` (completions, then events), and does all of
its work in one transaction together with the cursors: a crash before the commit leaves the ledger as
it was and the next call reads the same records again; calling it twice changes nothing.

Every event the ledger has read is kept in `events` with its disposition:
  held     names a completion the ledger has not read yet (an event may arrive first); joined later
  applied  about a pending choice; paid at settlement if recorded before the choice closed
  late     arrived after its choice settled, or was recorded after the close: never paid
  session  names no completion (a session_end among them closes the session's follow-up windows)
  invalid  names a choice index the completion does not have
What is paid, and when a choice closes, is rules.settle (the same function replay uses).

Not here: which settled rewards are on-policy (the trainer filters by model_version), pruning.
"""

from __future__ import annotations

import dataclasses

import contextlib
import json
import sqlite3
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any

from realtime_rl.collect import EventStore, FeedbackEvent
from realtime_rl.config.rewards import RewardRules
from realtime_rl.rewards.rules import Component, Item, items_from_completion, settle

SCHEMA = """
CREATE TABLE IF NOT EXISTS cursors (
    name TEXT PRIMARY KEY,
    seq INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS items (
    completion_id TEXT NOT NULL,
    choice_index INTEGER NOT NULL,
    completion_seq INTEGER NOT NULL,
    created_at REAL NOT NULL,
    model_version INTEGER NOT NULL,
    kind TEXT NOT NULL,
    malformed_calls INTEGER NOT NULL,
    response_tokens INTEGER NOT NULL,
    user_id TEXT,
    session_id TEXT,
    difficulty TEXT,
    task_id TEXT,
    status TEXT NOT NULL DEFAULT 'pending',
    reward REAL,
    components TEXT,
    trainable INTEGER,
    closed_at REAL,
    rules_version TEXT,
    rules_digest TEXT,
    settled_at REAL,
    settle_seq INTEGER UNIQUE,
    PRIMARY KEY (completion_id, choice_index)
);
CREATE INDEX IF NOT EXISTS items_status ON items (status);
CREATE TABLE IF NOT EXISTS events (
    event_id TEXT PRIMARY KEY,
    event_seq INTEGER NOT NULL,
    completion_id TEXT,
    choice_index INTEGER NOT NULL,
    session_id TEXT,
    type TEXT NOT NULL,
    name TEXT,
    value REAL,
    window_s REAL,
    recorded_at REAL NOT NULL,
    disposition TEXT NOT NULL,
    late_at REAL
);
CREATE INDEX IF NOT EXISTS events_item ON events (completion_id, choice_index);
CREATE INDEX IF NOT EXISTS events_disposition ON events (disposition);
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    ended_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS session_ends (
    session_id TEXT NOT NULL,
    ended_at REAL NOT NULL,
    PRIMARY KEY (session_id, ended_at)
);
INSERT OR IGNORE INTO session_ends SELECT session_id, ended_at FROM sessions
"""
# sessions: each session's first end only, as ledgers before session_ends kept them; read into session_ends.
# In the order of rules.Item's fields: rows are written with astuple(item) and read back with Item(*row).
ITEM_COLUMNS = ("completion_id", "choice_index", "created_at", "model_version", "kind", "malformed_calls",
                "response_tokens", "user_id", "session_id", "difficulty", "task_id")
SETTLED_COLUMNS = (*ITEM_COLUMNS, "status", "reward", "components", "trainable", "closed_at", "rules_version",
                   "rules_digest", "settled_at", "settle_seq")
EVENT_COLUMNS = ("event_id", "event_seq", "completion_id", "choice_index", "session_id", "type", "name", "value",
                 "window_s", "recorded_at")


@dataclass
class SettledReward:
    """One settled reward: the trainer's unit (a completion choice) with what it was paid and why."""

    completion_id: str
    choice_index: int
    created_at: float
    model_version: int
    kind: str
    malformed_calls: int
    response_tokens: int
    user: str | None
    session_id: str | None
    difficulty: str | None
    task_id: str | None
    status: str
    """"final" (its windows closed) or "censored" (the horizon passed first)."""
    reward: float
    components: list[Component]
    trainable: bool
    closed_at: float
    rules_version: str
    rules_digest: str
    settled_at: float
    settle_seq: int
    """Strictly increasing in settlement order: the trainer's cursor."""


@dataclass
class LedgerUpdate:
    """What one `update` call did."""

    completions: int = 0
    """New completion records read."""
    events: int = 0
    """New events read."""
    settled: list[SettledReward] = field(default_factory=list)
    """Rewards settled by this call."""
    late: int = 0
    """Events found late by this call."""


@dataclass
class LedgerStats:
    pending: int
    settled: int
    """final + censored."""
    final: int
    censored: int
    untrainable: int
    """Censored rewards excluded from training (censored_policy "exclude")."""
    late: int
    held: int
    session: int
    invalid: int


def _settled_from_row(row: tuple[Any, ...]) -> SettledReward:
    v = dict(zip(SETTLED_COLUMNS, row))
    return SettledReward(
        completion_id=v["completion_id"], choice_index=v["choice_index"], created_at=v["created_at"],
        model_version=v["model_version"], kind=v["kind"], malformed_calls=v["malformed_calls"],
        response_tokens=v["response_tokens"], user=v["user_id"], session_id=v["session_id"],
        difficulty=v["difficulty"], task_id=v["task_id"], status=v["status"], reward=v["reward"],
        components=[Component(**c) for c in json.loads(v["components"])], trainable=bool(v["trainable"]),
        closed_at=v["closed_at"], rules_version=v["rules_version"], rules_digest=v["rules_digest"],
        settled_at=v["settled_at"], settle_seq=v["settle_seq"],
    )


class RewardLedger:
    """One SQLite file. Use an object from one thread; several processes may open the same file (their
    writes take turns on SQLite's lock, each wait bounded by busy_timeout_s)."""

    def __init__(self, path: str | Path, busy_timeout_s: float = 10.0, page_size: int = 1000) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.page_size = page_size
        self._conn: sqlite3.Connection | None = sqlite3.connect(self.path, timeout=busy_timeout_s,
                                                                isolation_level=None)
        try:
            mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise ValueError(f"{self.path}: SQLite refused WAL mode (got {mode}); is it on a network filesystem?")
            # FULL: a settlement the trainer may have read must not vanish in a power cut and then be paid again
            # differently.
            self._conn.execute("PRAGMA synchronous=FULL")
            with self._write() as conn:
                for statement in (s.strip() for s in SCHEMA.split(";")):
                    if statement:
                        conn.execute(statement)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ plumbing

    @property
    def conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError(f"the reward ledger {self.path} is closed")
        return self._conn

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
            conn.execute("COMMIT")  # inside: a COMMIT that fails (busy, I/O) must not leave the transaction open
        except BaseException:
            with contextlib.suppress(Exception):
                conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> RewardLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ update

    def update(self, store: EventStore, rules: RewardRules, now: float | None = None) -> LedgerUpdate:
        """Read what the store gained since the last call, and settle every pending choice whose windows
        closed by `now` under `rules`. One transaction. The default `now` is the store's `event_horizon`, not
        the wall clock: an event stamped before a window closed but still committing would otherwise be read
        after the choice settled, called late and never paid, though a replay pays it. A `now` the caller gives
        (the loop's window end, in the past) is exact when it is not later than the horizon taken here first."""
        horizon = store.event_horizon()  # before anything is read: every event stamped by then is listed
        now = horizon if now is None else now
        result = LedgerUpdate()
        with self._write() as conn:
            result.completions = self._read_completions(conn, store)
            self._release_held(conn)
            result.events, result.late = self._read_events(conn, store, now)
            self._settle(conn, rules, now, result)
        return result

    def _cursor(self, conn: sqlite3.Connection, name: str) -> int:
        row = conn.execute("SELECT seq FROM cursors WHERE name = ?", (name,)).fetchone()
        return 0 if row is None else row[0]

    def _set_cursor(self, conn: sqlite3.Connection, name: str, seq: int) -> None:
        conn.execute("INSERT INTO cursors (name, seq) VALUES (?, ?) "
                     "ON CONFLICT (name) DO UPDATE SET seq = excluded.seq", (name, seq))

    def _read_completions(self, conn: sqlite3.Connection, store: EventStore) -> int:
        seq, count = self._cursor(conn, "completions"), 0
        while page := store.list_completions(after_seq=seq, limit=self.page_size):
            for record in page:
                rows = [(record.seq, *astuple(item)) for item in items_from_completion(record)]
                conn.executemany(f"INSERT INTO items (completion_seq, {', '.join(ITEM_COLUMNS)}) "
                                 f"VALUES (?, {', '.join('?' for _ in ITEM_COLUMNS)})", rows)
            seq, count = page[-1].seq, count + len(page)
        self._set_cursor(conn, "completions", seq)
        return count

    def _release_held(self, conn: sqlite3.Connection) -> None:
        """Events that came before their completion: applied once it is read (it cannot have settled yet)."""
        conn.execute("UPDATE events SET disposition = 'applied' WHERE disposition = 'held' AND EXISTS (SELECT 1 FROM "
                     "items i WHERE i.completion_id = events.completion_id AND i.choice_index = events.choice_index)")
        conn.execute("UPDATE events SET disposition = 'invalid' WHERE disposition = 'held' AND EXISTS (SELECT 1 "
                     "FROM items i WHERE i.completion_id = events.completion_id)")

    def _disposition(self, conn: sqlite3.Connection, e: FeedbackEvent) -> str:
        if e.completion_id is None:
            return "session"
        rows = conn.execute("SELECT choice_index, status FROM items WHERE completion_id = ?",
                            (e.completion_id,)).fetchall()
        if not rows:
            return "held"
        status = dict(rows).get(e.choice_index or 0)
        if status is None:
            return "invalid"
        return "applied" if status == "pending" else "late"

    def _read_events(self, conn: sqlite3.Connection, store: EventStore, now: float) -> tuple[int, int]:
        """Record every new event with its disposition; returns (events read, of which late)."""
        seq, count, late = self._cursor(conn, "events"), 0, 0
        while page := store.list_events(after_seq=seq, limit=self.page_size):
            for e in page:
                if e.type == "session_end":
                    conn.execute("INSERT OR IGNORE INTO session_ends (session_id, ended_at) VALUES (?, ?)",
                                 (e.session_id, e.recorded_at))
                disposition = self._disposition(conn, e)
                if e.type == "undelivered":  # whenever it comes: no choice of a reply nobody received trains
                    conn.execute("UPDATE items SET trainable = 0 WHERE completion_id = ? AND status != 'pending'",
                                 (e.completion_id,))
                conn.execute(f"INSERT INTO events ({', '.join(EVENT_COLUMNS)}, disposition, late_at) "
                             f"VALUES ({', '.join('?' for _ in EVENT_COLUMNS)}, ?, ?)",
                             (e.event_id, e.seq, e.completion_id, e.choice_index or 0, e.session_id, e.type, e.name,
                              e.value, e.window_s, e.recorded_at, disposition, now if disposition == "late" else None))
                late += disposition == "late"
            seq, count = page[-1].seq, count + len(page)
        self._set_cursor(conn, "events", seq)
        return count, late

    def _settle(self, conn: sqlite3.Connection, rules: RewardRules, now: float, result: LedgerUpdate) -> None:
        pending = [Item(*row) for row in conn.execute(f"SELECT {', '.join(ITEM_COLUMNS)} FROM items "
                                                      "WHERE status = 'pending' ORDER BY completion_seq, choice_index")]
        if not pending:
            return
        events: dict[tuple[str, int], list[FeedbackEvent]] = {}
        for row in conn.execute(f"SELECT {', '.join('e.' + c for c in EVENT_COLUMNS)} FROM events e JOIN items i "
                                "ON i.completion_id = e.completion_id AND i.choice_index = e.choice_index "
                                "WHERE i.status = 'pending' AND e.disposition = 'applied'"):
            v = dict(zip(EVENT_COLUMNS, row))
            events.setdefault((v["completion_id"], v["choice_index"]), []).append(FeedbackEvent(
                event_id=v["event_id"], type=v["type"], completion_id=v["completion_id"],
                session_id=v["session_id"], choice_index=v["choice_index"], name=v["name"], value=v["value"],
                window_s=v["window_s"], seq=v["event_seq"], recorded_at=v["recorded_at"]))
        sessions: dict[str, list[float]] = {}
        for session_id, ended_at in conn.execute(  # the pending items' sessions only: the table only grows
                "SELECT session_id, ended_at FROM session_ends WHERE session_id IN "
                "(SELECT session_id FROM items WHERE status = 'pending')"):
            sessions.setdefault(session_id, []).append(ended_at)
        undelivered = {row[0] for row in conn.execute(  # an event names choice 0; it holds for every choice
            "SELECT DISTINCT completion_id FROM events WHERE type = 'undelivered' AND completion_id IN "
            "(SELECT completion_id FROM items WHERE status = 'pending')")}
        settle_seq = conn.execute("SELECT COALESCE(MAX(settle_seq), 0) FROM items").fetchone()[0]
        digest = rules.digest()
        for item in pending:
            s = settle(item, events.get((item.completion_id, item.choice_index), []), rules, now,
                       sessions.get(item.session_id, ()) if item.session_id is not None else ())
            if s is None:
                continue
            if item.completion_id in undelivered:
                s = dataclasses.replace(s, trainable=False)
            settle_seq += 1
            conn.execute("UPDATE items SET status = ?, reward = ?, components = ?, trainable = ?, closed_at = ?, "
                         "rules_version = ?, rules_digest = ?, settled_at = ?, settle_seq = ? "
                         "WHERE completion_id = ? AND choice_index = ?",
                         (s.status, s.reward, s.components_json(), s.trainable, s.closed_at, rules.version, digest,
                          now, settle_seq, item.completion_id, item.choice_index))
            if s.late_event_ids:
                conn.executemany("UPDATE events SET disposition = 'late', late_at = ? WHERE event_id = ?",
                                 [(now, event_id) for event_id in s.late_event_ids])
            result.late += len(s.late_event_ids)
            row = conn.execute(f"SELECT {', '.join(SETTLED_COLUMNS)} FROM items WHERE completion_id = ? AND "
                               "choice_index = ?", (item.completion_id, item.choice_index)).fetchone()
            result.settled.append(_settled_from_row(row))

    # ------------------------------------------------------------------ reads

    def settled(self, after_seq: int = 0, model_versions: Collection[int] | None = None,
                include_untrainable: bool = False, limit: int | None = None) -> list[SettledReward]:
        """Settled rewards with settle_seq > after_seq, in settlement order; only those of `model_versions`
        when given; censored rewards excluded from training only with include_untrainable."""
        where, args = ["status != 'pending'", "settle_seq > ?"], [after_seq]
        if model_versions is not None:
            where.append(f"model_version IN ({', '.join('?' for _ in model_versions)})")
            args += list(model_versions)
        if not include_untrainable:
            where.append("trainable")
        sql = f"SELECT {', '.join(SETTLED_COLUMNS)} FROM items WHERE {' AND '.join(where)} ORDER BY settle_seq"
        if limit is not None:
            if limit < 1:
                raise ValueError(f"limit must be >= 1, got {limit}")
            sql += f" LIMIT {int(limit)}"
        return [_settled_from_row(r) for r in self.conn.execute(sql, args)]

    def late_events(self) -> list[dict[str, Any]]:
        """Every late event: id, completion, choice, type, when recorded and when found late."""
        rows = self.conn.execute("SELECT event_id, completion_id, choice_index, type, recorded_at, late_at FROM events "
                                 "WHERE disposition = 'late' ORDER BY event_seq").fetchall()
        return [dict(zip(("event_id", "completion_id", "choice_index", "type", "recorded_at", "late_at"), r))
                for r in rows]

    def stats(self) -> LedgerStats:
        status = dict(self.conn.execute("SELECT status, COUNT(*) FROM items GROUP BY status").fetchall())
        disposition = dict(self.conn.execute("SELECT disposition, COUNT(*) FROM events GROUP BY disposition"
                                             ).fetchall())
        untrainable = self.conn.execute("SELECT COUNT(*) FROM items WHERE status != 'pending' AND NOT trainable"
                                        ).fetchone()[0]
        final, censored = status.get("final", 0), status.get("censored", 0)
        return LedgerStats(pending=status.get("pending", 0), settled=final + censored, final=final, censored=censored,
                           untrainable=untrainable, late=disposition.get("late", 0), held=disposition.get("held", 0),
                           session=disposition.get("session", 0), invalid=disposition.get("invalid", 0))
