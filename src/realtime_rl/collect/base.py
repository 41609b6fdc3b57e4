"""The event store seam: what the gateway records about every completion, and what a store must do.

    store.add_completion(record)            # durable when it returns: the gateway answers only after it
    store.get_completion("chatcmpl-...")     # feedback arrives later and names the completion by its id
    store.list_completions(since=t0, until=t1, after_seq=cursor, limit=500)   # the trainer reads windows

A `CompletionRecord` is one chat-completion request (who asked, which model and version, the prompt
tokens, timings) with one `ChoiceRecord` per returned choice (tokens, logprobs, per-token versions,
MoE routing, what the client was answered, and the tool-call parse). Stores keep one table per record
kind (completions; choices keyed by (completion_id, choice_index)) with JSON text for arrays and the
routing array as raw bytes plus its shape and dtype, so that a Postgres store can share the row codec
below. `seq` is a store-assigned, strictly increasing cursor: a reader that remembers the last `seq` it
saw never misses nor repeats a record written by the same store.

Implementations: sqlite.py (the default, `run_dir/events.sqlite`). Postgres arrives with the real-time
loop. Feedback events (edits kept, reverted, ...) get their own record kind and table with that issue.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from realtime_rl.types import ToolCall, ToolCallError


@dataclass
class ChoiceRecord:
    """One returned choice. token_ids, logprobs, raw_logprobs and versions share one length T (every
    generated token, the final stop token included). routing, for an MoE policy, is
    [len(prompt) + T - 1, moe_layers, k] (uint8 or int16): row t is the routing of position t as an input.
    """

    index: int
    token_ids: list[int]
    logprobs: list[float]
    """Under the distribution sampled from (0.0 everywhere for greedy decoding)."""
    raw_logprobs: list[float]
    """Under the untempered model distribution (what a trainer at temperature 1 recomputes)."""
    versions: list[int]
    """The policy version whose weights produced each token."""
    finish_reason: str
    """As answered: "stop", "length" or "tool_calls"."""
    text: str
    """The generated text, special tokens dropped and any stop string cut off."""
    content: str | None
    """The message content the client received."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    """Well-formed calls the parser found (returned to the client only when finish_reason is "tool_calls")."""
    tool_call_errors: list[ToolCallError] = field(default_factory=list)
    """Malformed calls, with the parser's error kinds; such a choice was answered as plain content."""
    routing: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not (len(self.logprobs) == len(self.raw_logprobs) == len(self.versions) == n):
            raise ValueError(f"choice {self.index}: token_ids, logprobs, raw_logprobs and versions differ in length")
        if self.routing is not None and self.routing.ndim != 3:
            raise ValueError(f"choice {self.index}: routing must be [positions, moe_layers, k]")

    @property
    def malformed_tool_calls(self) -> int:
        return len(self.tool_call_errors)


@dataclass
class CompletionRecord:
    """One chat-completion request and its choices; `completion_id` is the `id` the client received."""

    completion_id: str
    created_at: float
    """Unix seconds when the request arrived."""
    model_name: str
    model_version: int
    """The oldest policy version that produced any token of the completion (versions are exact per token)."""
    prompt_token_ids: list[int]
    choices: list[ChoiceRecord]
    request_json: str
    """The request as the gateway validated it (messages, tools, parameters), as JSON text."""
    user: str | None = None
    """The request's `user` field."""
    session_id: str | None = None
    """The X-Session-Id header, else metadata["session_id"]."""
    api_key_name: str | None = None
    latency_s: float = 0.0
    """From arrival to the record being written (the answer follows it)."""
    queued_s: float = 0.0
    first_token_s: float = 0.0
    stream: bool = False
    seq: int | None = None
    """Assigned by the store on insert; strictly increasing within one store."""
    recorded_at: float | None = None
    """Unix seconds when the store wrote the record (assigned by the store)."""

    def __post_init__(self) -> None:
        if not self.choices:
            raise ValueError(f"completion {self.completion_id}: no choices")
        if [c.index for c in self.choices] != list(range(len(self.choices))):
            raise ValueError(f"completion {self.completion_id}: choice indices must be 0..n-1 in order")
        for c in self.choices:
            if c.routing is not None and len(c.routing) != len(self.prompt_token_ids) + len(c.token_ids) - 1:
                raise ValueError(f"completion {self.completion_id}: choice {c.index} routing has {len(c.routing)} "
                                 f"rows, expected prompt + completion - 1")

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


class EventStore(ABC):
    """Durable storage of completion records. Methods are blocking (the gateway calls them from a
    threadpool) and thread-safe; every internal wait is bounded and raises TimeoutError when it passes."""

    @abstractmethod
    def add_completion(self, record: CompletionRecord) -> int:
        """Write the record and its choices in one transaction; on disk when it returns.

        Sets and returns `record.seq` (and sets `record.recorded_at`). A duplicate completion_id raises
        ValueError and writes nothing.
        """

    @abstractmethod
    def get_completion(self, completion_id: str) -> CompletionRecord | None:
        """The record with this id, or None."""

    @abstractmethod
    def list_completions(self, *, since: float | None = None, until: float | None = None, after_seq: int = 0,
                         limit: int = 1000) -> list[CompletionRecord]:
        """Records with created_at in [since, until) and seq > after_seq, in seq order, at most `limit`."""

    @abstractmethod
    def count_completions(self) -> int:
        """How many completions the store holds."""

    @abstractmethod
    def close(self) -> None:
        """Release the connection; later calls fail."""

    def __enter__(self) -> EventStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------- row codec
# Shared by every SQL store: column order matches the DDL in sqlite.py (and the Postgres one to come).

COMPLETION_COLUMNS = (
    "completion_id", "seq", "created_at", "recorded_at", "user_id", "session_id", "api_key_name", "model_name",
    "model_version", "prompt_token_ids", "request_json", "num_choices", "stream", "latency_s", "queued_s",
    "first_token_s",
)
CHOICE_COLUMNS = (
    "completion_id", "choice_index", "finish_reason", "token_ids", "logprobs", "raw_logprobs", "versions", "text",
    "content", "tool_calls", "tool_call_errors", "malformed_tool_calls", "routing", "routing_shape", "routing_dtype",
)
_ROUTING_DTYPES = {"uint8", "int16"}


def encode_routing(routing: np.ndarray | None) -> tuple[bytes | None, str | None, str | None]:
    """(raw bytes, JSON shape, dtype name), or three Nones."""
    if routing is None:
        return None, None, None
    if routing.dtype.name not in _ROUTING_DTYPES:
        raise ValueError(f"routing dtype must be one of {sorted(_ROUTING_DTYPES)}, got {routing.dtype}")
    return np.ascontiguousarray(routing).tobytes(), json.dumps(list(routing.shape)), routing.dtype.name


def decode_routing(data: bytes | None, shape: str | None, dtype: str | None) -> np.ndarray | None:
    if data is None:
        return None
    return np.frombuffer(bytes(data), dtype=np.dtype(dtype)).reshape(json.loads(shape)).copy()


def completion_row(r: CompletionRecord) -> tuple[Any, ...]:
    return (r.completion_id, r.seq, r.created_at, r.recorded_at, r.user, r.session_id, r.api_key_name, r.model_name,
            r.model_version, json.dumps(r.prompt_token_ids), r.request_json, len(r.choices), r.stream, r.latency_s,
            r.queued_s, r.first_token_s)


def choice_row(completion_id: str, c: ChoiceRecord) -> tuple[Any, ...]:
    return (completion_id, c.index, c.finish_reason, json.dumps(c.token_ids), json.dumps(c.logprobs),
            json.dumps(c.raw_logprobs), json.dumps(c.versions), c.text, c.content,
            json.dumps([t.model_dump() for t in c.tool_calls]), json.dumps([e.model_dump() for e in c.tool_call_errors]),
            c.malformed_tool_calls, *encode_routing(c.routing))


def choice_from_row(row: tuple[Any, ...]) -> ChoiceRecord:
    v = dict(zip(CHOICE_COLUMNS, row))
    return ChoiceRecord(
        index=v["choice_index"], token_ids=json.loads(v["token_ids"]), logprobs=json.loads(v["logprobs"]),
        raw_logprobs=json.loads(v["raw_logprobs"]), versions=json.loads(v["versions"]),
        finish_reason=v["finish_reason"], text=v["text"], content=v["content"],
        tool_calls=[ToolCall.model_validate(t) for t in json.loads(v["tool_calls"])],
        tool_call_errors=[ToolCallError.model_validate(e) for e in json.loads(v["tool_call_errors"])],
        routing=decode_routing(v["routing"], v["routing_shape"], v["routing_dtype"]),
    )


def completion_from_row(row: tuple[Any, ...], choices: list[ChoiceRecord]) -> CompletionRecord:
    v = dict(zip(COMPLETION_COLUMNS, row))
    return CompletionRecord(
        completion_id=v["completion_id"], created_at=v["created_at"], model_name=v["model_name"],
        model_version=v["model_version"], prompt_token_ids=json.loads(v["prompt_token_ids"]), choices=choices,
        request_json=v["request_json"], user=v["user_id"], session_id=v["session_id"],
        api_key_name=v["api_key_name"], latency_s=v["latency_s"], queued_s=v["queued_s"],
        first_token_s=v["first_token_s"], stream=bool(v["stream"]), seq=v["seq"], recorded_at=v["recorded_at"],
    )
