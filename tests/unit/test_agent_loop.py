"""The agent loop, driven by a scripted policy and by the real tiny model, with the real sandbox."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from realtime_rl.config import AgentConfig
from realtime_rl.environments import load_task
from realtime_rl.environments.agent_loop import (
    SUMMARY_PREFIX, SUMMARY_REQUEST, SYSTEM_PROMPT, PolicyOutput, first_turn_messages, run_episode, task_prompt,
)
from realtime_rl.environments.tools import TOOL_SCHEMAS
from realtime_rl.environments.grading import grade
from realtime_rl.environments.policies import ModelPolicy, ScriptedPolicy
from realtime_rl.model import Qwen3ForCausalLM, render_messages, sequence_logprobs
from tests.conftest import EXERCISM, tiny_config

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

@pytest.fixture(scope="module")
def sandbox():
    from realtime_rl.environments.sandbox import Sandbox

    return Sandbox()


@pytest.fixture
def task():
    root = EXERCISM / "two-fer"
    if not root.is_dir():
        pytest.skip(f"task data not found at {root}")
    return load_task(root)


def tc(name, **args):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def test_scripted_expert_solves_a_real_task(tokenizer, task, sandbox):
    solution = task.reference_solution()["two_fer.py"]
    policy = ScriptedPolicy(tokenizer, [
        tc("read_file", path="two_fer.py"),
        tc("run_tests"),  # the stub: the tests fail
        "Writing the solution.\n" + tc("write_file", path="two_fer.py", content=solution),
        tc("run_tests"),
        tc("submit"),
    ])
    result = run_episode(policy, tokenizer, task, sandbox, AgentConfig())
    ep = result.episode
    assert ep.ended_by == "submit" and ep.num_turns == 5 and ep.num_tool_calls == 5
    assert ep.malformed_tool_calls == 0 and ep.tool_errors == 0
    assert ep.metadata["test_runs"] == 2 and ep.metadata["test_results"] == [False, True]
    assert grade(task, result.workspace.snapshot(), sandbox).passed
    text = tokenizer.decode(ep.segments[0].token_ids.tolist())
    assert "all tests passed" in text  # the run_tests observation the policy saw


def test_segments_are_token_exact(tokenizer, task, sandbox):
    replies = [tc("list_files"), tc("submit")]
    policy = ScriptedPolicy(tokenizer, replies)
    seg = run_episode(policy, tokenizer, task, sandbox, AgentConfig()).episode.segments[0]
    ids = seg.token_ids.tolist()
    # What the policy saw on each call is exactly a prefix of the segment.
    for context in policy.contexts:
        assert ids[: len(context)] == context
    # The policy's tokens sit exactly where the mask says, in order.
    generated = [t for t, m in zip(ids, seg.loss_mask) if m]
    expected = sum((tokenizer.encode(r) + [tokenizer.im_end_id] for r in replies), [])
    assert generated == expected
    # The first context is the chat template's rendering of system + task with the tool schemas.
    head = policy.contexts[0]
    assert tokenizer.decode(head).startswith("<|im_start|>system\n")
    assert tokenizer.decode(head).endswith("<|im_start|>assistant\n")
    assert (seg.versions[seg.loss_mask] == 0).all() and (seg.versions[~seg.loss_mask] == -1).all()


def test_malformed_and_failing_calls_are_observations_not_crashes(tokenizer, task, sandbox):
    policy = ScriptedPolicy(tokenizer, [
        "<tool_call>\n{not json}\n</tool_call>",
        tc("delete_everything"),
        tc("read_file", path="missing.py"),
        tc("edit_file", path="two_fer.py", old="zzz", new="y"),
        tc("submit"),
    ])
    ep = run_episode(policy, tokenizer, task, sandbox, AgentConfig()).episode
    assert ep.ended_by == "submit" and ep.malformed_tool_calls == 2 and ep.tool_errors == 2
    text = tokenizer.decode(ep.segments[0].token_ids.tolist())
    assert "not valid JSON" in text and "unknown tool 'delete_everything'" in text
    assert "no such file: missing.py" in text and "was not found" in text


def test_endings(tokenizer, task, sandbox):
    asked = run_episode(ScriptedPolicy(tokenizer, [tc("ask_user", question="Python 2 or 3?")]),
                        tokenizer, task, sandbox, AgentConfig()).episode
    assert asked.ended_by == "ask_user" and asked.question == "Python 2 or 3?"
    answered = run_episode(ScriptedPolicy(tokenizer, ["I think it is done."]), tokenizer, task, sandbox,
                           AgentConfig()).episode
    assert answered.ended_by == "answer"
    looped = run_episode(ScriptedPolicy(tokenizer, [tc("list_files")]), tokenizer, task, sandbox,
                         AgentConfig(max_turns=3)).episode
    assert looped.ended_by == "max_turns" and looped.num_turns == 3


@pytest.mark.parametrize("reply,action", [
    ("<tool_call>\n{not json}\n</tool_call>", "malformed"),
    (tc("write_file", path="two_fer.py", content="x = 1\n"), "edit"),
    (tc("ask_user", question="Python 2 or 3?"), "question"),
    (tc("run_tests"), "other"),
    ("Should it accept None?", "question"),
    ("I think it is done.", "other"),
])
def test_first_reply_is_classified_as_the_gateway_would_serve_it(reply, action, tokenizer, task, sandbox):
    """The gate counts an eval episode's first reply with the rule the live monitors apply to served replies."""
    from realtime_rl.rewards.actions import classify_reply

    ep = run_episode(ScriptedPolicy(tokenizer, [reply]), tokenizer, task, sandbox, AgentConfig(max_turns=1)).episode
    first = ep.metadata["first_reply"]
    assert classify_reply(first["tool_names"], first["malformed"], first["content"]) == action


def test_first_reply_records_what_it_wrote_and_only_the_first_reply(tokenizer, task, sandbox):
    """The eval's first_write reads this: each well-formed write_file of the first reply by normalized path;
    a malformed call, a path outside the workspace and later turns' writes are not in it."""
    first = ("Two files.\n" + tc("write_file", path="./two_fer.py", content="def two_fer(): pass\n")
             + tc("write_file", path="../escape.py", content="x") + "<tool_call>\n{not json\n</tool_call>"
             + tc("write_file", path="notes.txt", content="later"))
    policy = ScriptedPolicy(tokenizer, [first, tc("write_file", path="two_fer.py", content="second\n"), tc("submit")])
    ep = run_episode(policy, tokenizer, task, sandbox, AgentConfig(max_turns=3)).episode
    assert ep.metadata["first_reply"]["writes"] == {"two_fer.py": "def two_fer(): pass\n", "notes.txt": "later"}
    assert ep.metadata["first_reply"]["malformed"] == 1
    ep = run_episode(ScriptedPolicy(tokenizer, [tc("run_tests")]), tokenizer, task, sandbox,
                     AgentConfig(max_turns=1)).episode
    assert ep.metadata["first_reply"]["writes"] == {}


def test_a_failing_test_run_starts_a_fresh_attempt(tokenizer, task, sandbox):
    solution = task.reference_solution()["two_fer.py"]
    replies = [
        tc("write_file", path="two_fer.py", content="def two_fer(name='you'):\n    return name\n")
        + tc("write_file", path="notes.txt", content="first try"),
        tc("run_tests") + tc("submit"),  # the tests fail: with attempts left, the submit never runs
        tc("write_file", path="two_fer.py", content=solution),
        tc("run_tests"),
        tc("submit"),
    ]
    policy = ScriptedPolicy(tokenizer, replies)
    result = run_episode(policy, tokenizer, task, sandbox, AgentConfig(attempts=3))
    ep = result.episode
    assert ep.ended_by == "submit" and ep.num_turns == 5 and ep.metadata["attempts"] == 2
    assert ep.metadata["test_results"] == [False, True]
    assert "notes.txt" not in result.workspace.files  # the second attempt started from the task's files
    assert grade(task, result.workspace.snapshot(), sandbox).passed
    assert len(ep.segments) == 2
    first, second = ep.segments
    head = policy.contexts[0]
    assert second.token_ids[:len(head)].tolist() == head  # the task again, nothing of the first attempt
    assert "tests failed" in tokenizer.decode(first.token_ids.tolist())
    assert "tests failed" not in tokenizer.decode(second.token_ids.tolist())
    assert ep.metadata["first_reply"]["writes"]["notes.txt"] == "first try"  # the episode's first reply

    # One attempt: the same replies go on in the context and submit the failing program.
    ep = run_episode(ScriptedPolicy(tokenizer, replies), tokenizer, task, sandbox, AgentConfig()).episode
    assert ep.ended_by == "submit" and ep.num_turns == 2 and ep.metadata["attempts"] == 1
    assert ep.metadata["test_results"] == [False] and len(ep.segments) == 1


def test_the_last_attempt_keeps_its_failing_run_and_turn_limits_are_per_attempt(tokenizer, task, sandbox):
    replies = [tc("run_tests"), tc("run_tests"), tc("list_files")]  # the stub fails; then the agent looks around
    ep = run_episode(ScriptedPolicy(tokenizer, replies), tokenizer, task, sandbox,
                     AgentConfig(attempts=2, max_turns=3)).episode
    # Attempt 1: one turn (its run failed); attempt 2: three turns, its failing run kept in context.
    assert ep.metadata["attempts"] == 2 and ep.num_turns == 4 and ep.ended_by == "max_turns"
    assert ep.metadata["test_results"] == [False, False]


class SummarizingPolicy(ScriptedPolicy):
    """Scripted replies, except that a summary request gets the summary text."""

    def __init__(self, tokenizer, replies, summary):
        super().__init__(tokenizer, replies)
        self.summary = summary
        self.summary_calls = 0

    def generate(self, context_ids, max_new_tokens, stop_ids):
        if self.tokenizer.decode(context_ids).endswith(SUMMARY_REQUEST + "<|im_end|>\n<|im_start|>assistant\n"):
            self.summary_calls += 1
            ids = self.tokenizer.encode(self.summary) + [self.tokenizer.im_end_id]
            return PolicyOutput(ids, [0.0] * len(ids), [0] * len(ids))
        return super().generate(context_ids, max_new_tokens, stop_ids)


def test_self_summarization_restarts_the_context(tokenizer, task, sandbox):
    solution = task.reference_solution()["two_fer.py"]
    head = len(tokenizer.encode(render_messages(
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task_prompt(task)}], TOOL_SCHEMAS)))
    summary = "Task: two_fer. I read the tests; next I write the solution."
    policy = SummarizingPolicy(tokenizer, [
        tc("read_file", path="two_fer_test.py"),  # a long observation: the context passes the trigger
        tc("write_file", path="two_fer.py", content=solution),
        tc("submit"),
    ], summary)
    cfg = AgentConfig(summary_trigger_tokens=head + 250, max_context_tokens=head + 2000, max_new_tokens=512)
    result = run_episode(policy, tokenizer, task, sandbox, cfg)
    ep = result.episode
    assert policy.summary_calls == 1 and len(ep.segments) == 2 and len(ep.summary_lengths) == 1
    assert ep.ended_by == "submit"
    first, second = (tokenizer.decode(s.token_ids.tolist()) for s in ep.segments)
    assert first.endswith(summary + "<|im_end|>")
    assert ep.segments[0].loss_mask[-1]  # the summary is the policy's own tokens, trained with the episode
    assert SUMMARY_PREFIX + summary in second
    assert "<tool_response>" not in second.split(SUMMARY_PREFIX)[0]  # the old observations are gone
    ep.passed = grade(task, result.workspace.snapshot(), sandbox).passed
    assert ep.succeeded_after_summary is True


def test_context_overflow_ends_the_episode(tokenizer, task, sandbox):
    cfg = AgentConfig(summary_trigger_tokens=200, max_context_tokens=400, max_new_tokens=300, max_summaries=0)
    ep = run_episode(ScriptedPolicy(tokenizer, [tc("list_files")]), tokenizer, task, sandbox, cfg).episode
    assert ep.ended_by == "context_overflow"


def test_real_tiny_moe_model_through_the_loop_with_replayable_routing(tokenizer, task, sandbox):
    model = Qwen3ForCausalLM(tiny_config(moe=True, vocab_size=tokenizer.vocab_size)).eval()
    cfg = AgentConfig(max_turns=3, max_new_tokens=24)
    ep = run_episode(ModelPolicy(model, temperature=1.0, seed=0), tokenizer, task, sandbox, cfg).episode
    assert ep.num_turns >= 1
    seg = ep.segments[0]
    assert seg.routing is not None and seg.routing.shape == (len(seg.token_ids), 3, 2)
    # The trainer's full-sequence forward, replaying inference's routing, reproduces the behaviour logprobs.
    lp, _ = sequence_logprobs(model, torch.from_numpy(seg.token_ids), torch.from_numpy(seg.routing))
    mask = seg.loss_mask[1:]
    assert mask.sum() > 0
    np.testing.assert_allclose(lp.numpy()[mask], seg.logprobs[1:][mask], atol=1e-4)
    # Sampled at another temperature, the segment says so: its logprobs are of softmax(logits / 0.7).
    cfg = AgentConfig(max_turns=1, max_new_tokens=8)
    warm = run_episode(ModelPolicy(model, temperature=0.7, seed=0), tokenizer, task, sandbox, cfg).episode
    assert seg.temperature == 1.0 and warm.segments[0].temperature == 0.7


def test_each_attempt_has_its_own_summary_budget(tokenizer, task, sandbox):
    solution = task.reference_solution()["two_fer.py"]
    head = len(tokenizer.encode(render_messages(first_turn_messages(task), TOOL_SCHEMAS)))
    policy = SummarizingPolicy(tokenizer, [
        tc("read_file", path="two_fer_test.py"),  # past the trigger: the one summary this attempt may write
        tc("run_tests"),  # the stub fails: attempt 2
        tc("read_file", path="two_fer_test.py"),  # past the trigger again: attempt 2's own summary
        tc("write_file", path="two_fer.py", content=solution),
        tc("run_tests"),
        tc("submit"),
    ], "Task: two_fer. Next I write the solution.")
    cfg = AgentConfig(summary_trigger_tokens=head + 250, max_context_tokens=head + 2000, max_new_tokens=512,
                      max_summaries=1, attempts=2)
    result = run_episode(policy, tokenizer, task, sandbox, cfg)
    ep = result.episode
    assert policy.summary_calls == 2 and len(ep.summary_lengths) == 2 and len(ep.segments) == 4
    assert ep.metadata["attempts"] == 2 and ep.metadata["test_results"] == [False, True] and ep.ended_by == "submit"
    assert grade(task, result.workspace.snapshot(), sandbox).passed


def test_a_long_observation_is_cut_to_leave_room_for_the_summary_it_triggers(tokenizer, task, sandbox, tmp_path):
    shutil.copytree(task.path, tmp_path / "two-fer")
    (tmp_path / "two-fer" / "notes.txt").write_text("word " * 2000)
    task = load_task(tmp_path / "two-fer")
    solution = task.reference_solution()["two_fer.py"]
    head = len(tokenizer.encode(render_messages(first_turn_messages(task), TOOL_SCHEMAS)))
    policy = SummarizingPolicy(tokenizer, [
        tc("read_file", path="notes.txt"),  # ~4000 characters back: more than the context has left
        tc("write_file", path="two_fer.py", content=solution),
        tc("submit"),
    ], "Task: two_fer. Next I write the solution.")
    cfg = AgentConfig(summary_trigger_tokens=head + 150, max_context_tokens=head + 700, max_new_tokens=200,
                      max_summary_tokens=64, max_observation_chars=4000)
    ep = run_episode(policy, tokenizer, task, sandbox, cfg).episode
    assert ep.ended_by == "submit" and policy.summary_calls == 1, ep.ended_by  # it used to overflow instead
    assert all(len(s.token_ids) <= cfg.max_context_tokens for s in ep.segments)
    assert "[truncated: the rest did not fit in the context]" in tokenizer.decode(ep.segments[0].token_ids.tolist())


def test_a_turn_that_would_not_fit_is_preceded_by_a_summary_below_the_trigger(tokenizer, task, sandbox):
    """Summaries fired only past the trigger, and the overflow check came first: with room for less than
    max_new_tokens below the trigger, the episode ended as context_overflow, its summaries unused."""
    solution = task.reference_solution()["two_fer.py"]
    head = len(tokenizer.encode(render_messages(first_turn_messages(task), TOOL_SCHEMAS)))
    policy = SummarizingPolicy(tokenizer, [
        tc("read_file", path="two_fer_test.py"),  # a few hundred tokens: below the trigger, past room for a turn
        tc("write_file", path="two_fer.py", content=solution),
        tc("submit"),
    ], "Task: two_fer. Next I write the solution.")
    cfg = AgentConfig(summary_trigger_tokens=head + 1900, max_context_tokens=head + 2000, max_new_tokens=1600)
    ep = run_episode(policy, tokenizer, task, sandbox, cfg).episode
    assert ep.ended_by == "submit" and policy.summary_calls == 1 and len(ep.segments) == 2


def test_a_segment_records_the_nucleus_its_tokens_were_sampled_from(tokenizer, task, sandbox):
    """top_p never reached the segment (always 1), so the trainer could not refuse truncated logprobs."""
    model = Qwen3ForCausalLM(tiny_config(vocab_size=tokenizer.vocab_size)).eval()
    cfg = AgentConfig(max_turns=1, max_new_tokens=8)
    ep = run_episode(ModelPolicy(model, top_p=0.9, seed=0), tokenizer, task, sandbox, cfg).episode
    assert ep.segments[0].top_p == 0.9


def test_a_first_context_past_the_trigger_is_not_summarized_before_any_turn(tokenizer, task, sandbox):
    head = len(tokenizer.encode(render_messages(first_turn_messages(task), TOOL_SCHEMAS)))
    policy = SummarizingPolicy(tokenizer, [tc("submit")], "nothing yet")
    cfg = AgentConfig(summary_trigger_tokens=head // 2, max_context_tokens=head + 600, max_new_tokens=64)
    ep = run_episode(policy, tokenizer, task, sandbox, cfg).episode
    assert ep.ended_by == "submit" and policy.summary_calls == 0 and ep.num_turns == 1


class EndOfTextPolicy(ScriptedPolicy):
    """Ends each reply with <|endoftext|>, the other stop token, instead of <|im_end|>."""

    def generate(self, context_ids, max_new_tokens, stop_ids):
        out = super().generate(context_ids, max_new_tokens, stop_ids)
        ids = out.token_ids[:-1] + [self.tokenizer.endoftext_id]
        return PolicyOutput(ids, out.logprobs, out.versions)


def test_a_turn_ended_by_endoftext_is_closed_by_the_template(tokenizer, task, sandbox):
    """The next context once read `<|endoftext|>\\n<|im_start|>tool`: the turn never closed."""
    policy = EndOfTextPolicy(tokenizer, [tc("list_files"), tc("submit")])
    ep = run_episode(policy, tokenizer, task, sandbox, AgentConfig()).episode
    assert ep.ended_by == "submit" and ep.malformed_tool_calls == 0
    second = tokenizer.decode(policy.contexts[1], skip_special_tokens=False)
    assert "<|endoftext|><|im_end|>\n<|im_start|>" in second
