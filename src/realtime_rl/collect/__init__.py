"""The event store: every completion the gateway serves (and, later, every feedback event), durably.

Public API (other stages import only these names):

    store = open_event_store(run_dir)                  # SqliteEventStore(run_dir / "events.sqlite")
    store.add_completion(CompletionRecord(...))        # on disk when it returns; sets record.seq
    store.get_completion(completion_id) -> CompletionRecord | None
    store.list_completions(since=, until=, after_seq=, limit=) -> list[CompletionRecord]
"""

from __future__ import annotations

from pathlib import Path

from realtime_rl.collect.base import ChoiceRecord, CompletionRecord, EventStore, decode_routing, encode_routing
from realtime_rl.collect.sqlite import SqliteEventStore

__all__ = ["ChoiceRecord", "CompletionRecord", "EventStore", "SqliteEventStore", "decode_routing", "encode_routing",
           "open_event_store"]


def open_event_store(run_dir: str | Path, database_url: str | None = None) -> EventStore:
    """SQLite in `run_dir/events.sqlite`; a Postgres URL is refused until the Postgres store exists."""
    if database_url is not None:
        raise ValueError("database_url: the Postgres event store is not implemented yet; leave it unset to record "
                         "completions in run_dir/events.sqlite")
    return SqliteEventStore(Path(run_dir) / "events.sqlite")
