"""The simulated user's reactions on hand-written answers (pure functions), its wire format checked against the
gateway's own schema, feedback retries that store each event once, and the first request's prompt tokens
equal to the agent loop's first-turn context (the official openai client against the in-process gateway)."""

from __future__ import annotations

import json
import random
import sys
import threading
import time

import pytest

from realtime_rl.config import AgentConfig, load_config
from realtime_rl.config.users import SimulateUsersConfig
from realtime_rl.environments import Sandbox, generate_task, load_task, run_episode, solution_files
from realtime_rl.environments.policies import ScriptedPolicy
from realtime_rl.environments.users import (
    Answer, DelayedFeedback, EditOutcome, FeedbackSender, PlannedEvent, SimulatedUser, Stats, UserProfile, make_users, react,
    read_answer, run_simulated_users, style_violation, wire_event,
)
from realtime_rl.environments.users.model import NEUTRAL_ANSWER
from realtime_rl.environments.users.session import gateway_client
from realtime_rl.model.chat import render_tool_call
from realtime_rl.serve.feedback_schemas import FeedbackEventCreate
from realtime_rl.types import FunctionCall, ToolCall
from tests.unit.test_serve_api import KEYS, gateway

pytestmark = pytest.mark.filterwarnings("ignore:You should not use the 'timeout' argument with the TestClient")


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(id=f"call_{name}", function=FunctionCall(name=name, arguments=json.dumps(arguments)))


def profile(**changes) -> UserProfile:
    base = dict(user_id="u1", preference="none", patience=3, think_time_s=(0.0, 0.0), persist_window_s=10.0,
                p_style_revert=1.0, p_malformed_complaint=1.0, followup_on_failure=True)
    return UserProfile(**{**base, **changes})


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return load_task(generate_task(3, split="heldout").write(tmp_path_factory.mktemp("tasks")))


def types(reaction) -> list[str]:
    return [e.type for e in reaction.events]


# ---------------------------------------------------------------------------------------------- users


def test_users_are_stable_and_follow_the_style_mix():
    config = SimulateUsersConfig(users=40, seed=3, style_mix={"docstring": 1.0, "no_print": 1.0}, patience=(2, 4))
    users = make_users(config)
    assert users == make_users(config)
    assert len({u.user_id for u in users}) == 40
    assert {u.preference for u in users} == {"docstring", "no_print"}
    assert {u.patience for u in users} == {2, 3, 4}
    assert make_users(config.model_copy(update={"seed": 4})) != users


@pytest.mark.parametrize("override, message", [
    ("think_time_s=[2.0, 1.0]", "low <= high"),
    ('base_url="ftp://x"', "http"),
    ("style_mix={none = 0.0}", "positive sum"),
    ("sessions=0", "greater than or equal to 1"),
    ("p_style_revert=1.5", "less than or equal to 1"),
])
def test_bad_config_says_what_to_fix(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(SimulateUsersConfig, None, [override])
    with pytest.raises(ValueError, match="sessions or duration_s"):
        SimulateUsersConfig(sessions=None, duration_s=None)


# ---------------------------------------------------------------------------------------------- answers


def test_answers_are_read_like_a_harness_reads_them():
    assert read_answer(None, [call("write_file", path="a.py", content="x")]).kind == "edit"
    assert read_answer("Here.", [call("read_file", path="a.py"), call("edit_file", path="a.py", old="a",
                                                                       new="b")]).kind == "edit"
    assert read_answer(None, [call("ask_user", question="Sorted?")]).kind == "question"
    assert read_answer(None, [call("run_tests")]).kind == "working"  # the harness runs it; no user turn
    assert read_answer(None, [call("submit")]).kind == "other"
    assert read_answer("I would write a loop.", None).kind == "other"
    broken = read_answer('<tool_call>\n{"name": "write_file", "arguments": {"path": "a.py"}\n</tool_call>', None)
    assert broken.kind == "malformed" and [e.kind for e in broken.errors] == ["bad_json"]
    unknown = read_answer(render_tool_call("delete_repo", {}), None)
    assert [e.kind for e in unknown.errors] == ["unknown_tool"]


def test_style_preferences_judge_the_code():
    hinted = 'def f(xs: list[int]) -> int:\n    """Sum."""\n    return sum(xs)\n'
    bare = "def f(xs):\n    print(xs)\n    return sum(xs)\n"
    assert style_violation("type_hints", {"a.py": hinted}) is None
    assert "xs, return" in style_violation("type_hints", {"a.py": bare})
    assert style_violation("docstring", {"a.py": hinted}) is None
    assert "no docstring" in style_violation("docstring", {"a.py": bare})
    assert style_violation("no_print", {"a.py": hinted}) is None
    assert "line 2 calls print" in style_violation("no_print", {"a.py": bare})
    assert style_violation("none", {"a.py": bare}) is None
    assert style_violation("type_hints", {"a.py": "def f(:\n"}) is None  # broken code is judged by its tests


def test_a_reference_solution_pleases_every_user(task):
    solution = {p: c for p, c in solution_files(task, "reference").items() if p in task.solution_files}
    for preference in ("type_hints", "docstring", "no_print", "none"):
        assert style_violation(preference, solution) is None, preference


# ---------------------------------------------------------------------------------------------- reactions


def test_a_passing_edit_in_style_is_accepted_then_persists_after_the_window(task):
    r = react(profile(), Answer("edit", None), EditOutcome(passed=True), task, 2, random.Random(0))
    assert r.verdict == "kept" and r.reply is None and not r.revert
    assert r.events == [PlannedEvent("edit_accepted"), PlannedEvent("edit_persisted", delay_s=10.0, window_s=10.0)]


def test_a_passing_edit_against_the_users_style_is_reverted_within_the_window(task):
    outcome = EditOutcome(passed=True, style_violation="a.py: f has no docstring")
    r = react(profile(p_style_revert=1.0), Answer("edit", None), outcome, task, 2, random.Random(0))
    assert r.verdict == "reverted" and r.revert and types(r) == ["edit_accepted", "edit_reverted"]
    assert 2.0 <= r.events[1].delay_s == r.events[1].window_s <= 8.0
    kept = react(profile(p_style_revert=0.0), Answer("edit", None), outcome, task, 2, random.Random(0))
    assert kept.verdict == "kept"
    reverts = [react(profile(p_style_revert=0.3), Answer("edit", None), outcome, task, 2, random.Random(i)).revert
               for i in range(400)]
    assert 0.2 < sum(reverts) / 400 < 0.4


def test_a_failing_edit_is_reverted_with_a_dissatisfied_followup(task):
    outcome = EditOutcome(passed=False, tests_failed=3, errors=1)
    r = react(profile(), Answer("edit", None), outcome, task, 1, random.Random(0))
    assert r.verdict == "failed" and r.revert
    assert types(r) == ["edit_accepted", "edit_reverted", "followup_dissatisfied"]
    assert "3 failed, 1 errors" in r.reply and task.solution_files[0] in r.reply
    assert react(profile(), Answer("edit", None), outcome, task, 0, random.Random(0)).reply is None
    assert react(profile(followup_on_failure=False), Answer("edit", None), outcome, task, 1,
                 random.Random(0)).reply is None
    with pytest.raises(ValueError, match="EditOutcome"):
        react(profile(), Answer("edit", None), None, task, 1, random.Random(0))


def test_a_question_gets_a_neutral_answer_while_patience_lasts(task):
    r = react(profile(), read_answer(None, [call("ask_user", question="Which order?")]), None, task, 1,
              random.Random(0))
    assert r.verdict == "question" and types(r) == ["followup_neutral"] and r.reply == NEUTRAL_ANSWER
    assert react(profile(), Answer("question", None), None, task, 0, random.Random(0)).reply is None


def test_a_malformed_call_is_reported_with_its_tool_and_error(task):
    answer = read_answer('<tool_call>\n{"name": "edit_file", "arguments": {"path": "a.py"}}\n</tool_call>', None)
    r = react(profile(p_malformed_complaint=1.0), answer, None, task, 1, random.Random(0))
    assert r.verdict == "malformed" and types(r) == ["tool_call_error", "followup_dissatisfied"]
    assert (r.events[0].tool_name, r.events[0].error_type) == ("edit_file", "missing_arguments")
    assert "broken" in r.reply
    quiet = react(profile(p_malformed_complaint=0.0), answer, None, task, 1, random.Random(0))
    assert types(quiet) == ["tool_call_error"] and quiet.reply is None


def test_a_turn_that_only_inspects_is_answered_by_the_harness_not_the_user(task):
    """The system prompt asks the agent to read the task and run the tests: doing so is no unhappy turn."""
    from realtime_rl.environments.users import followup_messages
    from realtime_rl.environments.tools import ToolOutcome

    answer = read_answer("Let me look first.", [call("read_file", path=task.solution_files[0]), call("run_tests")])
    r = react(profile(), answer, None, task, 1, random.Random(0))
    assert answer.kind == "working" and r.verdict == "working" and r.events == [] and r.continues
    last = react(profile(), answer, None, task, 0, random.Random(0))  # patience spent: the user gives up
    assert not last.continues and types(last) == ["followup_dissatisfied"]
    results = {c.id: ToolOutcome(f"out {c.function.name}") for c in answer.tool_calls}
    messages = followup_messages(answer, results, r.reply)
    assert [m["role"] for m in messages] == ["assistant", "tool", "tool"]  # no user message
    submitted = read_answer(None, [call("read_file", path="a.py"), call("submit")])
    assert submitted.kind == "other"  # submitting without an edit is not work in progress


def test_anything_else_is_a_dissatisfied_followup(task):
    r = react(profile(), read_answer("def f(): pass", None), None, task, 1, random.Random(0))
    assert r.verdict == "other" and types(r) == ["followup_dissatisfied"] and task.solution_files[0] in r.reply


# ---------------------------------------------------------------------------------------------- the wire


@pytest.mark.parametrize("event", [
    PlannedEvent("edit_accepted"), PlannedEvent("edit_persisted", delay_s=5, window_s=5.0),
    PlannedEvent("edit_reverted", delay_s=2.5, window_s=2.5), PlannedEvent("followup_dissatisfied"),
    PlannedEvent("followup_neutral"), PlannedEvent("tool_call_error", tool_name="edit_file", error_type="bad_json"),
    PlannedEvent("tool_call_error", error_type="unclosed"),
], ids=lambda e: e.type)
def test_wire_events_are_what_the_gateway_accepts(event):
    body = wire_event(event, user="u1", session_id="s1", completion_id="chatcmpl-1",
                      attributes={"difficulty": 2, "task_id": "t"}, occurred_at=1.7e9)
    parsed = FeedbackEventCreate.model_validate(body).to_record(None)
    assert (parsed.type, parsed.completion_id, parsed.session_id, parsed.choice_index, parsed.user) == (
        event.type, "chatcmpl-1", "s1", 0, "u1")
    assert (parsed.window_s, parsed.tool_name, parsed.error_type) == (event.window_s, event.tool_name,
                                                                      event.error_type)
    assert parsed.attributes == {"difficulty": 2, "task_id": "t"} and parsed.occurred_at == 1.7e9
    end = wire_event(PlannedEvent("session_end"), user="u1", session_id="s1", completion_id=None, attributes={},
                     occurred_at=1.7e9)
    assert FeedbackEventCreate.model_validate(end).to_record(None).completion_id is None
    assert wire_event(event, user="u", session_id="s", completion_id=None, attributes={},
                      occurred_at=0)["log.record.uid"] != body["log.record.uid"]


class Flaky:
    """Faults in front of the real gateway: first a 503 (never forwarded), then an answer lost after the
    gateway stored the events (a reset connection), then the real answers."""

    def __init__(self, inner, lib) -> None:
        self.inner = inner
        self.lib = lib  # the httpx flavour the TestClient is built on
        self.seen = 0

    def handle_request(self, request):
        self.seen += 1
        if self.seen == 1:
            return self.lib.Response(503, headers={"Retry-After": "0"}, request=request)
        response = self.inner.handle_request(request)
        if self.seen == 2:
            response.read()
            raise self.lib.ReadError("connection reset after the request was sent", request=request)
        return response


def test_feedback_retries_resend_the_same_ids_and_store_each_event_once(tmp_path, tokenizer):
    config = SimulateUsersConfig(base_url="http://testserver", api_key=KEYS[0].key)
    with gateway(tmp_path, tokenizer) as (client, store, _):
        flaky = client._transport = Flaky(client._transport, sys.modules[type(client).__mro__[1].__module__.split(".")[0]])
        stats = Stats()
        sender = FeedbackSender(gateway_client(config, client), timeout_s=5, retries=3, stats=stats, backoff_s=0.01)
        events = [wire_event(PlannedEvent(t), user="u1", session_id="s1", completion_id="chatcmpl-x",
                             attributes={}, occurred_at=1.0) for t in ("edit_accepted", "edit_reverted")]
        assert sender.send(events)
        assert flaky.seen == 3 and stats.counts["feedback_retries"] == 2
        stored = store.list_events(session_id="s1")
        assert sorted(e.event_id for e in stored) == sorted(e["log.record.uid"] for e in events)
        assert stats.counts["sent/edit_accepted"] == stats.counts["sent/edit_reverted"] == 1

        wrong_key = config.model_copy(update={"api_key": "not-a-key-0123456789"})
        refusing = FeedbackSender(gateway_client(wrong_key, client), timeout_s=5, retries=3, stats=stats)
        assert not refusing.send(events[:1])  # 401: refused at once, not retried
        assert stats.counts["feedback_refused"] == 1 and stats.counts["feedback_retries"] == 2
        assert flaky.seen == 4


# ---------------------------------------------------------------------------------------------- the first turn


def test_the_first_request_is_the_agent_loops_first_turn(tmp_path, tokenizer, task):
    policy = ScriptedPolicy(tokenizer, ["I am done."])
    run_episode(policy, tokenizer, task, None, AgentConfig(max_turns=1))
    first_turn_context = policy.contexts[0]

    config = SimulateUsersConfig(base_url="http://testserver", api_key=KEYS[0].key, users=1, think_time_s=(0, 0),
                                 patience=(1, 1), max_tokens=4, max_retries=0)
    (user_profile,) = make_users(config)
    stats = Stats()
    with gateway(tmp_path, tokenizer, max_seq_len=2048) as (client, store, _):
        delayed = DelayedFeedback(FeedbackSender(gateway_client(config, client), 5, 0, stats))
        user = SimulatedUser(user_profile, config, Sandbox(config.sandbox), delayed, stats, threading.Event(), client)
        (verdict,) = user.run_session(task)
        assert delayed.close(0.0) == 0
        (record,) = store.list_completions()
        joined = store.join_events(session_id=record.session_id)
    assert record.prompt_token_ids == first_turn_context
    assert record.user == user_profile.user_id and record.session_id.startswith(user_profile.user_id)
    assert json.loads(record.request_json)["metadata"] == {
        "task_id": task.task_id, "difficulty": str(task.metadata["difficulty"]), "session_id": record.session_id}
    # a 4-token answer is no edit: the verdict's events name the completion, then the session ends
    assert verdict in ("other", "malformed") and joined[-1][0].type == "session_end"
    assert joined[0][0].type in ("followup_dissatisfied", "tool_call_error")
    assert all(c is not None and c.completion_id == record.completion_id for _, c in joined[:-1])
    assert all(e.user == user_profile.user_id and e.attributes == {"difficulty": task.metadata["difficulty"],
               "task_id": task.task_id} for e, _ in joined)
    assert stats.counts["completions"] == 1 and stats.counts["sessions"] == 1


# ---------------------------------------------------------------------------------------------- timing and runs


def test_delayed_events_go_out_when_due_and_those_past_the_close_are_censored(tmp_path, tokenizer):
    config = SimulateUsersConfig(base_url="http://testserver", api_key=KEYS[0].key)
    with gateway(tmp_path, tokenizer) as (client, store, _):
        delayed = DelayedFeedback(FeedbackSender(gateway_client(config, client), 5, 0, Stats()))
        now = time.time()
        due = {"late": now + 0.4, "early": now + 0.1, "never": now + 60}
        for name, at in due.items():
            delayed.schedule(at, wire_event(PlannedEvent("edit_persisted", window_s=1.0),
                                            user=name, session_id="s", completion_id="c", attributes={},
                                            occurred_at=at))
        assert delayed.close(wait_s=2.0) == 1
        stored = store.list_events(session_id="s")
    assert [e.user for e in stored] == ["early", "late"]  # in due order, not scheduling order
    assert all(e.recorded_at >= due[e.user] for e in stored)
    with pytest.raises(RuntimeError, match="closed"):
        delayed.schedule(now, {})


def test_a_close_while_the_gateway_hangs_counts_what_is_left_as_censored(monkeypatch):
    """The close's wait did not budget the backoff sleeps between attempts: a hung gateway made it an
    AssertionError after the run, and the summary was lost."""
    import realtime_rl.environments.users.session as session

    class Hanging:
        timeout_s, retries = 0.2, 1
        longest_send_s = 0.0  # a budget the send below overruns

        def send(self, events):
            time.sleep(7.0)  # past the close's budget (wait_s + longest_send_s + 5 s)
            return False

    delayed = DelayedFeedback(Hanging())
    now = time.time()
    for i in range(3):
        delayed.schedule(now + 0.05 * i, {"event.name": "edit_persisted", "i": i})
    monkeypatch.setattr(session.log, "warning", lambda *args: None)
    assert delayed.close(wait_s=0.2) == 2  # the events it could not get to are censored, not an exception


def test_user_tasks_are_generated_again_when_their_spec_changes(tmp_path):
    from realtime_rl.environments.users.run import load_user_tasks

    config = SimulateUsersConfig(base_url="http://testserver", tasks_dir=tmp_path / "tasks", task_count=2)
    first = [t.task_id for t in load_user_tasks(config)]
    assert [t.task_id for t in load_user_tasks(config)] == first
    other = [t.task_id for t in load_user_tasks(config.model_copy(update={"seed": 1, "difficulty": 2}))]
    assert other != first and len(other) == 2  # it used the first run's tasks


def test_a_run_ends_at_its_duration_and_its_summary_matches_the_store(tmp_path, tokenizer):
    config = SimulateUsersConfig(base_url="http://testserver", api_key=KEYS[0].key, users=2, sessions=None,
                                 duration_s=1.0, tasks_dir=tmp_path / "tasks", task_count=2, think_time_s=(0, 0.05),
                                 max_tokens=4, patience=(1, 2), persist_window_s=0.2)
    with gateway(tmp_path, tokenizer, max_seq_len=2048) as (client, store, _):
        start = time.monotonic()
        summary = run_simulated_users(config, http_client=client, progress=False)
        took = time.monotonic() - start
        assert summary["completions"] == store.count_completions() >= 2
        assert summary["events_sent"] == store.count_events()
        ends = [e for e in store.list_events() if e.type == "session_end"]
    assert len(ends) == summary["sessions"] >= 2 and {e.user for e in ends} == {u.user_id for u in make_users(config)}
    assert summary["errors"] == 0 and took < 10
    assert sorted(p.name for p in (tmp_path / "tasks").iterdir()) == [".suite.json", "syn-heldout-000000",
                                                                      "syn-heldout-000001"]

    stop = threading.Event()
    stop.set()
    assert run_simulated_users(config, http_client=client, stop=stop, progress=False)["sessions"] == 0
