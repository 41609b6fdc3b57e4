"""The event store: every completion the gateway serves and every feedback event, durably.

Public API (other stages import only these names):

    store = open_event_store(run_dir, "sqlite")         # SqliteEventStore(run_dir / "events.sqlite")
    store = open_event_store(run_dir, "postgresql://127.0.0.1:5432/test")   # PostgresEventStore
    store.add_completion(CompletionRecord(...))         # on disk when it returns; sets record.seq
    store.get_completion(completion_id) -> CompletionRecord | None
    store.list_completions(since=, until=, after_seq=, limit=) -> list[CompletionRecord]
    store.add_events([FeedbackEvent(...)])              # idempotent by event_id, atomic, on disk when it returns
    store.list_events(completion_id=, session_id=, since=, until=, after_seq=, limit=) -> list[FeedbackEvent]
    store.join_events(...) -> list[(FeedbackEvent, CompletionRecord | None)]
    GroupCommitter(store).submit(events) -> Future      # many writers, one transaction, one fsync
"""

from __future__ import annotations

from pathlib import Path

from realtime_rl.collect.base import (
    EVENT_TYPES, MAX_ATTRIBUTES, ChoiceRecord, CompletionRecord, EventBatchResult, EventConflict, EventStore, EventType,
    FeedbackEvent, decode_routing, encodable, encode_routing,
)
from realtime_rl.collect.group import GroupCommitter
from realtime_rl.collect.sqlite import SqliteEventStore

__all__ = ["EVENT_TYPES", "MAX_ATTRIBUTES", "ChoiceRecord", "CompletionRecord", "EventBatchResult", "EventConflict",
           "EventStore", "EventType", "FeedbackEvent", "GroupCommitter", "SqliteEventStore", "decode_routing",
           "encodable", "encode_routing", "open_event_store", "postgres_unavailable"]


def open_event_store(run_dir: str | Path, store: str = "sqlite") -> EventStore:
    """`store` is "sqlite" (run_dir/events.sqlite) or a postgresql:// URL (needs the postgres extra)."""
    if store == "sqlite":
        return SqliteEventStore(Path(run_dir) / "events.sqlite")
    if store.startswith(("postgresql://", "postgres://")):
        from realtime_rl.collect.postgres import PostgresEventStore  # psycopg is an optional extra

        return PostgresEventStore(store)
    raise ValueError(f'store must be "sqlite" or a postgresql:// URL, got {store!r}')


def postgres_unavailable(url: str) -> str | None:
    """None when a Postgres server answers at `url`, else why not (for skips and clear errors)."""
    try:
        import psycopg
    except ImportError:
        return "psycopg is not installed (pip install -e '.[postgres]')"
    try:
        psycopg.connect(url, connect_timeout=3).close()
    except psycopg.OperationalError as e:
        return f"no Postgres server answers at {url}: {str(e).strip().splitlines()[-1]}"
    return None
