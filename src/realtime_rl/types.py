"""Wire types: everything that crosses a process, network or storage boundary is declared here.

Chat messages and tool calls have the OpenAI chat-completions shape (`tool_calls[].function.arguments`
is a JSON *string*), so the gateway can accept and return them unchanged. Parse results carry every
malformed tool call as a `ToolCallError` instead of raising, so a broken call can be scored.

This module imports nothing of ours and no torch.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class WireModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionCall(WireModel):
    name: str
    arguments: str
    """The arguments as a JSON object serialized to a string (OpenAI convention)."""


class ToolCall(WireModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(WireModel):
    """One chat message. `tool` messages answer a tool call; assistant messages may carry tool calls."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    """For role=tool: the id of the call this message answers."""
    name: str | None = None


ToolCallErrorKind = Literal[
    "unclosed",  # <tool_call> with no </tool_call>
    "unopened",  # </tool_call> with no <tool_call> before it
    "bad_json",  # the body is not valid JSON
    "not_an_object",  # the body is JSON but not an object
    "missing_name",  # no "name" string
    "unknown_tool",  # a name that is not among the offered tools
    "missing_arguments",  # no "arguments", or required arguments absent
    "bad_arguments",  # "arguments" is not an object, or names parameters the tool does not take
]


class ToolCallError(WireModel):
    """A malformed tool call, reported precisely so the reward can penalize it."""

    index: int = Field(ge=0)
    """Position of the call among the <tool_call> blocks of the message."""
    kind: ToolCallErrorKind
    message: str
    """What is wrong, in words a user (or the model, as an observation) can act on."""
    raw: str
    """The text of the block as generated."""


class ParsedAssistant(WireModel):
    """Assistant text split into content, well-formed tool calls and malformed ones."""

    content: str
    tool_calls: list[ToolCall] = Field(default_factory=list)
    errors: list[ToolCallError] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors



# ---------------------------------------------------------------------------------------------- trajectories
# Trajectories travel from rollout workers to the trainer (pickled, or through Ray's object store),
# so they are dataclasses of numpy arrays rather than pydantic models of lists.


@dataclass
class Segment:
    """One self-contained token sequence of an episode: the context window between self-summaries.

    Invariants: token_ids, loss_mask, logprobs and versions share one length T. loss_mask[t] is True
    exactly for tokens the policy generated, never for t = 0 (a reply follows at least one context token);
    logprobs[t] is the behaviour policy's logprob of token t (0 where loss_mask is False); versions[t] is the
    policy version that generated token t (-1 for context tokens). routing, when the policy is MoE, is
    [T, moe_layers, k]: row t is the routing of position t as an input, as inference computed it (the last
    position may be zeros: it was never an input). temperature is the one the generated tokens were sampled
    at: the policy trained is softmax(logits / temperature), the distribution the logprobs are of (0: greedy,
    never trained). top_p is the nucleus they were sampled from (1: the whole distribution; below 1 the logprobs
    are of a truncation whose tail was never sampled, so no ratio corrects it and the trainer refuses it).
    """

    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    routing: np.ndarray | None = None
    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"a segment's temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"a segment's top_p must be in (0, 1], got {self.top_p}")
        if getattr(self.loss_mask, "dtype", None) != np.bool_:  # an integer array indexes positions, not tokens
            raise ValueError(f"a segment's loss_mask must be a numpy bool array, got "
                             f"{getattr(self.loss_mask, 'dtype', type(self.loss_mask).__name__)}")
        n = len(self.token_ids)
        assert len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n, "segment arrays disagree"
        assert self.routing is None or len(self.routing) == n, "routing length differs from token_ids"
        if n and self.loss_mask[0]:
            raise ValueError("a segment's first token cannot be generated: a token is trained as the target of the "
                             "one before it")

    @property
    def num_generated(self) -> int:
        return int(self.loss_mask.sum())

    def through_last_generated(self) -> Segment:
        """The segment up to its last generated token (itself when that ends it): what follows (a last turn's tool
        results) fed no generation and trains nothing, yet a forward over it costs as much as over the rest."""
        trained = np.flatnonzero(self.loss_mask)
        end = int(trained[-1]) + 1 if len(trained) else len(self.token_ids)
        if end == len(self.token_ids):
            return self
        return replace(self, token_ids=self.token_ids[:end], loss_mask=self.loss_mask[:end],
                       logprobs=self.logprobs[:end], versions=self.versions[:end],
                       routing=None if self.routing is None else self.routing[:end])


EpisodeEnd = Literal["submit", "ask_user", "answer", "max_turns", "context_overflow"]


@dataclass
class Episode:
    """A multi-turn agent episode: its segments share one reward (the episode's)."""

    episode_id: str
    task_id: str
    segments: list[Segment]
    ended_by: EpisodeEnd
    num_turns: int
    num_tool_calls: int
    malformed_tool_calls: int
    """Tool calls the parser rejected (bad JSON, unknown tool, missing arguments, ...)."""
    tool_errors: int
    """Well-formed calls that failed (file not found, edit text absent or ambiguous, ...)."""
    group_id: str = ""
    """Episodes sampled for the same task prompt share a group id (GRPO advantages are per group)."""
    passed: bool | None = None
    """Grading outcome (pristine tests in a fresh sandbox); None until graded."""
    reward: float | None = None
    summary_lengths: list[int] = field(default_factory=list)
    """Tokens of each self-summary, in order."""
    question: str | None = None
    """The clarifying question, when the episode ended with ask_user."""
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    @property
    def num_generated(self) -> int:
        """Tokens the policy generated (trained on), over all segments."""
        return sum(s.num_generated for s in self.segments)

    @property
    def succeeded_after_summary(self) -> bool | None:
        """Whether an episode that summarized itself at least once went on to pass; None otherwise."""
        return None if not self.summary_lengths or self.passed is None else self.passed


_EPISODE_FIELDS = ("episode_id", "task_id", "ended_by", "num_turns", "num_tool_calls", "malformed_tool_calls",
                   "tool_errors", "group_id", "passed", "reward", "summary_lengths", "question", "metadata")
_SEGMENT_ARRAYS = ("token_ids", "loss_mask", "logprobs", "versions", "routing")


def episode_to_bytes(episode: Episode) -> bytes:
    """An episode as one .npz blob: a JSON header (scalar fields, metadata) and the segments' arrays.

    No pickle: the bytes can come from another process or machine and are read with allow_pickle=False.
    """
    header = {name: getattr(episode, name) for name in _EPISODE_FIELDS}
    header["num_segments"] = len(episode.segments)
    arrays: dict[str, np.ndarray] = {"header": np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)}
    for i, seg in enumerate(episode.segments):
        for name in _SEGMENT_ARRAYS:
            value = getattr(seg, name)
            if value is not None:
                arrays[f"{i}/{name}"] = value
        arrays[f"{i}/temperature"] = np.float64(seg.temperature)
        arrays[f"{i}/top_p"] = np.float64(seg.top_p)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def episode_from_bytes(data: bytes) -> Episode:
    """Inverse of episode_to_bytes; raises ValueError on bytes that are not an episode."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            header = json.loads(npz["header"].tobytes())
            segments = []
            for i in range(header.pop("num_segments")):
                arrays = {name: npz[f"{i}/{name}"] if f"{i}/{name}" in npz.files else None
                          for name in _SEGMENT_ARRAYS}
                # Files from before a scalar was recorded were sampled at 1 from the whole distribution.
                temperature, top_p = (float(npz[f"{i}/{name}"]) if f"{i}/{name}" in npz.files else 1.0
                                      for name in ("temperature", "top_p"))
                segments.append(Segment(**arrays, temperature=temperature, top_p=top_p))
    except (OSError, KeyError, TypeError, ValueError, zipfile.BadZipFile, AssertionError) as e:
        raise ValueError(f"not a serialized episode: {e}") from None
    return Episode(segments=segments, **header)
