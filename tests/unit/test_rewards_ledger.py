"""The delayed-reward ledger and replay, on real event stores (SQLite, and Postgres where the store is
exercised): a reward stays pending until its windows close and is settled once; late events are
recorded and change nothing; events that arrive before their completion are joined; censoring follows
the policy; update is idempotent, survives reopening and a killed process; replay pays what the ledger
pays without writing anything, and shows the naive rules paying a broken tool call more."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from realtime_rl.collect import ChoiceRecord, CompletionRecord, EventStore, FeedbackEvent, open_event_store
from realtime_rl.config.base import load_config
from realtime_rl.config.rewards import RewardRules
from realtime_rl.rewards import RewardLedger, replay
from realtime_rl.types import FunctionCall, ToolCall, ToolCallError
from tests.stores import BACKENDS, PG_URL, store_location

REPO = Path(__file__).resolve().parents[2]
# Short windows, measured against real store clocks: tests pass `now` ahead of the wall clock.
RULES = RewardRules(persist_window_s=60, followup_window_s=30, horizon_s=120)


def record(cid: str, kind: str, created_at: float, model_version: int = 1, difficulty: str = "easy",
           session_id: str | None = None, n_choices: int = 1) -> CompletionRecord:
    choices = []
    for i in range(n_choices):
        calls, errors, content = [], [], None
        if kind == "edit":
            calls = [ToolCall(id="call_0", function=FunctionCall(name="write_file",
                                                                 arguments='{"path": "a.py", "content": "x = 1"}'))]
        elif kind == "malformed":
            errors = [ToolCallError(index=k, kind="bad_json", message="not JSON", raw="{") for k in range(2)]
            content = "<tool_call>{</tool_call><tool_call>{</tool_call>"
        else:
            content = "Which Python version do you use?" if kind == "question" else "Here you go."
        choices.append(ChoiceRecord(
            index=i, token_ids=list(range(7)), logprobs=[-0.1] * 7, raw_logprobs=[-0.2] * 7,
            versions=[model_version] * 7, finish_reason="tool_calls" if calls else "stop", text=content or "",
            content=content, tool_calls=calls, tool_call_errors=errors))
    metadata = {"task_id": f"task-{cid}", "difficulty": difficulty, "session_id": session_id or f"s-{cid}"}
    return CompletionRecord(
        completion_id=cid, created_at=created_at, model_name="m", model_version=model_version,
        prompt_token_ids=[1, 2, 3], choices=choices, request_json=json.dumps({"model": "m", "metadata": metadata}),
        user="u1", session_id=session_id or f"s-{cid}")


def event(eid: str, type: str, cid: str | None, **kw) -> FeedbackEvent:
    if type == "edit_persisted":
        kw.setdefault("window_s", 60.0)
    return FeedbackEvent(event_id=eid, type=type, completion_id=cid, **kw)


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path):
    with store_location(request.param, tmp_path) as location:
        s = open_event_store(tmp_path, location)
        yield s
        s.close()


@pytest.fixture
def sqlite_store(tmp_path):
    with open_event_store(tmp_path, "sqlite") as s:
        yield s


def test_edit_reward_is_pending_until_its_windows_close_then_settled_once(store, tmp_path):
    t0 = time.time()
    # Created a persist window ago: the store's clock (recorded_at) must show the window passed for the
    # edit_persisted recorded now to decide.
    store.add_completion(record("c1", "edit", t0 - RULES.persist_window_s))
    store.add_events([event("a", "edit_accepted", "c1")])
    with RewardLedger(tmp_path / "rewards.sqlite") as ledger:
        first = ledger.update(store, RULES, now=t0 + 1)
        assert (first.completions, first.events, first.settled) == (1, 1, [])
        assert ledger.stats().pending == 1  # accepted, not yet decided: pending until the horizon
        store.add_events([event("p", "edit_persisted", "c1", window_s=60.0)])
        done = ledger.update(store, RULES, now=t0 + 2)
        (r,) = done.settled
        assert (r.completion_id, r.choice_index, r.status, r.kind, r.difficulty) == ("c1", 0, "final", "edit", "easy")
        assert r.reward == pytest.approx(1.2) and r.trainable and r.settled_at == t0 + 2
        assert (r.rules_version, r.rules_digest) == (RULES.version, RULES.digest())
        assert {c.event_id: c.amount for c in r.components if c.event_id} == {"a": 0.2, "p": 1.0}
        # Idempotent: nothing new in the store, nothing changes.
        again = ledger.update(store, RULES, now=t0 + 1000)
        assert (again.completions, again.events, again.settled, again.late) == (0, 0, [], 0)
        assert ledger.settled() == [r]
        assert (ledger.stats().pending, ledger.stats().settled) == (0, 1)


def test_late_events_are_recorded_and_never_change_a_settled_reward(store, tmp_path):
    t0 = time.time()
    store.add_completion(record("c1", "edit", t0))
    store.add_events([event("a", "edit_accepted", "c1"), event("r", "edit_reverted", "c1")])
    with RewardLedger(tmp_path / "rewards.sqlite") as ledger:
        (settled,) = ledger.update(store, RULES, now=t0 + 31).settled
        assert settled.reward == pytest.approx(0.2 - 0.6)
        store.add_events([event("d", "followup_dissatisfied", "c1"), event("p", "edit_persisted", "c1")])
        result = ledger.update(store, RULES, now=t0 + 40)
        assert (result.events, result.late, result.settled) == (2, 2, [])
        assert [e["event_id"] for e in ledger.late_events()] == ["d", "p"]
        assert ledger.stats().late == 2
        assert ledger.settled() == [settled]


def test_a_reply_marked_undelivered_never_trains_whenever_the_mark_comes_and_whichever_choice(sqlite_store,
                                                                                               tmp_path):
    """The gateway's mark can be recorded after the reward closed (a session that ended at once), and names choice
    0 of a completion of several: neither the settled reward nor another choice of it may train."""
    t0 = time.time()
    sqlite_store.add_completion(record("c1", "question", t0, session_id="s1"))
    sqlite_store.add_completion(record("c2", "question", t0, session_id="s2", n_choices=2))
    sqlite_store.add_events([event("end", "session_end", None, session_id="s1")])
    with RewardLedger(tmp_path / "rewards.sqlite") as ledger:
        (settled,) = ledger.update(sqlite_store, RULES, now=t0 + 2).settled  # c1 closed by its session's end
        assert settled.completion_id == "c1" and settled.trainable
        sqlite_store.add_events([event("u1", "undelivered", "c1"), event("u2", "undelivered", "c2")])
        ledger.update(sqlite_store, RULES, now=t0 + 31)
        assert ledger.settled() == []  # trainable ones only
        untrainable = ledger.settled(include_untrainable=True)
        assert sorted((s.completion_id, s.choice_index) for s in untrainable) == [("c1", 0), ("c2", 0), ("c2", 1)]
        assert all(not s.trainable for s in untrainable)
        assert next(s for s in untrainable if s.completion_id == "c1").reward == settled.reward  # paid as closed


def test_an_event_before_its_completion_is_held_then_paid(store, tmp_path):
    t0 = time.time()
    store.add_events([event("early", "followup_dissatisfied", "c-early")])
    with RewardLedger(tmp_path / "rewards.sqlite") as ledger:
        assert ledger.update(store, RULES, now=t0 + 1).events == 1
        assert ledger.stats().held == 1
        store.add_completion(record("c-early", "other", t0))
        (r,) = ledger.update(store, RULES, now=t0 + 31).settled
        assert ledger.stats().held == 0
        assert r.reward == pytest.approx(-1.2 - 0.5)
        assert [c.event_id for c in r.components if c.event_id] == ["early"]


def test_censoring_credits_or_excludes_by_policy(sqlite_store, tmp_path):
    t0 = time.time()
    sqlite_store.add_completion(record("c1", "edit", t0))
    sqlite_store.add_events([event("a", "edit_accepted", "c1")])
    exclude = RULES.model_copy(update={"censored_policy": "exclude"})
    with RewardLedger(tmp_path / "credit.sqlite") as credit, RewardLedger(tmp_path / "exclude.sqlite") as excl:
        assert credit.update(sqlite_store, RULES, now=t0 + 119).settled == []
        (c,) = credit.update(sqlite_store, RULES, now=t0 + 120).settled
        assert c.status == "censored" and c.trainable and c.reward == pytest.approx(0.2 + 0.5)
        (e,) = excl.update(sqlite_store, exclude, now=t0 + 120).settled
        assert e.status == "censored" and not e.trainable and e.reward == pytest.approx(0.2)
        assert excl.settled() == [] and excl.settled(include_untrainable=True) == [e]
        s = excl.stats()
        assert (s.censored, s.untrainable, s.final) == (1, 1, 0)


def test_session_end_closes_follow_ups_and_session_events_pay_nothing(sqlite_store, tmp_path):
    t0 = time.time()
    sqlite_store.add_completion(record("q", "question", t0, session_id="sess"))
    sqlite_store.add_completion(record("two", "other", t0, n_choices=2))
    sqlite_store.add_events([
        event("n", "followup_neutral", "q"),
        event("sd", "followup_dissatisfied", None, session_id="sess"),
        event("bad", "edit_accepted", "two", choice_index=5),
        event("c1", "followup_dissatisfied", "two", choice_index=1),
        event("end", "session_end", None, session_id="sess"),
    ])
    with RewardLedger(tmp_path / "rewards.sqlite") as ledger:
        (q,) = ledger.update(sqlite_store, RULES, now=t0 + 5).settled  # "two" still awaits follow-ups
        assert q.completion_id == "q" and q.closed_at < t0 + 5 and q.reward == pytest.approx(-1.2)
        s = ledger.stats()
        assert (s.session, s.invalid, s.pending) == (2, 1, 2)
        rewards = {r.choice_index: r.reward for r in ledger.update(sqlite_store, RULES, now=t0 + 31).settled}
        assert rewards == pytest.approx({0: -1.2, 1: -1.7})


def test_settled_feed_filters_by_cursor_and_model_version(sqlite_store, tmp_path):
    t0 = time.time()
    for i in range(4):
        sqlite_store.add_completion(record(f"c{i}", "question", t0, model_version=1 + i % 2))
    with RewardLedger(tmp_path / "rewards.sqlite") as ledger:
        ledger.update(sqlite_store, RULES, now=t0 + 31)
        feed = ledger.settled()
        assert [r.settle_seq for r in feed] == [1, 2, 3, 4]
        assert [r.completion_id for r in ledger.settled(after_seq=2)] == ["c2", "c3"]
        assert [r.completion_id for r in ledger.settled(model_versions={2})] == ["c1", "c3"]
        assert len(ledger.settled(limit=1)) == 1
        with pytest.raises(ValueError, match="limit must be >= 1"):
            ledger.settled(limit=0)


def test_reopened_ledger_continues_from_its_cursors(sqlite_store, tmp_path):
    t0 = time.time()
    path = tmp_path / "rewards.sqlite"
    sqlite_store.add_completion(record("c1", "edit", t0))
    sqlite_store.add_events([event("a", "edit_accepted", "c1")])
    with RewardLedger(path) as ledger:
        ledger.update(sqlite_store, RULES, now=t0 + 1)
        before = ledger.stats()
    with pytest.raises(RuntimeError, match="closed"):
        ledger.settled()
    sqlite_store.add_events([event("r", "edit_reverted", "c1")])
    with RewardLedger(path) as ledger:
        assert ledger.stats() == before
        result = ledger.update(sqlite_store, RULES, now=t0 + 31)
        assert (result.completions, result.events) == (0, 1)  # only what is new since the cursors
        assert [r.reward for r in result.settled] == [pytest.approx(0.2 - 0.6)]


CRASHER = textwrap.dedent("""
    import sys
    from realtime_rl.collect import open_event_store
    from realtime_rl.config.rewards import RewardRules
    from realtime_rl.rewards import RewardLedger
    store = open_event_store(".", sys.argv[1])
    ledger = RewardLedger(sys.argv[2])
    print("opened", flush=True)
    sys.stdin.readline()
    ledger.update(store, RewardRules(persist_window_s=60, followup_window_s=30, horizon_s=120))
    print("done", flush=True)
""")


def test_a_killed_update_loses_nothing(tmp_path):
    """The child is killed inside update, after it wrote the new completions into the ledger and while it
    waits to read the events (the test holds a lock on the Postgres events table): nothing it wrote may
    remain, and the next update settles everything exactly once."""
    import psycopg

    with store_location("postgres", tmp_path) as url, open_event_store(tmp_path, url) as store:
        t0 = time.time()
        for i in range(3):
            store.add_completion(record(f"c{i}", "question", t0))
        store.add_events([event(f"n{k}", "followup_neutral", f"c{k % 3}") for k in range(30)])
        path = tmp_path / "rewards.sqlite"
        child = subprocess.Popen([sys.executable, "-c", CRASHER, url, str(path)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, cwd=tmp_path,
                                 env={**os.environ, "PYTHONPATH": str(REPO / "src")})
        try:
            assert child.stdout.readline().strip() == "opened"
            with psycopg.connect(url) as blocker:  # a transaction: the lock holds until it ends
                blocker.execute("LOCK TABLE feedback_events IN ACCESS EXCLUSIVE MODE")
                me = blocker.execute("SELECT pg_backend_pid()").fetchone()[0]
                child.stdin.write("go\n")
                child.stdin.flush()
                deadline = time.monotonic() + 20
                with psycopg.connect(PG_URL, autocommit=True) as watcher:
                    blocked = "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))"
                    while not watcher.execute(blocked, (me,)).fetchone()[0]:
                        assert time.monotonic() < deadline, "the ledger never reached the events read"
                        time.sleep(0.01)
                child.send_signal(signal.SIGKILL)
                child.wait(timeout=10)
                blocker.rollback()
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=10)
        assert child.returncode == -signal.SIGKILL
        with RewardLedger(tmp_path / "fresh.sqlite") as fresh:
            nothing = fresh.stats()
        with RewardLedger(path) as ledger:
            assert ledger.stats() == nothing  # nothing of the killed update committed
            result = ledger.update(store, RULES, now=t0 + 31)
            assert (result.completions, result.events) == (3, 30)
            assert [r.completion_id for r in ledger.settled()] == ["c0", "c1", "c2"]
            assert all(sum(c.event_id is not None for c in r.components) == 10 for r in ledger.settled())


# ---------------------------------------------------------------------------------------------- replay


def traffic(store: EventStore, t0: float) -> None:
    """One choice of each kind, with the events simulated users send."""
    store.add_completion(record("edit-ok", "edit", t0 - 60, difficulty="easy"))  # persisted a window later
    store.add_completion(record("edit-bad", "edit", t0, difficulty="hard", model_version=2))
    store.add_completion(record("ask", "question", t0, difficulty="hard", model_version=2))
    store.add_completion(record("broken", "malformed", t0, difficulty="hard", model_version=2))
    store.add_completion(record("open", "edit", t0, difficulty="easy"))  # never answered: censored
    store.add_events([
        event("1", "edit_accepted", "edit-ok"), event("2", "edit_persisted", "edit-ok"),
        event("3", "edit_accepted", "edit-bad"), event("4", "edit_reverted", "edit-bad"),
        event("5", "followup_dissatisfied", "edit-bad"), event("6", "followup_neutral", "ask"),
        event("7", "tool_call_error", "broken", tool_name="write_file", error_type="bad_json"),
    ])


def test_replay_pays_what_the_ledger_pays_and_writes_nothing(store, tmp_path):
    t0 = time.time()
    traffic(store, t0)
    completions, events = store.count_completions(), store.count_events()
    report = replay(store, RULES, now=t0 + 200)
    assert (store.count_completions(), store.count_events()) == (completions, events)
    assert (report.completions, report.items, report.settled, report.pending, report.censored) == (5, 5, 5, 0, 1)
    assert report.censored_fraction == pytest.approx(0.2)
    with RewardLedger(tmp_path / "rewards.sqlite") as ledger:
        ledger.update(store, RULES, now=t0 + 200)
        paid = sum(r.reward for r in ledger.settled())
    assert report.total_reward == pytest.approx(paid)
    assert report.by_kind["malformed"].mean == pytest.approx(-3.0)  # 2 x -1.5 - 0.5, clipped at -3
    assert report.by_kind["edit"].count == 3
    assert report.by_model_version[2].count == 3
    assert report.by_difficulty["hard"].mean == pytest.approx((-0.9 - 1.2 - 3.0) / 3)
    d = json.loads(json.dumps(report.to_dict()))
    assert d["rules_version"] == RULES.version and d["by_kind"]["question"]["mean"] == pytest.approx(-1.2)
    early = replay(store, RULES, now=t0 - 1)  # before any decision and any window's end
    assert early.pending == 5 and early.mean_reward is None


def test_naive_rules_pay_a_broken_call_more_than_the_default(sqlite_store):
    t0 = time.time()
    traffic(sqlite_store, t0)
    later = t0 + 7200  # past every window of both recipes
    naive = replay(sqlite_store, load_config(RewardRules, REPO / "configs/rewards/naive.toml"), now=later)
    default = replay(sqlite_store, load_config(RewardRules, REPO / "configs/rewards/default.toml"), now=later)
    assert naive.pending == default.pending == 0 and naive.late_events == default.late_events == 0
    assert naive.by_kind["malformed"].mean == 0.0 > default.by_kind["malformed"].mean == -3.0
    assert naive.by_kind["question"].mean == 0.0 > default.by_kind["question"].mean == -1.2
    # The naive rules pay both dodges more than the failed edit (0.5 - 3 - 2), the default rules less (-0.9).
    assert naive.by_difficulty["hard"].total == pytest.approx(-4.5)
    assert default.by_difficulty["hard"].total == pytest.approx(-0.9 - 1.2 - 3.0)
    assert (naive.rules_digest, naive.rules_version) != (default.rules_digest, default.rules_version)


def test_replay_reads_only_its_window(sqlite_store):
    t0 = time.time()
    traffic(sqlite_store, t0)
    assert replay(sqlite_store, RULES, until=t0 + 1, now=t0 + 200).completions == 5
    assert replay(sqlite_store, RULES, since=t0 + 1, now=t0 + 200).completions == 0
    assert replay(sqlite_store, RULES, until=t0, now=t0 + 200).completions == 1  # edit-ok, created at t0 - 60
    assert replay(sqlite_store, RULES, until=t0 - 60, now=t0 + 200).completions == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_event_stamped_before_a_window_closed_but_committing_after_is_paid_not_late(backend, tmp_path,
                                                                                        monkeypatch):
    """A write stamps its events' recorded_at inside its transaction, before the commit: a ledger in another
    process that settled by the wall clock read the store before that commit, settled the choice without the
    event, and called it late when it came (a replay, which reads recorded_at, pays it)."""
    import threading

    with store_location(backend, tmp_path) as location:
        gateway, loop = open_event_store(tmp_path, location), open_event_store(tmp_path, location)
        closes_in = 1.0
        gateway.add_completion(record("c1", "answer", time.time() - RULES.followup_window_s + closes_in))
        committing, release = threading.Event(), threading.Event()
        insert = gateway._insert_events

        def slow_insert(conn, rows):  # stamped already; the commit waits
            committing.set()
            assert release.wait(30)
            insert(conn, rows)

        monkeypatch.setattr(gateway, "_insert_events", slow_insert)
        writer = threading.Thread(target=gateway.add_events, args=([event("u", "followup_dissatisfied", "c1")],))
        writer.start()
        assert committing.wait(30)
        time.sleep(closes_in + 0.2)  # the follow-up window has closed; the event is still committing
        timer = threading.Timer(0.5, release.set)
        timer.start()
        with RewardLedger(tmp_path / "rewards.sqlite") as ledger:
            update = ledger.update(loop, RULES)  # waits for the commit in flight, then reads the event
        writer.join(30)
        timer.join()
        gateway.close()
        loop.close()
        (settled,) = update.settled
        assert update.late == 0 and [c.event_id for c in settled.components if c.event_id] == ["u"]
