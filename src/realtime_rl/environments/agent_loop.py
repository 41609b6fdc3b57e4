"""The multi-turn agent loop: a policy reads a task, calls tools, and ends by submitting or asking.

    result = run_episode(policy, tokenizer, task, runner, AgentConfig())
    result.episode.segments      # token-exact segments for the trainer
    result.workspace             # the files as the agent left them (grade them with grading.grade)

One loop, top to bottom. Each turn the policy generates from the context tokens; the text is parsed
into tool calls; malformed calls become error observations and are counted; well-formed calls run
against the workspace; their outputs are appended as tokens. Training sees exactly the tokens the
policy produced: the context is only ever extended with new tokens, never re-tokenized.

Self-summarization: when a segment's context passes `summary_trigger_tokens`, the policy is asked to
summarize its work; that summary (policy tokens, trained like any others) closes the segment and a
new one starts from the system prompt, the task and the summary. All segments share the episode's
reward.

Fresh attempts (`AgentConfig.attempts` > 1): when a run of the visible tests fails and attempts remain, the
attempt is abandoned, its workspace and context dropped, and the task starts again from the system prompt
(a new segment, its own turn and summary budgets): each attempt is a one-attempt episode, and the episode's
workspace is its last attempt's. A small policy rewrites its program after a failing run far less often
than a fresh sample passes (BENCHMARKS.md, learn). Not here: grading (grading.py), rewards (rewards/),
batching of many episodes (rollout/).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from realtime_rl.config import AgentConfig
from realtime_rl.environments.tasks import Task
from realtime_rl.environments.tools import TOOL_SCHEMAS, TestRunner, Tools, Workspace
from realtime_rl.model.chat import IM_END, IM_START, parse_assistant, render_messages, render_tool_responses
from realtime_rl.model.tokenizer import Tokenizer
from realtime_rl.types import Episode, EpisodeEnd, Segment

SYSTEM_PROMPT = (
    "You are a coding agent working in a small repository. Use the tools to read the files, write the "
    "solution, run the tests, and submit when the tests pass."
)
SUMMARY_REQUEST = (
    "Your context is full. Summarize your work so far for yourself: the task, what you changed, the last "
    "test results, and what remains. Reply with the summary only."
)
SUMMARY_PREFIX = "Summary of your earlier work on this task:\n"


@dataclass
class PolicyOutput:
    token_ids: list[int]
    """Generated tokens, including the stop token when one was generated."""
    logprobs: list[float]
    """Behaviour logprob of each generated token."""
    versions: list[int]
    """Policy version that generated each token (weights may change mid-generation)."""
    routing: np.ndarray | None = None
    """MoE routing of every input position of this call: [len(context) + len(token_ids) - 1, layers, k]."""
    temperature: float = 1.0
    """What the tokens were sampled at (the logprobs are of softmax(logits / temperature))."""
    top_p: float = 1.0
    """The nucleus they were sampled from (below 1 the logprobs are of a truncated distribution)."""


class Policy(Protocol):
    """Anything that continues a token context: a scripted policy, the local model, the engine."""

    def generate(self, context_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> PolicyOutput: ...


@dataclass
class EpisodeResult:
    episode: Episode
    workspace: Workspace


@dataclass
class _SegmentBuilder:
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routing: list[np.ndarray] = field(default_factory=list)
    routed: int = 0  # positions whose routing is recorded
    temperature: float | None = None
    top_p: float | None = None

    def add_context(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.loss_mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_generated(self, out: PolicyOutput) -> None:
        if self.temperature is not None and out.temperature != self.temperature:
            raise ValueError(f"a segment sampled at temperatures {self.temperature} and {out.temperature}")
        self.temperature = out.temperature
        if self.top_p is not None and out.top_p != self.top_p:
            raise ValueError(f"a segment sampled with top_p {self.top_p} and {out.top_p}")
        self.top_p = out.top_p
        start = len(self.token_ids)
        if out.routing is not None:
            # Keep inference's routing for the positions this call computed that we have not recorded.
            self.routing.append(np.asarray(out.routing[self.routed:]))
            self.routed = start + len(out.token_ids) - 1
        self.token_ids += out.token_ids
        self.loss_mask += [True] * len(out.token_ids)
        self.logprobs += out.logprobs
        self.versions += out.versions

    def build(self) -> Segment:
        routing = None
        if self.routing:
            routing = np.concatenate(self.routing)
            pad = len(self.token_ids) - len(routing)
            if pad > 0:  # positions never fed to the model (the final tokens)
                routing = np.concatenate([routing, np.zeros((pad, *routing.shape[1:]), routing.dtype)])
        return Segment(
            token_ids=np.asarray(self.token_ids, dtype=np.int32),
            loss_mask=np.asarray(self.loss_mask, dtype=bool),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            versions=np.asarray(self.versions, dtype=np.int32),
            routing=routing,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
        )


def _writes(calls: list[Any], workspace: Workspace) -> dict[str, str]:
    """path -> content of each well-formed write_file call among `calls` (the last to a path wins): what a
    reply wrote, for telling a first attempt's kind (train/corpus.py classify_solution)."""
    writes = {}
    for call in calls:
        if call.function.name != "write_file":
            continue
        args = json.loads(call.function.arguments)  # the parser produced it: always a JSON object
        if isinstance(args.get("path"), str) and isinstance(args.get("content"), str):
            try:
                writes[workspace.normalize(args["path"])] = args["content"]
            except ValueError:  # a path outside the workspace: the tool refuses it, nothing was written
                continue
    return writes


def task_prompt(task: Task) -> str:
    files = ", ".join([*task.solution_files, *task.test_files])
    return f"{task.instructions.strip()}\n\nFiles: {files}. The visible tests are in {', '.join(task.test_files)}."


def first_turn_messages(task: Task) -> list[dict[str, Any]]:
    """The messages the loop opens an episode with (offered with TOOL_SCHEMAS): the system prompt, the task."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task_prompt(task)}]


TRUNCATED = "\n[truncated: the rest did not fit in the context]"


def _observation_tokens(tokenizer: Tokenizer, observations: list[str], room: int | None) -> list[int]:
    """The tool responses' tokens; with `room` (tokens), each observation is cut short, by the same share, until
    they fit: a long observation must not leave the context too full to summarize it."""
    tokens = tokenizer.encode(render_tool_responses(observations, add_generation_prompt=False))
    share = 1.0
    for _ in range(12):  # each pass cuts by at least a tenth more; what still does not fit overflows as before
        if room is None or len(tokens) <= room:
            break
        share *= min(0.9, max(room, 0) / len(tokens))
        cut = [o[:int(len(o) * share)] + TRUNCATED if int(len(o) * share) < len(o) else o for o in observations]
        tokens = tokenizer.encode(render_tool_responses(cut, add_generation_prompt=False))
    return tokens


def run_episode(
    policy: Policy,
    tokenizer: Tokenizer,
    task: Task,
    runner: TestRunner | None,
    config: AgentConfig,
    episode_id: str | None = None,
) -> EpisodeResult:
    workspace = Workspace(task.workspace())
    tools = Tools(workspace, task.test_files, runner, config.test_timeout_s, config.max_observation_chars)
    stop_ids = tokenizer.stop_token_ids
    assistant_prompt = tokenizer.encode(f"{IM_START}assistant\n")
    turn_end = tokenizer.encode(f"{IM_END}\n")
    base_messages = first_turn_messages(task)

    first_context = tokenizer.encode(render_messages(base_messages, TOOL_SCHEMAS))
    segments: list[Segment] = []
    seg = _SegmentBuilder()
    seg.add_context(first_context)
    summary_lengths: list[int] = []
    ended_by: EpisodeEnd = "max_turns"
    question = None
    turns = tool_calls = malformed = tool_errors = 0
    attempt, attempt_turns, attempt_summaries = 1, 0, 0
    first_reply: dict[str, Any] | None = None

    summary_request = tokenizer.encode(render_messages([{"role": "user", "content": SUMMARY_REQUEST}],
                                                       add_generation_prompt=True))
    segment_turns = 0  # turns since the segment began: a context with none has nothing to summarize
    while attempt_turns < config.max_turns:
        # Self-summarize when the context is past its budget, or the next turn would not fit in it, then restart
        # the segment from the summary.
        full = len(seg.token_ids) + len(assistant_prompt) + config.max_new_tokens > config.max_context_tokens
        if ((len(seg.token_ids) > config.summary_trigger_tokens or full)
                and attempt_summaries < config.max_summaries and segment_turns > 0):
            seg.add_context(summary_request)
            if len(seg.token_ids) + config.max_summary_tokens > config.max_context_tokens:
                ended_by = "context_overflow"
                break
            out = policy.generate(seg.token_ids, config.max_summary_tokens, stop_ids)
            seg.add_generated(out)
            segments.append(seg.build())
            summary = tokenizer.decode([t for t in out.token_ids if t not in stop_ids], skip_special_tokens=True)
            summary_lengths.append(len(out.token_ids))
            attempt_summaries += 1
            seg = _SegmentBuilder()
            restart = [*base_messages, {"role": "user", "content": SUMMARY_PREFIX + summary.strip()}]
            seg.add_context(tokenizer.encode(render_messages(restart, TOOL_SCHEMAS)))
            segment_turns = 0

        seg.add_context(assistant_prompt)
        if len(seg.token_ids) + config.max_new_tokens > config.max_context_tokens:
            ended_by = "context_overflow"
            break
        turns += 1
        attempt_turns += 1
        segment_turns += 1
        out = policy.generate(seg.token_ids, config.max_new_tokens, stop_ids)
        seg.add_generated(out)
        if out.token_ids and out.token_ids[-1] == turn_end[0]:
            seg.add_context(turn_end[1:])  # the policy wrote <|im_end|>; the template's newline follows
        else:
            seg.add_context(turn_end)  # cut off by max_new_tokens or ended by <|endoftext|>: close the turn for it
        text = tokenizer.decode([t for t in out.token_ids if t not in stop_ids], skip_special_tokens=True)
        parsed = parse_assistant(text, TOOL_SCHEMAS)
        if first_reply is None:  # what a user served this reply would have received (rewards.classify_reply)
            first_reply = {"tool_names": [call.function.name for call in parsed.tool_calls],
                           "malformed": len(parsed.errors),
                           "content": parsed.content if parsed.tool_calls else text,
                           "writes": _writes(parsed.tool_calls, workspace)}

        # Observations in the order the calls were written; malformed calls are errors the model sees.
        results: list[tuple[int, str]] = []
        malformed += len(parsed.errors)
        results += [(e.index, f"error: {e.message}") for e in parsed.errors]
        ended = retry = False
        for call in parsed.tool_calls:  # in the order written; the id carries the block's index
            tool_calls += 1
            outcome = tools.call(call.function.name, call.function.arguments)
            tool_errors += outcome.error
            results.append((int(call.id.removeprefix("call_")), outcome.content))
            if outcome.ends_episode:
                ended = True
                ended_by = "ask_user" if outcome.question is not None else "submit"
                question = outcome.question
                break
            if outcome.tests_passed is False and attempt < config.attempts:
                retry = True  # the tests failed: abandon this attempt (its remaining calls never run)
                break
        if ended:
            break
        if not parsed.tool_calls and not parsed.errors:
            ended_by = "answer"  # a plain reply hands control back to the user
            break
        observations = [content for _, content in sorted(results)]
        room = None  # while a turn and a summary may still follow, the observations leave room for the summary
        if attempt_summaries < config.max_summaries and attempt_turns < config.max_turns:
            room = config.max_context_tokens - len(seg.token_ids) - len(summary_request) - config.max_summary_tokens
        seg.add_context(_observation_tokens(tokenizer, observations, room))
        if retry:  # a fresh attempt: the task's files, a new segment from the task's first context
            segments.append(seg.build())
            tools.workspace = workspace = Workspace(task.workspace())
            seg = _SegmentBuilder()
            seg.add_context(first_context)
            attempt, attempt_turns, attempt_summaries, segment_turns = attempt + 1, 0, 0, 0

    segments.append(seg.build())
    episode = Episode(
        episode_id=episode_id or uuid.uuid4().hex,
        task_id=task.task_id,
        segments=segments,
        ended_by=ended_by,
        num_turns=turns,
        num_tool_calls=tool_calls,
        malformed_tool_calls=malformed,
        tool_errors=tool_errors,
        summary_lengths=summary_lengths,
        question=question,
        metadata={"test_runs": tools.test_runs, "test_results": tools.test_results,
                  "first_reply": first_reply, "attempts": attempt},
    )
    return EpisodeResult(episode, workspace)
