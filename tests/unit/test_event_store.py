"""The event stores, SQLite and Postgres, through one suite: records and feedback events round-trip
exactly (routing bytes included); an acknowledged write survives a killed process; windows and cursors
neither miss nor repeat, with two stores writing at once; retries are idempotent, a conflicting id
rejects its whole batch; an event that arrives before its completion is joined once it exists; the
group committer shares commits without mixing up batches; bad records are refused."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
import zlib
from concurrent.futures import CancelledError
from pathlib import Path

import numpy as np
import pytest

from realtime_rl.collect import (
    EVENT_TYPES, ChoiceRecord, CompletionRecord, EventConflict, FeedbackEvent, GroupCommitter, SqliteEventStore,
    open_event_store,
)
from realtime_rl.collect.base import CHOICE_COLUMNS, COMPLETION_COLUMNS, choice_row, completion_row
from realtime_rl.collect.sql import SCHEMA, schema_statements
from realtime_rl.cli import main
from realtime_rl.config import ServeConfig
from realtime_rl.types import FunctionCall, ToolCall, ToolCallError
from tests.stores import BACKENDS, PG_URL, postgres_schema, store_location

REPO = Path(__file__).resolve().parents[2]


def make_record(cid: str, created_at: float = 1000.0, n: int = 2, prompt_len: int = 5, tokens: int = 4,
                routing_dtype: str | None = "uint8") -> CompletionRecord:
    rng = np.random.default_rng(zlib.crc32(cid.encode()))
    choices = []
    for i in range(n):
        routing = None
        if routing_dtype is not None:
            routing = rng.integers(0, 200, (prompt_len + tokens - 1, 3, 2)).astype(routing_dtype)
        choices.append(ChoiceRecord(
            index=i, token_ids=rng.integers(0, 500, tokens).tolist(),
            logprobs=(-rng.random(tokens)).tolist(), raw_logprobs=(-rng.random(tokens) * 3).tolist(),
            versions=[3] * (tokens - 1) + [4], finish_reason="tool_calls" if i == 0 else "stop",
            text=f'<tool_call>{{"name": "f{i}"}}</tool_call>', content=None if i == 0 else "plain",
            tool_calls=[ToolCall(id=f"call_{i}", function=FunctionCall(name="f", arguments='{"x": 1}'))],
            tool_call_errors=[ToolCallError(index=1, kind="bad_json", message="not JSON", raw="{")] if i else [],
            routing=routing,
        ))
    return CompletionRecord(
        completion_id=cid, created_at=created_at, model_name="m", model_version=3,
        prompt_token_ids=list(range(prompt_len)), choices=choices, request_json='{"model": "m"}', user="u1",
        session_id="s1", api_key_name="k", latency_s=0.25, queued_s=0.01, first_token_s=0.05, stream=True,
    )


def make_events(prefix: str, n: int, completion_id: str | None = None) -> list[FeedbackEvent]:
    """n events cycling through every type, each valid for its type."""
    out = []
    for i in range(n):
        t = EVENT_TYPES[i % len(EVENT_TYPES)]
        out.append(FeedbackEvent(
            event_id=f"{prefix}-{i}", type=t, completion_id=completion_id or f"chatcmpl-{prefix}-{i % 7}",
            session_id=f"sess-{prefix}-{i % 3}", choice_index=i % 2 if t.startswith("edit_") else None,
            name="lint_clean" if t == "custom" else None, value=0.5 * i if t == "custom" else None,
            window_s=300.0 if t == "edit_persisted" else None,
            tool_call_id="call_1" if t == "tool_call_error" else None,
            tool_name="run_tests" if t == "tool_call_error" else None,
            error_type="bad_json" if t == "tool_call_error" else None, user="ada",
            attributes={"task.difficulty": i % 4, "editor": "vim", "ok": True, "ratio": 0.25},
            occurred_at=1000.0 + i,
        ))
    return out


def assert_same(a: CompletionRecord, b: CompletionRecord) -> None:
    for name in ("completion_id", "created_at", "model_name", "model_version", "prompt_token_ids", "request_json",
                 "user", "session_id", "api_key_name", "latency_s", "queued_s", "first_token_s", "stream", "arm"):
        assert getattr(a, name) == getattr(b, name), name
    assert len(a.choices) == len(b.choices)
    for x, y in zip(a.choices, b.choices):
        for name in ("index", "token_ids", "logprobs", "raw_logprobs", "versions", "finish_reason", "text", "content",
                     "tool_calls", "tool_call_errors", "malformed_tool_calls"):
            assert getattr(x, name) == getattr(y, name), name
        if x.routing is None:
            assert y.routing is None
        else:
            assert y.routing.dtype == x.routing.dtype and np.array_equal(x.routing, y.routing)


@pytest.fixture(params=BACKENDS)
def location(request, tmp_path):
    """"sqlite" or a Postgres URL (a schema of its own); stores open as open_event_store(tmp_path, location)."""
    with store_location(request.param, tmp_path) as where:
        yield where


@pytest.fixture
def open_store(location, tmp_path):
    """Opens another store object on the same database (another process would do the same)."""
    opened = []

    def open_one():
        opened.append(open_event_store(tmp_path, location))
        return opened[-1]

    yield open_one
    for s in opened:
        s.close()


@pytest.fixture
def store(open_store):
    return open_store()


@pytest.mark.parametrize("dtype", ["uint8", "int16", None])
def test_a_record_round_trips_exactly(store, dtype):
    rec = make_record("chatcmpl-a", routing_dtype=dtype)
    seq = store.add_completion(rec)
    assert seq == rec.seq == 1 and rec.recorded_at is not None
    got = store.get_completion("chatcmpl-a")
    assert_same(rec, got)
    assert got.seq == 1 and got.recorded_at == rec.recorded_at
    assert got.choices[1].malformed_tool_calls == 1 and got.choices[1].tool_call_errors[0].kind == "bad_json"
    assert store.get_completion("chatcmpl-missing") is None


def test_generated_text_holding_nul_round_trips_exactly(store):
    """A model can generate NUL (a byte-level tokenizer has a token for it), which PostgreSQL's text cannot hold:
    a choice's text and content come back exactly, as does text that merely looks like the encoding's mark."""
    from realtime_rl.collect.postgres import TEXT_MARK

    rec = make_record("chatcmpl-nul")
    rec.choices[0].text = "a\x00b\x01"
    rec.choices[1].text, rec.choices[1].content = TEXT_MARK + '"x"', "end\x00"
    store.add_completion(rec)
    got = store.get_completion("chatcmpl-nul")
    assert_same(rec, got)
    assert [c.text for c in got.choices] == ["a\x00b\x01", TEXT_MARK + '"x"'] and got.choices[1].content == "end\x00"
    assert [c.text for c in store.list_completions()[0].choices] == ["a\x00b\x01", TEXT_MARK + '"x"']


def test_the_serving_arm_round_trips_and_defaults_to_the_champion(store):
    champion, candidate = make_record("chatcmpl-champ"), make_record("chatcmpl-cand")
    candidate.arm = "candidate"
    store.add_completion(champion)
    store.add_completion(candidate)
    assert store.get_completion("chatcmpl-champ").arm == "champion"
    assert [r.arm for r in store.list_completions()] == ["champion", "candidate"]
    with pytest.raises(ValueError, match="arm must be"):
        CompletionRecord(completion_id="c", created_at=0.0, model_name="m", model_version=0, prompt_token_ids=[1],
                         choices=champion.choices[:1], request_json="{}", arm="")


def test_a_database_of_the_schema_before_arms_gains_the_column_on_open(tmp_path, location):
    """A store created before completions had an `arm` keeps its rows (read back as the champion's) and
    stores arms once opened by this version; opening it again changes nothing."""
    arm_ddl = ",\n    arm TEXT NOT NULL DEFAULT 'champion'"
    assert SCHEMA.count(arm_ddl) == 1

    def old_schema(blob: str) -> list[str]:
        return [statement.replace(arm_ddl, "") for statement in schema_statements(blob)]

    old = make_record("chatcmpl-old")
    row = completion_row(old)
    rows = [(row[0], 1, row[2], 1234.0, *row[4:-1])]  # the columns of the old schema: all but the arm
    choice_rows = [choice_row(old.completion_id, c) for c in old.choices]
    insert = (f"INSERT INTO completions ({', '.join(COMPLETION_COLUMNS[:-1])}) VALUES "
              f"({', '.join('?' for _ in COMPLETION_COLUMNS[:-1])})",
              f"INSERT INTO completion_choices ({', '.join(CHOICE_COLUMNS)}) VALUES "
              f"({', '.join('?' for _ in CHOICE_COLUMNS)})")
    if location == "sqlite":
        import sqlite3

        with sqlite3.connect(tmp_path / "events.sqlite") as conn:
            conn.executescript(";".join(old_schema("BLOB")))
            conn.executemany(insert[0], rows)
            conn.executemany(insert[1], choice_rows)
    else:
        import psycopg

        with psycopg.connect(location, autocommit=True) as conn, conn.cursor() as cur:
            for statement in old_schema("BYTEA"):
                cur.execute(statement)
            cur.executemany(insert[0].replace("?", "%s"), rows)
            cur.executemany(insert[1].replace("?", "%s"), choice_rows)
    for _ in range(2):
        with open_event_store(tmp_path, location) as store:
            got = store.get_completion("chatcmpl-old")
            assert_same(old, got)
            assert got.seq == 1 and got.arm == "champion"
            if store.count_completions() == 1:
                new = make_record("chatcmpl-new")
                new.arm = "candidate"
                store.add_completion(new)
            assert [(r.completion_id, r.arm) for r in store.list_completions()] == [
                ("chatcmpl-old", "champion"), ("chatcmpl-new", "candidate")]


def test_durability_settings(store):
    if isinstance(store, SqliteEventStore):
        assert store.pragma("journal_mode") == "wal"
        assert store.pragma("synchronous") == 2  # FULL: the WAL is fsynced at every commit
    else:
        assert store.setting("synchronous_commit") == "on"  # COMMIT waits for the WAL flush
        assert store.setting("fsync") == "on"


def test_postgres_connections_fail_a_vanished_server_within_the_statement_timeout(tmp_path):
    """statement_timeout is the server's: it cannot fire when the server is gone (a failover, a host powered
    off), and the kernel's defaults keep a write waiting 15 minutes or more, holding the store's lock."""
    with store_location("postgres", tmp_path) as location, open_event_store(tmp_path, location) as store:
        parameters = store._conn.info.get_parameters()
        assert parameters["tcp_user_timeout"] == str(int(store.statement_timeout_s * 1000))
        assert (parameters["keepalives"], parameters["keepalives_idle"]) == ("1", "10")


def test_events_are_stamped_on_the_clock_the_horizon_reads(store, monkeypatch):
    """A gateway whose clock runs 1000 s ahead: Postgres stamps and reads the server's clock, so an event stamped
    on another host is never ahead of the trainer's horizon (a gateway behind the trainer's clock had its
    events called late); SQLite lives on one host and uses its clock for both."""
    import realtime_rl.collect.sql as sql

    class AheadClock:
        @staticmethod
        def time() -> float:
            return time.time() + 1000

    monkeypatch.setattr(sql, "time", AheadClock)
    store.add_events(make_events("clock", 1))
    [event] = store.list_events()
    horizon = store.event_horizon()
    assert event.recorded_at <= horizon
    if isinstance(store, SqliteEventStore):
        assert event.recorded_at > time.time() + 900  # the host's clock
    else:
        assert abs(event.recorded_at - time.time()) < 60  # the server's (the same host's here, unskewed)


def test_an_acknowledged_record_and_events_survive_a_killed_process(tmp_path, location, open_store):
    code = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(REPO)!r})
        from tests.unit.test_event_store import make_record, make_events
        from realtime_rl.collect import open_event_store
        store = open_event_store({str(tmp_path)!r}, {location!r})
        store.add_completion(make_record("chatcmpl-crash"))
        store.add_events(make_events("crash", 50))
        print("acked", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)   # no close, no checkpoint, no atexit
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "acked" and proc.returncode == -9, proc.stderr
    store = open_store()
    assert_same(make_record("chatcmpl-crash"), store.get_completion("chatcmpl-crash"))
    assert [e.content() for e in store.list_events()] == [e.content() for e in make_events("crash", 50)]


def test_windows_and_cursors_neither_miss_nor_repeat(store):
    for i in range(10):
        store.add_completion(make_record(f"chatcmpl-{i}", created_at=100.0 + i, n=1))
    window = store.list_completions(since=102.0, until=106.0)
    assert [r.completion_id for r in window] == [f"chatcmpl-{i}" for i in range(2, 6)]
    seen, cursor = [], 0
    while batch := store.list_completions(after_seq=cursor, limit=3):
        seen += [r.completion_id for r in batch]
        cursor = batch[-1].seq
    assert seen == [f"chatcmpl-{i}" for i in range(10)]
    assert store.count_completions() == 10
    with pytest.raises(ValueError, match="limit"):
        store.list_completions(limit=0)


def test_a_duplicate_id_is_refused_and_writes_nothing(store):
    store.add_completion(make_record("chatcmpl-dup", n=1))
    with pytest.raises(ValueError, match="already recorded"):
        store.add_completion(make_record("chatcmpl-dup", n=3))
    assert store.count_completions() == 1 and len(store.get_completion("chatcmpl-dup").choices) == 1


def test_concurrent_writers_get_unique_increasing_seqs(store):
    def write(t):
        for i in range(15):
            store.add_completion(make_record(f"chatcmpl-{t}-{i}", n=1, routing_dtype=None))

    threads = [threading.Thread(target=write, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    records = store.list_completions(limit=1000)
    assert [r.seq for r in records] == list(range(1, 91))


def test_inconsistent_records_are_refused():
    good = make_record("chatcmpl-x")
    with pytest.raises(ValueError, match="differ in length"):
        ChoiceRecord(index=0, token_ids=[1, 2], logprobs=[0.0], raw_logprobs=[0.0, 0.0], versions=[0, 0],
                     finish_reason="stop", text="", content="")
    with pytest.raises(ValueError, match="routing has"):
        CompletionRecord(completion_id="c", created_at=0.0, model_name="m", model_version=0,
                         prompt_token_ids=[1, 2, 3, 4, 5, 6], choices=good.choices, request_json="{}")
    with pytest.raises(ValueError, match="no choices"):
        CompletionRecord(completion_id="c", created_at=0.0, model_name="m", model_version=0,
                         prompt_token_ids=[1], choices=[], request_json="{}")


def test_a_closed_store_fails_clearly(store):
    store.close()
    store.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        store.count_completions()
    with pytest.raises(RuntimeError, match="closed"):
        store.add_events(make_events("late", 1))


def test_bad_locations_fail_clearly(tmp_path):
    open_event_store(tmp_path).close()
    assert (tmp_path / "events.sqlite").is_file()
    with pytest.raises(ValueError, match="sqlite"):
        open_event_store(tmp_path, "mysql://localhost/test")
    pytest.importorskip("psycopg")
    with pytest.raises(ValueError, match=re.escape("cannot open the Postgres event store at postgresql://u:***@")):
        open_event_store(tmp_path, "postgresql://u:secret@127.0.0.1:1/x?connect_timeout=2")  # nothing listens on 1


# ---------------------------------------------------------------------------------------------- feedback events


def test_events_of_every_type_round_trip_exactly(store):
    events = make_events("rt", 2 * len(EVENT_TYPES))
    result = store.add_events(events)
    assert result.stored == [e.event_id for e in events] and not result.duplicates and not result.conflicts
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    got = store.list_events()
    assert [e.content() for e in got] == [e.content() for e in events]
    assert [(e.seq, e.recorded_at) for e in got] == [(e.seq, e.recorded_at) for e in events]
    assert {e.type for e in got} == set(EVENT_TYPES) and store.count_events() == len(events)


def test_a_retry_is_acknowledged_as_a_duplicate_and_not_stored_twice(store):
    events = make_events("retry", 20)
    store.add_events(events[:10])
    result = store.add_events(make_events("retry", 20))  # the first ten again (a retried batch), ten new
    assert result.duplicates == [f"retry-{i}" for i in range(10)]
    assert result.stored == [f"retry-{i}" for i in range(10, 20)]
    assert store.count_events() == 20
    again = make_events("retry", 1)[0]
    again.api_key_name = "another-key"  # who sends it is not part of the content
    assert store.add_events([again]).duplicates == ["retry-0"]


def test_a_conflicting_id_rejects_its_whole_batch(store):
    store.add_events(make_events("c", 3))
    changed = make_events("c", 3)[1]
    changed.value = 42.0
    fresh = make_events("fresh", 5)
    with pytest.raises(EventConflict, match="'c-1' already recorded with different content"):
        store.add_events([*fresh, changed])
    assert store.count_events() == 3 and not store.list_events(session_id="sess-fresh-0")
    assert store.list_events()[1].value is None  # the stored event is untouched


def test_a_retry_must_repeat_its_content_typed_as_json(store):
    """In a dict comparison True == 1: a retry that changed an attribute from true to 1 was acknowledged."""
    store.add_events(make_events("typed", 1))
    changed = make_events("typed", 1)[0]
    changed.attributes["ok"] = 1
    with pytest.raises(EventConflict, match="'typed-0' already recorded with different content"):
        store.add_events([changed])
    assert store.list_events()[0].attributes["ok"] is True
    whole = make_events("whole", 1)[0]
    whole.occurred_at, whole.window_s = 1700000000, None  # an int where the column is a float: the same retry
    store.add_events([copy.deepcopy(whole)])
    assert store.add_events([whole]).duplicates == ["whole-0"]


def test_postgres_keeps_its_guarantees_whatever_the_roles_defaults(tmp_path):
    """A role or database may set extra_float_digits = 0 (float8 read back at 15 digits: a retry of 0.1 + 0.2 was
    a conflict, stored times rounded) and REPEATABLE READ (a write's snapshot taken before its lock wait ended)."""
    with postgres_schema() as url:
        parts = urllib.parse.urlsplit(url)
        query = dict(urllib.parse.parse_qsl(parts.query))
        query["options"] += " -cextra_float_digits=0 -cdefault_transaction_isolation=repeatable\\ read"
        query = urllib.parse.urlencode(query, quote_via=urllib.parse.quote)  # libpq reads + as +
        store = open_event_store(tmp_path, urllib.parse.urlunsplit(parts._replace(query=query)))
        try:
            event = make_events("f", 1)[0]
            event.occurred_at = 1700000000.123456789
            event.attributes["ratio"] = 0.1 + 0.2
            store.add_events([copy.deepcopy(event)])
            assert store.add_events([event]).duplicates == ["f-0"]
            assert store.list_events()[0].occurred_at == event.occurred_at
            with store._write("feedback_events") as conn:
                assert conn.execute("SHOW transaction_isolation").fetchone()[0] == "read committed"
        finally:
            store.close()


def test_batches_sharing_one_commit_stay_atomic_each(store):
    store.add_events(make_events("old", 2))
    changed = make_events("old", 1)[0]
    changed.user = "eve"
    a, c = make_events("a", 3), make_events("c", 3)
    results = store.add_event_batches([a, [*make_events("b", 3), changed], c + make_events("a", 1)])
    assert results[0].stored == ["a-0", "a-1", "a-2"]
    assert results[1].conflicts == ["old-0"] and not results[1].stored
    assert results[2].stored == ["c-0", "c-1", "c-2"] and results[2].duplicates == ["a-0"]  # written just before
    assert store.count_events() == 2 + 3 + 3
    assert [e.seq for e in store.list_events()] == list(range(1, 9))


def test_an_id_repeated_in_one_batch(store):
    twice = make_events("r", 2) + make_events("r", 1)
    result = store.add_events(twice)
    assert result.stored == ["r-0", "r-1"] and result.duplicates == ["r-0"]
    other = make_events("s", 1) + [FeedbackEvent(event_id="s-0", type="session_end", session_id="x")]
    with pytest.raises(EventConflict):
        store.add_events(other)
    assert store.count_events() == 2


def test_event_cursors_and_filters_neither_miss_nor_repeat(store):
    for k in range(5):
        store.add_events(make_events(f"w{k}", 6, completion_id=f"chatcmpl-{k % 2}"))
        time.sleep(0.01)
    everything = store.list_events(limit=1000)
    assert len(everything) == 30 and [e.seq for e in everything] == list(range(1, 31))
    seen, cursor = [], 0
    while batch := store.list_events(after_seq=cursor, limit=7):
        seen += [e.event_id for e in batch]
        cursor = batch[-1].seq
    assert seen == [e.event_id for e in everything]
    assert {e.event_id for e in store.list_events(completion_id="chatcmpl-1")} == {
        f"w{k}-{i}" for k in (1, 3) for i in range(6)}
    assert {e.event_id for e in store.list_events(session_id="sess-w2-0")} == {"w2-0", "w2-3"}
    t2 = everything[12].recorded_at  # the third batch's commit time
    window = store.list_events(since=t2, until=everything[18].recorded_at)
    assert [e.event_id for e in window] == [f"w2-{i}" for i in range(6)]
    with pytest.raises(ValueError, match="limit"):
        store.list_events(limit=0)


def test_an_event_before_its_completion_is_joined_once_it_exists(store):
    early = FeedbackEvent(event_id="e-early", type="edit_accepted", completion_id="chatcmpl-late")
    by_session = FeedbackEvent(event_id="e-session", type="session_end", session_id="s1")
    store.add_events([early, by_session])
    assert [(e.event_id, c) for e, c in store.join_events()] == [("e-early", None), ("e-session", None)]
    rec = make_record("chatcmpl-late")  # session s1
    store.add_completion(rec)
    store.add_events([FeedbackEvent(event_id="e-after", type="edit_persisted", completion_id="chatcmpl-late",
                                    window_s=600.0)])
    joined = store.join_events()
    assert [e.event_id for e, _ in joined] == ["e-early", "e-session", "e-after"]
    assert_same(rec, joined[0][1])
    assert joined[1][1] is None and joined[2][1].completion_id == "chatcmpl-late"
    # the session filter matches the event's own session or its completion's
    assert [e.event_id for e, _ in store.join_events(session_id="s1")] == ["e-early", "e-session", "e-after"]
    assert [e.event_id for e, _ in store.join_events(completion_id="chatcmpl-late", after_seq=1)] == ["e-after"]


def test_two_stores_writing_at_once_keep_seq_in_commit_order(open_store):
    """Two store objects on one database (two gateways): a reader following the cursor while they write
    sees every event exactly once, because seq follows commit order."""
    writers = [open_store(), open_store()]
    reader = open_store()
    done = threading.Event()
    seen: list[str] = []

    def write(w: int) -> None:
        for k in range(25):
            writers[w].add_events(make_events(f"g{w}-{k}", 8))

    def read() -> None:
        cursor = 0
        while True:
            finished = done.is_set()
            batch = reader.list_events(after_seq=cursor, limit=50)
            seen.extend(e.event_id for e in batch)
            cursor = batch[-1].seq if batch else cursor
            if finished and not batch:
                return

    threads = [threading.Thread(target=write, args=(w,)) for w in range(2)]
    follower = threading.Thread(target=read)
    for t in [*threads, follower]:
        t.start()
    for t in threads:
        t.join(120)
    done.set()
    follower.join(120)
    assert len(seen) == len(set(seen)) == 2 * 25 * 8
    assert [e.seq for e in reader.list_events(limit=1000)] == list(range(1, 401))


def _held(store, committer_calls: list[int]) -> threading.Event:
    """Make the store's first add_event_batches wait until the returned gate opens, so that what is submitted
    meanwhile gathers into one group (each call's batch count goes into committer_calls)."""
    gate, real = threading.Event(), store.add_event_batches

    def held(batches):
        committer_calls.append(len(batches))
        if len(committer_calls) == 1:
            gate.wait(30)
        return real(batches)

    store.add_event_batches = held
    return gate


def test_the_group_committer_shares_commits_and_keeps_batches_apart(store):
    commits, calls = [], []
    store.add_events(make_events("taken", 1))
    gate = _held(store, calls)
    committer = GroupCommitter(store, on_commit=lambda b, n, s: commits.append((b, n)))
    conflicting = make_events("taken", 1)[0]
    conflicting.value = 1.0
    futures = {0: committer.submit(make_events("t0", 10))}
    while not calls:  # the first batch's commit has started, and waits
        time.sleep(0.01)
    for i in range(1, 8):
        futures[i] = committer.submit(make_events(f"t{i}", 10) if i != 3 else [*make_events("t3", 10), conflicting])
    gate.set()
    results = {i: f.result(timeout=30) for i, f in futures.items()}
    committer.close()
    assert results[3].conflicts == ["taken-0"] and not results[3].stored
    assert all(results[i].stored == [f"t{i}-{j}" for j in range(10)] for i in results if i != 3)
    assert store.count_events() == 1 + 7 * 10
    assert commits == [(1, 10), (7, 71)]  # the seven that waited share one commit, each batch atomic on its own
    with pytest.raises(RuntimeError, match="closed"):
        committer.submit(make_events("after", 1))


def test_a_batch_the_store_refuses_fails_alone_and_a_failing_store_fails_the_rest_untried(store):
    calls: list[int] = []
    gate = _held(store, calls)
    held = store.add_event_batches

    def refusing(batches):
        if any(e.event_id.startswith("bad") for batch in batches for e in batch):
            calls.append(len(batches))
            raise OSError("the store refuses this data")
        return held(batches)

    store.add_event_batches = refusing
    committer = GroupCommitter(store)
    first = committer.submit(make_events("first", 1))
    while not calls:
        time.sleep(0.01)
    good, bad, later = (committer.submit(make_events(p, 2)) for p in ("good", "bad", "later"))
    gate.set()
    assert first.result(timeout=30).stored == ["first-0"]
    assert good.result(timeout=30).stored == ["good-0", "good-1"]
    assert later.result(timeout=30).stored == ["later-0", "later-1"]
    with pytest.raises(OSError, match="refuses"):
        bad.result(timeout=30)
    assert calls == [1, 3, 1, 1, 1]  # the first; the group of three; then each alone
    # A store that fails everything: two failures in a row, and the rest hear it without more tries.
    calls.clear()
    gate = threading.Event()

    def failing(batches):
        calls.append(len(batches))
        if len(calls) == 1:
            gate.wait(30)
        raise OSError("disk full")

    store.add_event_batches = failing
    waiting = committer.submit(make_events("w", 1))
    while not calls:
        time.sleep(0.01)
    group = [committer.submit(make_events(f"g{i}", 1)) for i in range(4)]
    gate.set()
    for future in [waiting, *group]:
        with pytest.raises(OSError, match="disk full"):
            future.result(timeout=30)
    assert calls == [1, 4, 1, 1]
    committer.close()
    assert {e.event_id for e in store.list_events()} == {"first-0", "good-0", "good-1", "later-0", "later-1"}


def test_the_group_committer_reports_store_errors_and_skips_cancelled_batches(store):
    gate = threading.Event()
    real = store.add_event_batches
    calls = []

    def slow_then_fail(batches):
        calls.append(len(batches))
        gate.wait(30)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(batches)

    store.add_event_batches = slow_then_fail
    committer = GroupCommitter(store)
    first = committer.submit(make_events("first", 2))  # taken at once; its commit waits on the gate
    while not calls:
        time.sleep(0.01)
    cancelled = committer.submit(make_events("cancelled", 2))
    failing = committer.submit(make_events("failing", 2))
    assert cancelled.cancel()  # the caller gave up before its group started
    gate.set()
    assert first.result(timeout=30).stored == ["first-0", "first-1"]
    with pytest.raises(OSError, match="disk full"):
        failing.result(timeout=30)
    with pytest.raises(CancelledError):
        cancelled.result()
    committer.close()
    store.add_event_batches = real
    assert [e.event_id for e in store.list_events()] == ["first-0", "first-1"]


def test_a_batch_submitted_while_the_committer_closes_is_answered(store):
    """submit() passed its closed check, then close() ran to the end before the batch was queued: the batch sat
    in a queue nobody read, and its caller waited out its own timeout."""
    committer = GroupCommitter(store)
    closing = threading.Thread(target=committer.close)
    count_lock = committer._count_lock

    class CloseMeanwhile:  # submit's first take of the count lock: between its closed check and its put
        def __enter__(self):
            if threading.current_thread() is threading.main_thread() and not closing.is_alive():
                closing.start()
                closing.join(0.5)
            return count_lock.__enter__()

        def __exit__(self, *exc):
            return count_lock.__exit__(*exc)

    committer._count_lock = CloseMeanwhile()
    future = committer.submit(make_events("racing", 1))
    closing.join(30)
    assert not closing.is_alive() and future.result(timeout=10).stored == ["racing-0"]


def test_invalid_events_are_refused():
    with pytest.raises(ValueError, match="completion .* or the session"):
        FeedbackEvent(event_id="x", type="edit_accepted")
    with pytest.raises(ValueError, match="session_end needs the session"):
        FeedbackEvent(event_id="x", type="session_end", completion_id="c")
    with pytest.raises(ValueError, match="custom event needs a name and a numeric value"):
        FeedbackEvent(event_id="x", type="custom", completion_id="c", name="n")
    with pytest.raises(ValueError, match="only custom events have a name"):
        FeedbackEvent(event_id="x", type="edit_accepted", completion_id="c", name="n")
    with pytest.raises(ValueError, match="edit_persisted needs window_s"):
        FeedbackEvent(event_id="x", type="edit_persisted", completion_id="c")
    with pytest.raises(ValueError, match="belong to tool_call_error"):
        FeedbackEvent(event_id="x", type="edit_accepted", completion_id="c", error_type="bad_json")
    with pytest.raises(ValueError, match="finite"):
        FeedbackEvent(event_id="x", type="custom", completion_id="c", name="n", value=float("nan"))
    with pytest.raises(ValueError, match="type must be one of"):
        FeedbackEvent(event_id="x", type="edit_acepted", completion_id="c")
    with pytest.raises(ValueError, match="event_id"):
        FeedbackEvent(event_id="", type="edit_accepted", completion_id="c")


def test_the_gateway_config_names_the_store_and_refuses_bad_ones(tmp_path, capsys):
    assert ServeConfig().store == "sqlite"
    assert ServeConfig(store="postgresql://127.0.0.1:5432/test?options=-csearch_path%3Dx").store.endswith("%3Dx")
    for bad, words in [("postgres", "sqlite\" or a postgresql:// URL"), ("mysql://h/db", "scheme 'mysql'"),
                       ("postgresql://127.0.0.1:99999/test", "not a valid URL"),
                       ("postgresql:///test", "names no host"), ("postgresql://127.0.0.1:5432", "no database")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            ServeConfig(store=bad)
    pytest.importorskip("psycopg")
    code = main(["serve", "--config", str(REPO / "configs/serve/default.toml"), "--set", f"run_dir={str(tmp_path)!r}",
                 "--set", "store='postgresql://127.0.0.1:1/test?connect_timeout=2'"])
    assert code == 2
    err = capsys.readouterr().err
    assert "rtrl: error: cannot open the Postgres event store at postgresql://127.0.0.1:1/test" in err


def test_a_dropped_postgres_connection_is_replaced_on_the_next_call(tmp_path):
    with store_location("postgres", tmp_path) as url, open_event_store(tmp_path, url) as store:
        import psycopg

        store.add_events(make_events("before", 3))
        with psycopg.connect(PG_URL, autocommit=True) as admin:  # the server restarts, or a proxy drops the link
            admin.execute("SELECT pg_terminate_backend(%s)", (store._conn.info.backend_pid,))
        with pytest.raises(psycopg.OperationalError):
            store.add_events(make_events("before", 4))  # this write fails (the gateway answers 503) ...
        assert store.add_events(make_events("before", 4)).stored == ["before-3"]  # ... and its retry goes through
        assert store.count_events() == 4


@pytest.mark.parametrize("text", ["c\ud800", "\udfff-c"])
def test_an_event_with_a_lone_surrogate_is_refused_on_construction_not_by_the_store(text):
    from realtime_rl.collect import FeedbackEvent

    with pytest.raises(ValueError, match="lone UTF-16 surrogate"):
        FeedbackEvent("e1", "edit_accepted", completion_id=text)
    FeedbackEvent("e2", "edit_accepted", completion_id="c\U0001f600")  # a character past the BMP is text
