"""Simulated users against a real gateway: uvicorn on 127.0.0.1, the official openai client over HTTP, the
SQLite store read back through its own connection, bubblewrap grading the edits.

The served models answer known texts (tests/unit/test_serve_api.two_gram_model), so every path is taken
on purpose: an edit that passes on one task and fails on the other, a clarifying question, a broken tool
call. Two tasks in the Exercism layout, with hidden tests: `one` (X must be 1) and `two` (Y must be 2);
the edit writes `X=1` to one.py.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest

from realtime_rl.collect import SqliteEventStore
from realtime_rl.config import ServeConfig
from realtime_rl.config.users import SimulateUsersConfig
from realtime_rl.environments.users import make_users, run_simulated_users
from realtime_rl.environments.users.model import NEUTRAL_ANSWER
from realtime_rl.model import save_checkpoint
from realtime_rl.model.chat import render_tool_call
from tests.integration.test_openai_client import serving
from tests.unit.test_serve_api import KEYS, two_gram_model

pytestmark = pytest.mark.slow

# Worded so that each two-gram chain has a multiple of 4 states: the model's moe_intermediate_size is that
# count, and torch's grouped_mm on CPU refuses rows that are not a multiple of 16 bytes.
ANSWERS = {
    "edit": render_tool_call("write_file", {"path": "one.py", "content": "X=1"}),
    "ask": render_tool_call("ask_user", {"question": "Why so?"}),
    "broken": '<tool_call>\n{"name": "submit", "arguments": {} \n</tool_call>',
}


def write_task(root, name: str, value: int) -> None:
    var = "X" if name == "one" else "Y"
    files = {
        ".docs/instructions.md": f"# {name}\n\nSet `{var}` in `{name}.py` to {value}.\n",
        f"{name}.py": f"{var} = 0\n",
        f"{name}_test.py": f"from {name} import {var}\n\n\ndef test_value():\n    assert {var} == {value}\n",
        ".meta/example.py": f"{var} = {value}\n",
        f".meta/{name}_hidden_test.py": (f"from {name} import {var}\n\n\ndef test_is_an_int():\n"
                                         f"    assert type({var}) is int and {var} == {value}\n"),
        ".meta/config.json": json.dumps({
            "files": {"solution": [f"{name}.py"], "test": [f"{name}_test.py"], "example": [".meta/example.py"],
                      "hidden_test": [f".meta/{name}_hidden_test.py"]},
            "rtrl": {"difficulty": value}}),
    }
    for rel, text in files.items():
        (root / name / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / name / rel).write_text(text)


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    write_task(root, "one", 1)
    write_task(root, "two", 2)
    return root


def simulate(kind: str, tokenizer, tasks_dir, tmp_path, **changes):
    """Serve the model that answers ANSWERS[kind], run the users against it; (summary, config, records,
    joined events)."""
    checkpoint = save_checkpoint(tmp_path / "ckpt", two_gram_model(tokenizer, ANSWERS[kind]), tokenizer)
    settings = ServeConfig(checkpoint=checkpoint, run_dir=tmp_path / "run", api_keys=KEYS, max_seq_len=2048)
    with serving(settings) as url:
        config = SimulateUsersConfig(**{
            "base_url": url, "api_key": KEYS[0].key, "users": 2, "sessions": 6, "tasks_dir": tasks_dir, "seed": 1,
            "think_time_s": (0.0, 0.02), "persist_window_s": 0.5, "patience": (1, 3), "temperature": 0.0,
            "max_tokens": 64, "p_malformed_complaint": 1.0, "request_timeout_s": 30, "style_mix": {"none": 1.0},
            **changes})
        summary = run_simulated_users(config)
    with SqliteEventStore(tmp_path / "run" / "events.sqlite") as store:
        records = store.list_completions()
        joined = store.join_events()
    return summary, config, records, joined


def check_common(summary, config, records, joined) -> dict[str, list]:
    """What holds on every path; returns each session's completions in order."""
    users = {u.user_id for u in make_users(config)}
    assert summary["sessions"] == 6 and summary["errors"] == 0 and summary["censored"] == 0
    assert summary["completions"] == len(records) > 0
    assert summary["events_sent"] == len(joined)
    assert len({e.event_id for e, _ in joined}) == len(joined)
    sessions = defaultdict(list)
    for r in records:
        assert r.user in users and r.session_id.startswith(r.user)
        meta = json.loads(r.request_json)["metadata"]
        assert meta["session_id"] == r.session_id and meta["task_id"] in ("one", "two")
        sessions[r.session_id].append(r)
    ends = [e for e, _ in joined if e.type == "session_end"]
    assert sorted(e.session_id for e in ends) == sorted(sessions)
    for e, c in joined:
        if e.type == "session_end":
            assert c is None and e.completion_id is None
            continue
        assert c is not None, f"{e.type} names a completion the store does not hold"
        assert (e.user, e.session_id, e.choice_index) == (c.user, c.session_id, 0)
        assert e.attributes["task_id"] == json.loads(c.request_json)["metadata"]["task_id"]
    return sessions


def events_of(joined, completion_id: str) -> list[str]:
    return [e.type for e, _ in joined if e.completion_id == completion_id]


def test_edits_are_kept_when_the_tests_pass_and_reverted_with_a_complaint_when_they_fail(tokenizer, tasks_dir,
                                                                                        tmp_path):
    summary, config, records, joined = simulate("edit", tokenizer, tasks_dir, tmp_path)
    sessions = check_common(summary, config, records, joined)
    patience = {u.user_id: u.patience for u in make_users(config)}
    seen = Counter()
    for session in sessions.values():
        task = json.loads(session[0].request_json)["metadata"]["task_id"]
        seen[task] += 1
        if task == "one":  # X = 1 passes the visible and hidden tests: kept, and still there after the window
            (only,) = session
            assert events_of(joined, only.completion_id) == ["edit_accepted", "edit_persisted"]
            (persisted,) = [e for e, _ in joined if e.type == "edit_persisted" and e.completion_id == only.completion_id]
            accepted = next(e for e, _ in joined if e.type == "edit_accepted" and e.completion_id == only.completion_id)
            assert persisted.window_s == 0.5 and persisted.occurred_at - accepted.occurred_at == pytest.approx(0.5)
        else:  # one.py does not make two.py right: reverted, a complaint, a follow-up turn while patience lasts
            assert len(session) == patience[session[0].user]
            for r in session:
                assert events_of(joined, r.completion_id) == ["edit_accepted", "edit_reverted", "followup_dissatisfied"]
            for later in session[1:]:
                last = json.loads(later.request_json)["messages"][-1]
                assert last["role"] == "user" and "The tests fail (2 failed, 0 errors)" in last["content"]  # visible + hidden
    assert seen["one"] and seen["two"], f"both tasks should be drawn with seed 1: {seen}"
    assert summary["kept"] == seen["one"] and summary["edits"] == len(records)
    assert summary["reverted"] == summary["dissatisfied"] == len(records) - seen["one"]


def test_questions_get_neutral_answers_until_patience_runs_out(tokenizer, tasks_dir, tmp_path):
    summary, config, records, joined = simulate("ask", tokenizer, tasks_dir, tmp_path)
    sessions = check_common(summary, config, records, joined)
    patience = {u.user_id: u.patience for u in make_users(config)}
    assert summary["questions"] == len(records) and summary["dissatisfied"] == 0
    for session in sessions.values():
        assert len(session) == patience[session[0].user]
        for r in session:
            assert events_of(joined, r.completion_id) == ["followup_neutral"]
        for later in session[1:]:  # the user's answer goes back as the result of the ask_user call
            last = json.loads(later.request_json)["messages"][-1]
            assert last["role"] == "tool" and last["content"] == NEUTRAL_ANSWER


def test_broken_tool_calls_are_reported_with_their_error(tokenizer, tasks_dir, tmp_path):
    summary, config, records, joined = simulate("broken", tokenizer, tasks_dir, tmp_path)
    check_common(summary, config, records, joined)
    assert summary["malformed"] == len(records) == summary["dissatisfied"]
    for r in records:
        assert [e.kind for e in r.choices[0].tool_call_errors] == ["bad_json"]  # the gateway's parse agrees
        assert events_of(joined, r.completion_id) == ["tool_call_error", "followup_dissatisfied"]
    errors = [e for e, _ in joined if e.type == "tool_call_error"]
    assert {(e.tool_name, e.error_type) for e in errors} == {("submit", "bad_json")}
