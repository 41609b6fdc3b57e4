"""The event store seam: what the gateway records (completions and feedback events), and what a store must do.

    store.add_completion(record)            # durable when it returns: the gateway answers only after it
    store.get_completion("chatcmpl-...")     # feedback arrives later and names the completion by its id
    store.list_completions(since=t0, until=t1, after_seq=cursor, limit=500)   # the trainer reads windows
    store.add_events([FeedbackEvent(...)])  # idempotent by event_id, atomic, durable when it returns
    store.list_events(completion_id=..., session_id=..., since=, until=, after_seq=, limit=)
    store.join_events(...) -> [(event, completion or None)]   # an event may arrive before its completion

A `CompletionRecord` is one chat-completion request (who asked, which model and version, the prompt
tokens, timings) with one `ChoiceRecord` per returned choice (tokens, logprobs, per-token versions,
MoE routing, what the client was answered, and the tool-call parse). A `FeedbackEvent` is one signal a
user gave about a completion or a session (an edit kept, reverted, a dissatisfied follow-up, ...), or
that its answer never reached the user (`undelivered`: recorded, never trained).
Stores keep one table per record kind (completions; choices keyed by (completion_id, choice_index);
feedback_events keyed by event_id) with JSON text for arrays and the routing array as raw bytes plus
its shape and dtype, so that every SQL store shares the row codec below. `seq` is a store-assigned,
strictly increasing cursor per table, in commit order: a reader that remembers the last `seq` it saw
never misses nor repeats a record.

Implementations: sqlite.py (the default, `run_dir/events.sqlite`) and postgres.py (several gateways
and trainers on one database), both on the SQL in sql.py; group.py shares one commit among many
concurrent writers.
"""
from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

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
    """Under the untempered model distribution (the model's own, temperature 1)."""
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
    arm: str = "champion"
    """The traffic arm that served the request ("champion" or "candidate"; see deploy.canary). Records
    written before arms existed read back as "champion"."""
    seq: int | None = None
    """Assigned by the store on insert; strictly increasing within one store."""
    recorded_at: float | None = None
    """Unix seconds when the store wrote the record (assigned by the store)."""

    def __post_init__(self) -> None:
        if not self.choices:
            raise ValueError(f"completion {self.completion_id}: no choices")
        if not 0 < len(self.arm) <= 64:
            raise ValueError(f"completion {self.completion_id}: arm must be 1 to 64 characters")
        if [c.index for c in self.choices] != list(range(len(self.choices))):
            raise ValueError(f"completion {self.completion_id}: choice indices must be 0..n-1 in order")
        for c in self.choices:
            if c.routing is not None and len(c.routing) != len(self.prompt_token_ids) + len(c.token_ids) - 1:
                raise ValueError(f"completion {self.completion_id}: choice {c.index} routing has {len(c.routing)} "
                                 f"rows, expected prompt + completion - 1")

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


EventType = Literal[
    "edit_accepted", "edit_rejected", "edit_persisted", "edit_reverted", "followup_dissatisfied",
    "followup_neutral", "tool_call_error", "session_end", "custom", "undelivered",
]
EVENT_TYPES: tuple[str, ...] = get_args(EventType)
AttributeValue = str | int | float | bool
MAX_ATTRIBUTES = 16


def encodable(text: str) -> bool:
    """Whether text encodes as UTF-8: false for a lone surrogate (U+D800-U+DFFF), which JSON's \\ud800 escape
    can carry and Python's json module accepts, but no database's text column (nor UTF-8 output) can hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass
class FeedbackEvent:
    """One signal about a completion or a session, as the client sent it (plus what the store assigns).

    Invariants (checked on construction; ValueError names the field): `completion_id` or `session_id` is
    set (a `session_end` needs the session, an `undelivered` the completion); a `custom` event has a `name` and a `value`, and only custom
    events have a name; `edit_persisted` has `window_s` > 0 (how long the edit stayed), and only edit
    events have one; tool fields belong to `tool_call_error`; numbers are finite; at most 16 attributes; no
    text holds a NUL character.
    The completion need not exist yet: events are joined to completions when read (`join_events`).
    """

    event_id: str
    """Chosen by the client; a retry with the same id and content is a duplicate, not a second event."""
    type: EventType
    completion_id: str | None = None
    """The `id` of the chat completion the event is about."""
    session_id: str | None = None
    """The session (conversation) the event belongs to."""
    choice_index: int | None = None
    """Which choice of an n > 1 completion; None: the completion as a whole (or choice 0)."""
    name: str | None = None
    """The custom event's name (custom events only)."""
    value: float | None = None
    """A numeric value: required for custom events, an optional score for the others."""
    window_s: float | None = None
    """Seconds the edit was watched: edit_persisted (required) and the other edit events (optional)."""
    tool_call_id: str | None = None
    tool_name: str | None = None
    error_type: str | None = None
    """What went wrong with the tool call (tool_call_error only)."""
    user: str | None = None
    attributes: dict[str, AttributeValue] = field(default_factory=dict)
    """Free-form context (task difficulty, editor, ...): string keys, scalar values."""
    occurred_at: float | None = None
    """Unix seconds when the client says the event happened (None: not given)."""
    api_key_name: str | None = None
    """The key that sent the event (not part of the content: a retry under another key is a duplicate)."""
    seq: int | None = None
    """Assigned by the store on insert; strictly increasing within one store, in commit order."""
    recorded_at: float | None = None
    """Unix seconds on the store's clock (SQLite: the writer's host; Postgres: the server), stamped inside the
    write before its commit (assigned by the store; time windows use it; `EventStore.event_horizon`)."""

    def __post_init__(self) -> None:
        where = f"event {self.event_id!r}"
        if not 0 < len(self.event_id) <= 128:
            raise ValueError("event_id must be 1 to 128 characters")
        if self.type not in EVENT_TYPES:
            raise ValueError(f"{where}: type must be one of {', '.join(EVENT_TYPES)}; got {self.type!r}")
        if self.completion_id is None and self.session_id is None:
            raise ValueError(f"{where}: name the completion (its response id) or the session (conversation id)")
        if self.type == "session_end" and self.session_id is None:
            raise ValueError(f"{where}: session_end needs the session (conversation id)")
        if self.type == "undelivered" and self.completion_id is None:
            raise ValueError(f"{where}: undelivered needs the completion (its response id)")
        if self.type == "custom" and (self.name is None or self.value is None):
            raise ValueError(f"{where}: a custom event needs a name and a numeric value")
        if self.type != "custom" and self.name is not None:
            raise ValueError(f"{where}: only custom events have a name; {self.type} is named by its type")
        if self.type == "edit_persisted" and self.window_s is None:
            raise ValueError(f"{where}: edit_persisted needs window_s, the seconds the edit stayed in place")
        if self.window_s is not None and not self.type.startswith("edit_"):
            raise ValueError(f"{where}: window_s belongs to edit events, not {self.type}")
        if self.type != "tool_call_error" and (self.tool_call_id or self.tool_name or self.error_type):
            raise ValueError(f"{where}: tool call id, tool name and error type belong to tool_call_error events")
        for label, number in (("value", self.value), ("occurred_at", self.occurred_at), ("window_s", self.window_s)):
            if number is not None and not math.isfinite(number):
                raise ValueError(f"{where}: {label} must be a finite number")
        if self.window_s is not None and self.window_s <= 0:
            raise ValueError(f"{where}: window_s must be > 0")
        if self.choice_index is not None and self.choice_index < 0:
            raise ValueError(f"{where}: choice_index must be >= 0")
        if len(self.attributes) > MAX_ATTRIBUTES:
            raise ValueError(f"{where}: at most {MAX_ATTRIBUTES} attributes")
        for k, v in self.attributes.items():
            if not isinstance(v, (str, int, float, bool)) or (isinstance(v, float) and not math.isfinite(v)):
                raise ValueError(f"{where}: attribute {k!r} must be a string, a finite number or a boolean")
        texts = (self.event_id, self.completion_id, self.session_id, self.name, self.tool_call_id, self.tool_name,
                 self.error_type, self.user, self.api_key_name, *self.attributes, *self.attributes.values())
        if any(isinstance(text, str) and "\x00" in text for text in texts):
            raise ValueError(f"{where}: text cannot hold NUL characters (U+0000); PostgreSQL's text cannot store them")
        if any(isinstance(text, str) and not text.isascii() and not encodable(text) for text in texts):
            raise ValueError(f"{where}: text holds a lone UTF-16 surrogate (U+D800-U+DFFF), which is not Unicode "
                             "text: no store can encode it")

    def content(self) -> dict[str, Any]:
        """What the client said: everything but the key and what the store assigns. Equal content under
        one id is a retry; different content a conflict."""
        return {"event_id": self.event_id, "type": self.type, "completion_id": self.completion_id,
                "session_id": self.session_id, "choice_index": self.choice_index, "name": self.name,
                "value": self.value, "window_s": self.window_s, "tool_call_id": self.tool_call_id,
                "tool_name": self.tool_name, "error_type": self.error_type, "user": self.user,
                "attributes": self.attributes, "occurred_at": self.occurred_at}

    def content_key(self) -> str:
        """content() as canonical JSON, what a retry must repeat: typed as the client's JSON was (in a dict
        comparison True == 1, so a retry that changed an attribute from true to 1 passed as a duplicate)."""
        content = self.content()
        for name in ("value", "window_s", "occurred_at"):  # float columns: a stored 1 reads back as 1.0
            content[name] = None if content[name] is None else float(content[name])
        return json.dumps(content, sort_keys=True)


@dataclass
class EventBatchResult:
    """What one batch of `add_event_batches` did. A batch with any conflict wrote nothing."""

    stored: list[str] = field(default_factory=list)
    """Ids written now."""
    duplicates: list[str] = field(default_factory=list)
    """Ids already stored (or repeated earlier in the batch) with the same content: acknowledged, not rewritten."""
    conflicts: list[str] = field(default_factory=list)
    """Ids already stored with different content (or repeated in the batch with different content)."""


class EventConflict(ValueError):
    """An event id is already stored with different content; the whole batch was rejected."""

    def __init__(self, event_ids: list[str]) -> None:
        self.event_ids = event_ids
        shown = ", ".join(repr(i) for i in event_ids[:5]) + (" ..." if len(event_ids) > 5 else "")
        super().__init__(f"event id {shown} already recorded with different content; nothing of the batch was "
                         "stored (a retry must resend the same event; a new event needs a new id)")


class EventStore(ABC):
    """Durable storage of completion records and feedback events. Methods are blocking (the gateway calls them from a
    threadpool) and thread-safe; every internal wait is bounded: the store's own lock raises TimeoutError, the
    database's waits its own error (SQLite's busy timeout sqlite3.OperationalError "database is locked", PostgreSQL's
    statement_timeout psycopg's QueryCanceled)."""

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
    def add_event_batches(self, batches: list[list[FeedbackEvent]]) -> list[EventBatchResult]:
        """Write several batches in one transaction (one fsync), each batch atomically; on disk when it returns.

        Per batch: events whose id is new are written; an id already stored (or written by an earlier
        event of these batches) with the same content is a duplicate and is acknowledged without a second
        row; an id stored with different content is a conflict and then nothing of that batch is written
        (the other batches are unaffected). Written events get their `seq` and `recorded_at` set.
        """

    def add_events(self, events: list[FeedbackEvent]) -> EventBatchResult:
        """One atomic, idempotent batch; raises EventConflict (writing nothing) on a conflicting id."""
        (result,) = self.add_event_batches([events])
        if result.conflicts:
            raise EventConflict(result.conflicts)
        return result

    @abstractmethod
    def list_events(self, *, completion_id: str | None = None, session_id: str | None = None,
                    since: float | None = None, until: float | None = None, after_seq: int = 0,
                    limit: int = 1000) -> list[FeedbackEvent]:
        """Events with seq > after_seq, recorded_at in [since, until) and the given completion / session
        (the event's own fields), in seq order, at most `limit`."""

    @abstractmethod
    def join_events(self, *, completion_id: str | None = None, session_id: str | None = None,
                    since: float | None = None, until: float | None = None, after_seq: int = 0,
                    limit: int = 1000) -> list[tuple[FeedbackEvent, CompletionRecord | None]]:
        """As `list_events`, each event with its completion if the store holds it by now (else None).
        `session_id` matches the event's session or that of its completion."""

    @abstractmethod
    def count_events(self) -> int:
        """How many feedback events the store holds."""

    @abstractmethod
    def event_horizon(self) -> float:
        """A time by which every event the store stamped earlier (`recorded_at`) is committed and listed: an event
        is stamped inside its write, before its commit, so a reader that settles by the wall clock alone could
        miss one still committing and later call it late."""

    @abstractmethod
    def close(self) -> None:
        """Release the connection; later calls fail."""

    def __enter__(self) -> EventStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------- row codec
# Shared by every SQL store: column order matches the DDL in sql.py.

COMPLETION_COLUMNS = (
    "completion_id", "seq", "created_at", "recorded_at", "user_id", "session_id", "api_key_name", "model_name",
    "model_version", "prompt_token_ids", "request_json", "num_choices", "stream", "latency_s", "queued_s",
    "first_token_s", "arm",
)
CHOICE_COLUMNS = (
    "completion_id", "choice_index", "finish_reason", "token_ids", "logprobs", "raw_logprobs", "versions", "text",
    "content", "tool_calls", "tool_call_errors", "malformed_tool_calls", "routing", "routing_shape", "routing_dtype",
)
EVENT_COLUMNS = (
    "event_id", "seq", "type", "completion_id", "session_id", "choice_index", "name", "value", "window_s",
    "tool_call_id", "tool_name", "error_type", "user_id", "attributes", "occurred_at", "recorded_at",
    "api_key_name",
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
            r.queued_s, r.first_token_s, r.arm)


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
        first_token_s=v["first_token_s"], stream=bool(v["stream"]), arm=v["arm"], seq=v["seq"],
        recorded_at=v["recorded_at"],
    )


def event_row(e: FeedbackEvent, seq: int, recorded_at: float) -> tuple[Any, ...]:
    return (e.event_id, seq, e.type, e.completion_id, e.session_id, e.choice_index, e.name, e.value, e.window_s,
            e.tool_call_id, e.tool_name, e.error_type, e.user, json.dumps(e.attributes, ensure_ascii=False),
            e.occurred_at, recorded_at, e.api_key_name)


def event_from_row(row: tuple[Any, ...]) -> FeedbackEvent:
    v = dict(zip(EVENT_COLUMNS, row))
    return FeedbackEvent(
        event_id=v["event_id"], type=v["type"], completion_id=v["completion_id"], session_id=v["session_id"],
        choice_index=v["choice_index"], name=v["name"], value=v["value"], window_s=v["window_s"],
        tool_call_id=v["tool_call_id"], tool_name=v["tool_name"], error_type=v["error_type"], user=v["user_id"],
        attributes=json.loads(v["attributes"]), occurred_at=v["occurred_at"], api_key_name=v["api_key_name"],
        seq=v["seq"], recorded_at=v["recorded_at"],
    )
