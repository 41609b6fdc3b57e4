"""Reward rules: the action classifier, the two recipes (naive invites both Cursor hacks, default removes
them, checked from the files' numbers through settle()), and the settlement rules: windows, censoring,
late events, clipping, repeated and custom events."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from realtime_rl.collect import ChoiceRecord, FeedbackEvent
from realtime_rl.config.base import load_config
from realtime_rl.config.rewards import RewardRules
from realtime_rl.rewards import EDIT_TOOLS, QUESTION_TOOL, Item, classify, settle
from realtime_rl.rewards.actions import classify_reply
from realtime_rl.types import FunctionCall, ToolCall, ToolCallError

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "rewards"


def choice(content: str | None = None, tools: tuple[str, ...] = (), errors: int = 0) -> ChoiceRecord:
    calls = [ToolCall(id=f"call_{i}", function=FunctionCall(name=name, arguments="{}")) for i, name in enumerate(tools)]
    return ChoiceRecord(
        index=0, token_ids=[1, 2, 3], logprobs=[0.0] * 3, raw_logprobs=[0.0] * 3, versions=[1] * 3,
        finish_reason="tool_calls" if calls and not errors else "stop", text=content or "", content=content,
        tool_calls=calls if not errors else [],
        tool_call_errors=[ToolCallError(index=i, kind="bad_json", message="not JSON", raw="{") for i in range(errors)],
    )


def test_classify_follows_the_documented_rule():
    assert classify(choice(tools=("write_file",))) == "edit"
    assert classify(choice(tools=("read_file", "edit_file"))) == "edit"
    assert classify(choice(tools=("ask_user",))) == "question"
    assert classify(choice(tools=("ask_user", "write_file"))) == "edit"  # the edit reached the client
    assert classify(choice(tools=("run_tests",))) == "other"
    assert classify(choice(content="Should `add` accept floats?  \n")) == "question"
    assert classify(choice(content="Done. The function is written.")) == "other"
    assert classify(choice(content=None)) == "other"
    assert classify_reply(["ask_user", "write_file"], 0, "") == "edit"
    assert classify_reply(["write_file"], 1, "") == "malformed"
    assert classify_reply([], 0, "Which version?\n") == "question"
    # Any malformed call wins: the gateway then answered the whole text as content.
    assert classify(choice(content="<tool_call>{</tool_call> ok?", errors=1)) == "malformed"
    # Calls that parsed but were not returned as tool calls (no tools offered) are not edits.
    parsed_not_sent = choice(tools=("write_file",))
    parsed_not_sent.finish_reason = "stop"
    assert classify(parsed_not_sent) == "other"


def test_tool_names_match_the_agent_tools():
    from realtime_rl.environments import tools

    names = {t["function"]["name"] for t in tools.TOOL_SCHEMAS}
    assert EDIT_TOOLS <= names and QUESTION_TOOL in names
    assert (EDIT_TOOLS, QUESTION_TOOL) == (tools.EDIT_TOOLS, tools.QUESTION_TOOL)


# ---------------------------------------------------------------------------------------------- recipes


def load(name: str) -> RewardRules:
    return load_config(RewardRules, CONFIGS / f"{name}.toml")


def test_recipes_parse_and_default_is_the_class_default():
    naive, default = load("naive"), load("default")
    assert (naive.version, default.version) == ("naive-v1", "default-v1")
    assert default == RewardRules()
    assert naive.digest() != default.digest()


def test_digest_identifies_the_numbers_not_the_name():
    rules = RewardRules()
    assert rules.model_copy(update={"version": "renamed"}).digest() == rules.digest()
    changed = RewardRules(weights={"edit_reverted": -0.7})
    assert changed.digest() != rules.digest()
    assert len(rules.digest()) == 16


@pytest.mark.parametrize("override, message", [
    (["horizon_s=100", "persist_window_s=600"], "horizon_s (100.0) must exceed persist_window_s"),
    (["clip_min=2", "clip_max=1"], "clip_min (2.0) must be below clip_max"),
    (["followup_window_s=5000"], "followup_window_s (5000.0) must not exceed horizon_s"),
    (["actions.malformed_call=1"], "actions.malformed_call"),
    (["weights.edit_kept=1"], "weights.edit_kept"),
    (["censored_policy=\"guess\""], "censored_policy"),
])
def test_bad_rules_say_what_to_fix(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(RewardRules, CONFIGS / "default.toml", override)


def pays(rules: RewardRules, kind: str, events: list[str], malformed: int = 0) -> float:
    """The settled reward of one choice of `kind` that got `events` (in order, within every window; an
    edit_persisted once the persist window has passed)."""
    item = Item("c", 0, created_at=0.0, model_version=1, kind=kind, malformed_calls=malformed, response_tokens=5)
    evs = [FeedbackEvent(event_id=f"e{i}", type=t, completion_id="c",
                         window_s=rules.persist_window_s if t == "edit_persisted" else None,
                         recorded_at=1.0 + i + (rules.persist_window_s if t == "edit_persisted" else 0.0))
           for i, t in enumerate(events)]
    s = settle(item, evs, rules, now=1e9)
    assert s is not None and s.status == "final" and not s.late_event_ids
    return s.reward


def outcomes(rules: RewardRules) -> dict[str, float]:
    return {
        "success": pays(rules, "edit", ["edit_accepted", "edit_persisted"]),
        "failure": min(pays(rules, "edit", ["edit_accepted", "edit_reverted", "followup_dissatisfied"]),
                       pays(rules, "edit", ["edit_rejected", "followup_dissatisfied"])),
        "question": max(pays(rules, "question", []), pays(rules, "question", ["followup_neutral"])),
        "broken": max(pays(rules, "malformed", [], malformed=1),
                      pays(rules, "malformed", ["tool_call_error"], malformed=1)),
        "other": max(pays(rules, "other", []), pays(rules, "other", ["followup_neutral"])),
    }


def test_default_rules_make_attempting_beat_asking_and_breaking_for_every_p():
    o = outcomes(load("default"))
    assert o["failure"] > o["question"] > o["broken"], o
    assert o["failure"] > o["other"], o
    assert o["failure"] - o["question"] <= 0.5, "a question should cost only a little more than a failed edit"
    for p in np.linspace(0.0, 1.0, 101):
        attempt = p * o["success"] + (1 - p) * o["failure"]
        assert attempt > o["question"] and attempt > o["broken"] and attempt > o["other"], (p, o)


def test_naive_rules_pay_the_two_hacks():
    o = outcomes(load("naive"))
    assert o["question"] == 0.0 and o["broken"] == 0.0
    # Below p = 0.75 asking and breaking the call both beat trying: the hacks Cursor saw.
    low_p = 0.5 * o["success"] + 0.5 * o["failure"]
    assert low_p < o["question"] and low_p < o["broken"], o
    assert o["success"] > o["question"]  # a sure solver still edits


# ---------------------------------------------------------------------------------------------- settlement

RULES = RewardRules(persist_window_s=60, followup_window_s=30, horizon_s=120)
EDIT = Item("c", 0, created_at=1000.0, model_version=1, kind="edit", malformed_calls=0, response_tokens=5,
            session_id="s")


def ev(eid: str, type: str, at: float, **kw) -> FeedbackEvent:
    return FeedbackEvent(event_id=eid, type=type, completion_id="c", recorded_at=at, **kw)


def test_an_edit_is_pending_until_persisted_long_enough_then_final():
    short = ev("p1", "edit_persisted", 1010, window_s=10)
    events = [ev("a", "edit_accepted", 1001), short]
    assert settle(EDIT, events, RULES, now=1100) is None  # a 10 s window decides nothing
    events.append(ev("p2", "edit_persisted", 1065, window_s=60))
    assert settle(EDIT, events, RULES, now=1064) is None
    s = settle(EDIT, events, RULES, now=1065)
    assert s.status == "final" and s.closed_at == 1065 and s.trainable
    assert s.reward == pytest.approx(0.2 + 1.0)
    paid = {c.event_id: c.amount for c in s.components if c.event_id}
    assert paid == {"a": 0.2, "p1": 0.0, "p2": 1.0}


def test_a_persisted_claim_decides_only_once_the_stores_clock_shows_the_window():
    early = ev("p", "edit_persisted", 1005, window_s=600)  # claims 600 s, 5 s after the completion
    events = [ev("a", "edit_accepted", 1001), early, ev("r", "edit_reverted", 1040)]
    s = settle(EDIT, events, RULES, now=1040)
    assert s.status == "final" and s.closed_at == 1040
    assert s.reward == pytest.approx(0.2 - 0.6)  # the revert decides; the early claim pays nothing
    note = next(c.note for c in s.components if c.event_id == "p")
    assert "recorded 5 s after the completion < persist_window_s 60 s" in note
    on_time = settle(EDIT, [ev("a", "edit_accepted", 1001), ev("p", "edit_persisted", 1060, window_s=60)], RULES,
                     now=1060)
    assert on_time.status == "final" and on_time.reward == pytest.approx(0.2 + 1.0)


def test_a_revert_decides_but_follow_ups_are_awaited_until_the_window_ends():
    events = [ev("a", "edit_accepted", 1001), ev("r", "edit_reverted", 1002)]
    assert settle(EDIT, events, RULES, now=1029) is None  # the follow-up window runs to 1030
    events += [ev("d", "followup_dissatisfied", 1020), ev("late", "followup_dissatisfied", 1031),
               ev("p", "edit_persisted", 1070, window_s=60)]
    s = settle(EDIT, events, RULES, now=1030)
    assert s.status == "final" and s.closed_at == 1030
    assert s.reward == pytest.approx(0.2 - 0.6 - 0.5)
    assert s.late_event_ids == ["late", "p"]


def test_a_decision_after_the_decision_pays_nothing_and_repeats_pay_once():
    events = [ev("a1", "edit_accepted", 1001), ev("a2", "edit_accepted", 1002),
              ev("r", "edit_rejected", 1003), ev("r2", "edit_reverted", 1004)]
    s = settle(EDIT, events, RULES, now=1030)
    assert s.reward == pytest.approx(0.2 - 0.5)
    assert [c.note for c in s.components if c.event_id in ("a2", "r2")] == [
        "repeated", "after the edit's outcome was decided"]


def test_censored_edit_is_credited_or_excluded_by_policy():
    events = [ev("a", "edit_accepted", 1001), ev("d", "followup_dissatisfied", 1010)]
    assert settle(EDIT, events, RULES, now=1119) is None
    credit = settle(EDIT, events, RULES, now=1120)
    assert credit.status == "censored" and credit.trainable and credit.closed_at == 1120
    assert credit.reward == pytest.approx(0.2 - 0.5 + 0.5 * 1.0)
    assert credit.components[-1].source == "censored_credit"
    excluded = settle(EDIT, events, RULES.model_copy(update={"censored_policy": "exclude"}), now=1120)
    assert excluded.status == "censored" and not excluded.trainable
    assert excluded.reward == pytest.approx(0.2 - 0.5)
    # An unanswered edit (never accepted) gets no credit: only what is known.
    silent = settle(EDIT, [], RULES, now=5000)
    assert silent.status == "censored" and silent.reward == 0.0


def test_non_edits_close_with_the_follow_up_window_or_the_session_end():
    question = Item("c", 0, created_at=1000.0, model_version=1, kind="question", malformed_calls=0,
                    response_tokens=5, session_id="s")
    events = [ev("n", "followup_neutral", 1005)]
    assert settle(question, events, RULES, now=1020) is None
    s = settle(question, events, RULES, now=1020, session_ends=[1006])
    assert s.status == "final" and s.closed_at == 1006 and s.reward == pytest.approx(-1.2)
    # A session reopened after an end: only an end at or after the completion closes it.
    assert settle(question, events, RULES, now=1020, session_ends=[900]) is None
    assert settle(question, events, RULES, now=1020, session_ends=[900, 1010, 1015]).closed_at == 1010
    # An accepted edit turns any item into one that awaits the edit's outcome.
    accepted = settle(question, [*events, ev("a", "edit_accepted", 1007)], RULES, now=1050)
    assert accepted is None


def test_malformed_calls_are_penalized_per_call_and_clipped():
    item = Item("c", 0, created_at=1000.0, model_version=1, kind="malformed", malformed_calls=3, response_tokens=5)
    s = settle(item, [ev("t", "tool_call_error", 1001, tool_name="write_file", error_type="bad_json")], RULES,
               now=1030)
    assert [c.source for c in s.components] == ["malformed_calls", "event:tool_call_error", "clip"]
    assert s.components[0].amount == pytest.approx(-4.5)
    assert s.reward == RULES.clip_min == -3.0
    assert s.components[-1].amount == pytest.approx(2.0)


def test_custom_events_pay_weight_times_value():
    rules = RULES.model_copy(update={"custom": {"lint_clean": 0.5}})
    item = Item("c", 0, created_at=1000.0, model_version=1, kind="edit", malformed_calls=0, response_tokens=5)
    s = settle(item, [ev("x", "custom", 1001, name="lint_clean", value=2.0),
                      ev("y", "custom", 1002, name="unknown_signal", value=9.0),
                      ev("r", "edit_reverted", 1003)], rules, now=1030)
    assert s.reward == pytest.approx(0.5 * 2.0 - 0.6)
    assert [c.note for c in s.components if c.source.startswith("custom:")] == ["0.5 x 2.0", "no weight for this name"]


def test_an_undelivered_completion_settles_untrainable_and_pays_nothing_for_it():
    """The gateway marks a recorded completion whose answer never reached the client; no feedback could come,
    so its reward (here the action's alone) says nothing about it. One marked after the close (the gateway's
    mark can come late) pays as it closed, and does not train either."""
    question = Item("c", 0, created_at=1000.0, model_version=1, kind="question", malformed_calls=0,
                    response_tokens=5)
    gone = ev("u", "undelivered", 1000.5, attributes={"reason": "client_disconnected"})
    s = settle(question, [gone], RULES, now=1030)
    assert s.status == "final" and not s.trainable and s.reward == pytest.approx(-1.2)
    assert [(c.source, c.amount) for c in s.components] == [("action:question", -1.2), ("event:undelivered", 0.0)]
    late = settle(question, [ev("u", "undelivered", 1031)], RULES, now=1040)
    assert not late.trainable and late.late_event_ids == ["u"] and late.reward == pytest.approx(-1.2)
    with pytest.raises(ValueError, match="undelivered needs the completion"):
        FeedbackEvent(event_id="u", type="undelivered", session_id="s")
