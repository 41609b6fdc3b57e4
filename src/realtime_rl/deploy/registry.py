"""The policy registry: every version of the policy, where it came from, and where it is in its life.

    registry = Registry.open(run_dir)                     # run_dir/registry.sqlite (created if absent)
    registry.bootstrap(base_checkpoint)                   # version 1, live: the first champion
    v = registry.register(ckpt, parent=1, window=DataWindow(t0, t1, 812),
                          reward_version="v3", reward_digest="sha256:...", metrics={"pass_at_1": 0.71})
    registry.transition(v.version, "canary", reason="gate passed", evidence=decision.to_dict())
    registry.promote(v.version, reason="A/B win", evidence=report.to_dict())   # canary -> live; old live retired
    registry.rollback(v.version, reason="latency regressed", evidence=...)     # live -> rolled_back, restore
    registry.rollback(v.version, reason="A/B", expect="canary")  # StateChanged if someone moved it first
    registry.live(); registry.get(v); registry.list(); registry.history(v); registry.lineage(v)

A version has an integer number, a checkpoint directory (Hugging Face layout), its parent version, the
data window it was trained on, the reward rules' version and digest, metrics (JSON) and a state:

    candidate --> canary --> live --> retired          (retired only by the promotion of another version)
        |            |         |         ^
        +------------+---------+--> rolled_back        retired --> live only by a rollback that restores it

Rollback of the live version restores the most recently retired version: the one whose place it took
when it was promoted (each promotion retires exactly the version that was live, so the retired versions
form a stack and rollbacks undo promotions in order). That is its parent in the usual loop, but not
always (a candidate trained from an older checkpoint). Rolling back a live version that replaced nobody
(the bootstrap) is an error: there is nothing to serve instead. Every state change is a row of the
transitions table (from, to, at, reason, evidence JSON); registration is the change from nothing.

Atomicity: each change is one `BEGIN IMMEDIATE` transaction, which takes SQLite's write lock before
reading, so two processes promoting at once are serialized and the second sees the first's result; a
partial unique index on state = 'live' makes two live versions impossible even for a buggy writer.
A decision taken on a state read earlier passes `expect=`: the change happens only if the version is still
in that state inside the transaction, and otherwise raises StateChanged (an operator's `rtrl registry`
acted first: rolling back what they just promoted would undo their decision, not the loop's).
The file is in WAL mode with synchronous=FULL: a change is on disk when the call returns.

Not here: the `rtrl registry` command (registry_cli.py), moving weights (deploy.sync), choosing the arm
a user sees (deploy.canary), deciding to promote (evaluate.gate, evaluate.ab).
"""

from __future__ import annotations

import contextlib
import json
import math
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

State = Literal["candidate", "canary", "live", "retired", "rolled_back"]
STATES: tuple[str, ...] = get_args(State)
REGISTRY_FILE = "registry.sqlite"

# The moves a caller may ask for. live -> retired and retired -> live happen only inside promote and
# rollback, as the other half of a change to another version.
ALLOWED: dict[str, tuple[str, ...]] = {
    "candidate": ("canary", "rolled_back"),
    "canary": ("live", "rolled_back"),
    "live": ("rolled_back",),
    "retired": (),
    "rolled_back": (),
}
MOVE_NOTES = {"live": "promote; the live version is retired",
              "rolled_back": "rollback; a live version is replaced by the most recently retired one"}

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS versions (
    version INTEGER PRIMARY KEY,
    checkpoint TEXT NOT NULL,
    parent INTEGER REFERENCES versions(version),
    data_since REAL,
    data_until REAL,
    data_completions INTEGER,
    reward_version TEXT,
    reward_digest TEXT,
    metrics TEXT NOT NULL,
    created_at REAL NOT NULL,
    state TEXT NOT NULL CHECK (state IN ({", ".join(repr(s) for s in STATES)}))
);
CREATE UNIQUE INDEX IF NOT EXISTS one_live_version ON versions(state) WHERE state = 'live';
CREATE TABLE IF NOT EXISTS transitions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    version INTEGER NOT NULL REFERENCES versions(version),
    from_state TEXT,
    to_state TEXT NOT NULL,
    at REAL NOT NULL,
    reason TEXT NOT NULL,
    evidence TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS transitions_by_version ON transitions(version, id);
"""
COLUMNS = ("version, checkpoint, parent, data_since, data_until, data_completions, reward_version, reward_digest, "
           "metrics, created_at, state")


@dataclass(frozen=True)
class DataWindow:
    """The traffic a version was trained on: completions recorded in [since, until] (unix seconds)."""

    since: float
    until: float
    completions: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.since) and math.isfinite(self.until)) or self.until < self.since:
            raise ValueError(f"data window: need finite since <= until, got since={self.since} until={self.until}")
        if self.completions < 0:
            raise ValueError(f"data window: completions must be >= 0, got {self.completions}")


@dataclass(frozen=True)
class PolicyVersion:
    """One registered version of the policy (a row of the versions table)."""

    version: int
    checkpoint: Path
    """Absolute path of the Hugging Face checkpoint directory."""
    parent: int | None
    """The version it was trained from (None for a bootstrap)."""
    window: DataWindow | None
    """The traffic it was trained on (None for a bootstrap or an offline run)."""
    reward_version: str | None
    reward_digest: str | None
    metrics: dict[str, Any]
    created_at: float
    state: State


@dataclass(frozen=True)
class Transition:
    """One state change; from_state is None for the registration."""

    version: int
    from_state: State | None
    to_state: State
    at: float
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)


class StateChanged(ValueError):
    """A change asked with `expect=` found the version in another state: someone else moved it first."""

    def __init__(self, version: int, expected: str, found: str) -> None:
        super().__init__(f"version {version} is {found}, no longer {expected}: it was moved by someone else "
                         "(rtrl registry?) after the decision was taken; nothing was changed")
        self.version, self.expected, self.found = version, expected, found


def _json(value: dict[str, Any], what: str) -> str:
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object (a dict), got {type(value).__name__}")
    try:
        return json.dumps(value, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be JSON-serializable with finite numbers: {e}") from None


def _check_checkpoint(checkpoint: str | Path) -> Path:
    path = Path(checkpoint).resolve()
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} is not a directory (expected a Hugging Face checkpoint directory)")
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise ValueError(f"checkpoint {path} lacks config.json or *.safetensors: not a Hugging Face checkpoint")
    return path


class Registry:
    """The versions of one run, in `run_dir/registry.sqlite`. Thread-safe (one connection behind a lock);
    other processes open their own. Waits are bounded: SQLite's write lock by `busy_timeout_s`."""

    def __init__(self, path: Path, busy_timeout_s: float = 10.0) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._lock_timeout_s = 3 * busy_timeout_s  # another thread of this process is inside a bounded write
        # isolation_level=None: no implicit transactions; every change is an explicit BEGIN IMMEDIATE.
        self._conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise ValueError(f"{path}: SQLite refused WAL mode (got {mode}); is it on a network filesystem?")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        with self._write() as conn:
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)

    @classmethod
    def open(cls, run_dir: str | Path, create: bool = True, busy_timeout_s: float = 10.0) -> Registry:
        """The registry of `run_dir`; with create=False a missing registry is a ValueError."""
        path = Path(run_dir) / REGISTRY_FILE
        if not path.is_file():
            if not create:
                raise ValueError(f"no registry at {path}: is --run-dir the loop's run directory?")
            path.parent.mkdir(parents=True, exist_ok=True)
        return cls(path, busy_timeout_s)

    def close(self) -> None:
        with self._locked():
            self._conn.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _locked(self) -> Iterator[sqlite3.Connection]:
        if not self._lock.acquire(timeout=self._lock_timeout_s):
            raise TimeoutError(f"{self.path}: another thread held the registry for {self._lock_timeout_s} s")
        try:
            yield self._conn
        finally:
            self._lock.release()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._locked():
            try:
                self._conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as e:  # another process held the write lock past busy_timeout_s
                raise TimeoutError(f"{self.path}: could not take the write lock: {e}") from None
            try:
                yield self._conn
                self._conn.execute("COMMIT")  # inside: a COMMIT that fails (busy, I/O) must not leave it open
            except BaseException:
                with contextlib.suppress(sqlite3.Error):  # keep the first error
                    self._conn.execute("ROLLBACK")
                raise

    # -- registration ---------------------------------------------------------------------------------

    def register(self, checkpoint: str | Path, *, parent: int | None = None, window: DataWindow | None = None,
                 reward_version: str | None = None, reward_digest: str | None = None,
                 metrics: dict[str, Any] | None = None, version: int | None = None,
                 reason: str = "registered") -> PolicyVersion:
        """A new candidate. `version` defaults to one more than the highest registered; `parent` must exist."""
        return self._insert(checkpoint, "candidate", parent, window, reward_version, reward_digest, metrics,
                            version, reason)

    def bootstrap(self, checkpoint: str | Path, *, metrics: dict[str, Any] | None = None,
                  version: int | None = None, reason: str = "bootstrap: the first live version") -> PolicyVersion:
        """The first live version (the base model), registered straight into `live`; an error once one is live."""
        return self._insert(checkpoint, "live", None, None, None, None, metrics, version, reason)

    def _insert(self, checkpoint: str | Path, state: State, parent: int | None, window: DataWindow | None,
                reward_version: str | None, reward_digest: str | None, metrics: dict[str, Any] | None,
                version: int | None, reason: str) -> PolicyVersion:
        path = _check_checkpoint(checkpoint)
        metrics_json = _json(metrics or {}, "metrics")
        if version is not None and version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        now = time.time()
        with self._write() as conn:
            if version is None:
                version = conn.execute("SELECT COALESCE(MAX(version), 0) + 1 FROM versions").fetchone()[0]
            elif conn.execute("SELECT 1 FROM versions WHERE version = ?", (version,)).fetchone():
                raise ValueError(f"version {version} is already registered; pick another or leave it out")
            if parent is not None and not conn.execute("SELECT 1 FROM versions WHERE version = ?",
                                                       (parent,)).fetchone():
                raise ValueError(f"parent version {parent} is not registered")
            if state == "live":
                live = conn.execute("SELECT version FROM versions WHERE state = 'live'").fetchone()
                if live:
                    raise ValueError(f"version {live[0]} is already live: bootstrap only starts an empty "
                                     "registry; register a candidate and promote it instead")
            w = window
            conn.execute(
                "INSERT INTO versions (version, checkpoint, parent, data_since, data_until, data_completions,"
                " reward_version, reward_digest, metrics, created_at, state) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (version, str(path), parent, w and w.since, w and w.until, w and w.completions, reward_version,
                 reward_digest, metrics_json, now, state))
            self._log(conn, version, None, state, now, reason, {})
            return self._version(self._row(conn, version))

    def set_metrics(self, version: int, metrics: dict[str, Any]) -> PolicyVersion:
        """Merge `metrics` into the version's metrics (a key given again is replaced)."""
        _json(metrics, "metrics")
        with self._write() as conn:
            merged = self._version(self._row(conn, version)).metrics | metrics
            conn.execute("UPDATE versions SET metrics = ? WHERE version = ?", (_json(merged, "metrics"), version))
            return self._version(self._row(conn, version))

    # -- state changes --------------------------------------------------------------------------------

    def transition(self, version: int, to: str, *, reason: str, evidence: dict[str, Any] | None = None,
                   expect: str | None = None) -> PolicyVersion:
        """Move `version` to state `to` (see the module docstring), recording reason and evidence.

        to="live" promotes a canary (the live version becomes retired in the same transaction);
        to="rolled_back" on the live version restores the most recently retired one. Any other move
        raises ValueError naming the moves allowed from the version's state. With `expect`, a version no
        longer in that state raises StateChanged and nothing changes.
        """
        if expect is not None and expect not in STATES:
            raise ValueError(f"unknown state {expect!r}; states are {', '.join(STATES)}")
        if to not in STATES:
            raise ValueError(f"unknown state {to!r}; states are {', '.join(STATES)}")
        if not reason.strip():
            raise ValueError("a state change needs a reason (say why, for whoever reads the history)")
        evidence_json = _json(evidence or {}, "evidence")
        now = time.time()
        with self._write() as conn:
            current = self._version(self._row(conn, version)).state
            if expect is not None and current != expect:
                raise StateChanged(version, expect, current)
            if to not in ALLOWED[current]:
                moves = ", ".join(f"{m} ({MOVE_NOTES[m]})" if m in MOVE_NOTES else m for m in ALLOWED[current])
                allowed = f"the allowed moves are: {moves}" if moves else "there is no move (a final state)"
                raise ValueError(f"version {version} is {current}: {current} -> {to} is not allowed; "
                                 f"from {current} {allowed}")
            extra: dict[str, Any] = {}
            if to == "live":
                live = conn.execute("SELECT version FROM versions WHERE state = 'live'").fetchone()
                if live:
                    self._set_state(conn, live[0], "live", "retired", now, f"replaced by version {version}",
                                    {"replaced_by": version})
                    extra["replaced"] = live[0]
            if current == "live":  # rollback of the live version: restore the most recently retired one
                restore = conn.execute(
                    "SELECT t.version FROM transitions t JOIN versions v ON v.version = t.version "
                    "WHERE v.state = 'retired' AND t.to_state = 'retired' ORDER BY t.id DESC LIMIT 1").fetchone()
                if restore is None:
                    raise ValueError(f"version {version} is live and no retired version exists to restore; "
                                     "register a candidate and promote it instead of rolling back")
                # The live row leaves 'live' first: the unique index allows one live row at any moment.
                self._set_state(conn, version, "live", "rolled_back", now, reason,
                                json.loads(evidence_json) | {"restored": restore[0]})
                self._set_state(conn, restore[0], "retired", "live", now,
                                f"restored by the rollback of version {version}", {"rolled_back": version})
            else:
                self._set_state(conn, version, current, to, now, reason, json.loads(evidence_json) | extra)
            return self._version(self._row(conn, version))

    def promote(self, version: int, *, reason: str, evidence: dict[str, Any] | None = None,
                expect: str | None = None) -> PolicyVersion:
        """canary -> live; the live version -> retired, in one transaction."""
        return self.transition(version, "live", reason=reason, evidence=evidence, expect=expect)

    def rollback(self, version: int, *, reason: str, evidence: dict[str, Any] | None = None,
                 expect: str | None = None) -> PolicyVersion:
        """candidate|canary -> rolled_back; live -> rolled_back and the most recently retired version -> live."""
        return self.transition(version, "rolled_back", reason=reason, evidence=evidence, expect=expect)

    def _set_state(self, conn: sqlite3.Connection, version: int, old: str, new: str, at: float, reason: str,
                   evidence: dict[str, Any]) -> None:
        updated = conn.execute("UPDATE versions SET state = ? WHERE version = ? AND state = ?",
                               (new, version, old)).rowcount
        assert updated == 1, f"version {version} was not {old} inside the write transaction"
        self._log(conn, version, old, new, at, reason, evidence)

    def _log(self, conn: sqlite3.Connection, version: int, old: str | None, new: str, at: float, reason: str,
             evidence: dict[str, Any]) -> None:
        conn.execute("INSERT INTO transitions (version, from_state, to_state, at, reason, evidence) "
                     "VALUES (?,?,?,?,?,?)", (version, old, new, at, reason, _json(evidence, "evidence")))

    # -- reading --------------------------------------------------------------------------------------

    def _row(self, conn: sqlite3.Connection, version: int) -> tuple[Any, ...]:
        row = conn.execute(f"SELECT {COLUMNS} FROM versions WHERE version = ?", (version,)).fetchone()
        if row is None:
            known = [r[0] for r in conn.execute("SELECT version FROM versions ORDER BY version")]
            raise ValueError(f"version {version} is not registered in {self.path} "
                             f"(registered: {', '.join(map(str, known)) or 'none'})")
        return row

    @staticmethod
    def _version(row: tuple[Any, ...]) -> PolicyVersion:
        (version, checkpoint, parent, since, until, completions, reward_version, reward_digest, metrics,
         created_at, state) = row
        window = None if since is None else DataWindow(since, until, completions)
        return PolicyVersion(version, Path(checkpoint), parent, window, reward_version, reward_digest,
                             json.loads(metrics), created_at, state)

    def get(self, version: int) -> PolicyVersion:
        """The version; ValueError (listing the registered ones) when it is not registered."""
        with self._locked() as conn:
            return self._version(self._row(conn, version))

    def live(self) -> PolicyVersion | None:
        """The live version (None before the bootstrap)."""
        with self._locked() as conn:
            row = conn.execute(f"SELECT {COLUMNS} FROM versions WHERE state = 'live'").fetchone()
        return None if row is None else self._version(row)

    def list(self, state: str | None = None) -> list[PolicyVersion]:
        """Every version (or those in `state`), by version number."""
        if state is not None and state not in STATES:
            raise ValueError(f"unknown state {state!r}; states are {', '.join(STATES)}")
        with self._locked() as conn:
            rows = conn.execute(f"SELECT {COLUMNS} FROM versions WHERE ?1 IS NULL OR state = ?1 ORDER BY version",
                                (state,)).fetchall()
        return [self._version(r) for r in rows]

    def history(self, version: int) -> list[Transition]:
        """The version's state changes, oldest first (the first is its registration)."""
        with self._locked() as conn:
            self._row(conn, version)  # ValueError when not registered
            rows = conn.execute("SELECT version, from_state, to_state, at, reason, evidence FROM transitions "
                                "WHERE version = ? ORDER BY id", (version,)).fetchall()
        return [Transition(v, old, new, at, reason, json.loads(ev)) for v, old, new, at, reason, ev in rows]

    def lineage(self, version: int) -> list[PolicyVersion]:
        """The version, its parent, the parent's parent, ... back to a version without a parent."""
        chain = [self.get(version)]
        while chain[-1].parent is not None:
            chain.append(self.get(chain[-1].parent))
        return chain
