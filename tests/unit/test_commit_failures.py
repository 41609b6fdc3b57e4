"""A COMMIT that fails (SQLite busy or an I/O error) rolls its transaction back: the stores' next writes work,
instead of every later BEGIN failing with "cannot start a transaction within a transaction" until a restart."""

from __future__ import annotations

import sqlite3

import pytest

from realtime_rl.collect import open_event_store
from realtime_rl.config.rewards import RewardRules
from realtime_rl.deploy.registry import Registry
from realtime_rl.rewards import RewardLedger
from tests.unit.test_event_store import make_record
from tests.unit.test_registry import checkpoint


class FailNextCommit:
    """A connection whose next COMMIT fails as a busy SQLite's does: raised, the transaction still open."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn, self.failed = conn, False

    def execute(self, sql: str, *args):
        if not self.failed and sql.strip().upper() == "COMMIT":
            self.failed = True
            raise sqlite3.OperationalError("database is locked")
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str):
        return getattr(self._conn, name)


def test_the_event_store_writes_again_after_a_failed_commit(tmp_path):
    with open_event_store(tmp_path, "sqlite") as store:
        store._conn = failing = FailNextCommit(store._conn)
        with pytest.raises(Exception, match="database is locked"):
            store.add_completion(make_record("chatcmpl-lost"))
        assert failing.failed and store.get_completion("chatcmpl-lost") is None  # rolled back, not half there
        store.add_completion(make_record("chatcmpl-next"))
        assert store.get_completion("chatcmpl-next") is not None


def test_the_registry_writes_again_after_a_failed_commit(tmp_path):
    registry = Registry.open(tmp_path / "run")
    try:
        registry._conn = failing = FailNextCommit(registry._conn)
        with pytest.raises(sqlite3.OperationalError, match="database is locked"):
            registry.register(checkpoint(tmp_path, "lost"))
        assert failing.failed and registry.list() == []
        registry.register(checkpoint(tmp_path, "next"))
        assert [v.checkpoint.name for v in registry.list()] == ["next"]
    finally:
        registry.close()


def test_the_reward_ledger_writes_again_after_a_failed_commit(tmp_path):
    with open_event_store(tmp_path, "sqlite") as store, RewardLedger(tmp_path / "rewards.sqlite") as ledger:
        store.add_completion(make_record("chatcmpl-a"))
        ledger._conn = failing = FailNextCommit(ledger._conn)
        with pytest.raises(sqlite3.OperationalError, match="database is locked"):
            ledger.update(store, RewardRules())
        assert failing.failed
        ledger.update(store, RewardRules())  # reads the completion again: nothing was kept of the failed update
        assert ledger.conn.execute("SELECT COUNT(*) FROM items").fetchone()[0] >= 1
