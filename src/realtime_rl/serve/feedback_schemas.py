"""Wire types of POST /v1/feedback (docs/feedback.md): one event or a batch, and the acknowledgement.

Keys are OpenTelemetry attribute names where one exists (docs/feedback.md has the mapping): an event reads
like the attributes of an OTel log record about the completion it names.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from realtime_rl.collect import MAX_ATTRIBUTES, EventType, FeedbackEvent
from realtime_rl.serve.schemas import MAX_ID_LENGTH, ApiModel


MAX_FEEDBACK_BATCH = 1000
_Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_LENGTH)]


class FeedbackEventCreate(ApiModel):
    """One feedback event. It names the completion (`gen_ai.response.id`, the `id` of the chat
    completion), the session (`gen_ai.conversation.id`), or both; the completion need not be stored yet."""

    event_id: str = Field(alias="log.record.uid", min_length=1, max_length=128, pattern=r"^[!-~]+$")
    """Chosen by the client (a UUID, say): a retry with the same id and content is acknowledged, not stored
    twice; the same id with other content is a 409."""
    type: EventType = Field(alias="event.name")
    completion_id: _Id | None = Field(None, alias="gen_ai.response.id")
    session_id: _Id | None = Field(None, alias="gen_ai.conversation.id")
    choice_index: int | None = Field(None, ge=0, le=4095)
    """Which choice of an n > 1 completion the event is about."""
    name: str | None = Field(None, alias="gen_ai.evaluation.name", pattern=r"^[A-Za-z0-9_.:/-]{1,64}$")
    """The name of a custom event (custom events only)."""
    value: float | None = Field(None, alias="gen_ai.evaluation.score.value")
    """The number a custom event carries (required there; an optional score on the other types)."""
    window_s: float | None = Field(None, gt=0, le=366 * 86400)
    """Seconds the edit was watched: required for edit_persisted (the edit was still there after it)."""
    tool_call_id: _Id | None = Field(None, alias="gen_ai.tool.call.id")
    tool_name: str | None = Field(None, alias="gen_ai.tool.name", min_length=1, max_length=64)
    error_type: str | None = Field(None, alias="error.type", min_length=1, max_length=128)
    user: _Id | None = Field(None, alias="user.id")
    timestamp: float | None = Field(None, ge=0, le=1e11)
    """Unix seconds when the event happened, by the client's clock (the store also records its own)."""
    attributes: dict[Annotated[str, Field(min_length=1, max_length=64)],
                     Annotated[str, Field(max_length=512)] | int | float | bool] = Field(
        default_factory=dict, max_length=MAX_ATTRIBUTES)
    """Free-form context, e.g. {"task.difficulty": 2}."""

    @model_validator(mode="after")
    def _check(self) -> FeedbackEventCreate:
        self.to_record(None)  # FeedbackEvent checks what ties fields together (a custom event has a name, ...)
        return self

    def to_record(self, api_key_name: str | None) -> FeedbackEvent:
        return FeedbackEvent(
            event_id=self.event_id, type=self.type, completion_id=self.completion_id, session_id=self.session_id,
            choice_index=self.choice_index, name=self.name, value=self.value, window_s=self.window_s,
            tool_call_id=self.tool_call_id, tool_name=self.tool_name, error_type=self.error_type, user=self.user,
            attributes=self.attributes, occurred_at=self.timestamp, api_key_name=api_key_name)


class FeedbackBatchCreate(ApiModel):
    """Several events in one request, stored atomically: one bad or conflicting event rejects them all."""

    events: list[FeedbackEventCreate] = Field(min_length=1, max_length=MAX_FEEDBACK_BATCH)


def _feedback_kind(body: Any) -> str:
    return "batch" if isinstance(body, dict) and "events" in body else "event"


FeedbackCreate = Annotated[
    Annotated[FeedbackBatchCreate, Tag("batch")] | Annotated[FeedbackEventCreate, Tag("event")],
    Discriminator(_feedback_kind),
]
"""POST /v1/feedback: one event, or {"events": [...]}."""


class FeedbackAckPublic(ApiModel):
    """Sent only after every event of the request is on disk (or was already)."""

    object: Literal["feedback.ack"] = "feedback.ack"
    received: int
    """Events in the request."""
    stored: int
    """Events written by this request."""
    duplicates: list[str]
    """Ids already recorded with the same content (retries): acknowledged, not stored again."""
