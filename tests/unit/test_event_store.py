"""The SQLite event store: records round-trip exactly (routing bytes included), an acknowledged record
survives a killed process, windows and cursors neither miss nor repeat, and bad records are refused."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

from realtime_rl.collect import ChoiceRecord, CompletionRecord, SqliteEventStore, open_event_store
from realtime_rl.types import FunctionCall, ToolCall, ToolCallError

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


def assert_same(a: CompletionRecord, b: CompletionRecord) -> None:
    for name in ("completion_id", "created_at", "model_name", "model_version", "prompt_token_ids", "request_json",
                 "user", "session_id", "api_key_name", "latency_s", "queued_s", "first_token_s", "stream"):
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


@pytest.fixture
def store(tmp_path):
    with SqliteEventStore(tmp_path / "events.sqlite") as s:
        yield s


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


def test_durability_settings(store):
    assert store.pragma("journal_mode") == "wal"
    assert store.pragma("synchronous") == 2  # FULL: the WAL is fsynced at every commit


def test_an_acknowledged_record_survives_a_killed_process(tmp_path):
    code = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(REPO)!r})
        from tests.unit.test_event_store import make_record
        from realtime_rl.collect import SqliteEventStore
        store = SqliteEventStore({str(tmp_path / "events.sqlite")!r})
        store.add_completion(make_record("chatcmpl-crash"))
        print("acked", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)   # no close, no checkpoint, no atexit
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "acked" and proc.returncode == -9, proc.stderr
    with SqliteEventStore(tmp_path / "events.sqlite") as store:
        assert_same(make_record("chatcmpl-crash"), store.get_completion("chatcmpl-crash"))


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


def test_closed_store_and_postgres_url_fail_clearly(tmp_path):
    store = open_event_store(tmp_path)
    assert (tmp_path / "events.sqlite").is_file()
    store.close()
    store.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        store.count_completions()
    with pytest.raises(ValueError, match="Postgres"):
        open_event_store(tmp_path, "postgresql://localhost/test")
