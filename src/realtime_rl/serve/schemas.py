"""Wire types of the gateway: OpenAI chat- and text-completions requests (`...Create`) and answers
(`...Public`), models, health and the admin traffic split. The feedback API's are in feedback_schemas.py.

Requests are validated here, so a bad field is a 400 naming it: parameter ranges, each role's required
fields, tool definitions (JSON-schema objects the tool-call parser can use), unknown fields, and what we
do not implement (non-zero penalties, tool_choice "required" or a named function, JSON response formats,
text completions' suffix and batched prompts) is refused, not ignored.
Messages convert to `realtime_rl.types.ChatMessage`, the type the chat renderer takes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from realtime_rl.types import ChatMessage, ToolCall

MAX_ID_LENGTH = 256
"""Longest session, user and completion id: chat requests and the feedback that names them share it."""


class ApiModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class TextPart(ApiModel):
    type: Literal["text"]
    text: str


class _MessageCreate(ApiModel):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=64)

    def to_chat(self) -> ChatMessage:
        text = "".join(p.text for p in self.content) if isinstance(self.content, list) else self.content
        return ChatMessage(role="system" if self.role == "developer" else self.role, content=text, name=self.name,
                           tool_calls=getattr(self, "tool_calls", None), tool_call_id=getattr(self, "tool_call_id", None))


class SystemMessageCreate(_MessageCreate):
    role: Literal["system"]
    content: str | list[TextPart]


class DeveloperMessageCreate(_MessageCreate):
    """Read as a system message."""

    role: Literal["developer"]
    content: str | list[TextPart]


class UserMessageCreate(_MessageCreate):
    role: Literal["user"]
    content: str | list[TextPart]


class AssistantMessageCreate(_MessageCreate):
    role: Literal["assistant"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)
    # OpenAI and vLLM answers carry these as null, and clients send answers back as history; null only
    refusal: None = None
    annotations: list[dict[str, Any]] | None = Field(None, max_length=128)  # OpenAI's answers: [] (ignored)
    audio: None = None
    function_call: None = None
    reasoning_content: None = None

    @model_validator(mode="after")
    def _check(self) -> AssistantMessageCreate:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessageCreate(_MessageCreate):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str = Field(min_length=1, max_length=256)
    """The id of the call this message answers."""


MessageCreate = Annotated[
    SystemMessageCreate | DeveloperMessageCreate | UserMessageCreate | AssistantMessageCreate | ToolMessageCreate,
    Field(discriminator="role"),
]


def _depth(value: Any, limit: int) -> int:
    if limit < 0 or not isinstance(value, (dict, list)):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(c, limit - 1) for c in children), default=0)


def _check_parameters(schema: dict[str, Any]) -> dict[str, Any]:
    if _depth(schema, 32) > 32:
        raise ValueError("parameters nest deeper than 32 levels")
    if schema.get("type", "object") != "object":
        raise ValueError('parameters must be a JSON schema of "type": "object"')
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
        raise ValueError("parameters.properties must map each argument name to a JSON schema object")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError("parameters.required must be a list of argument names")
    unknown = [r for r in required if "properties" in schema and r not in props]
    if unknown:
        raise ValueError(f"parameters.required names arguments not in properties: {', '.join(unknown)}")
    if not isinstance(schema.get("additionalProperties", True), (bool, dict)):
        raise ValueError("parameters.additionalProperties must be a boolean or a schema")
    return schema


class FunctionDefinition(ApiModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=8192)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return v if v is None else _check_parameters(v)


class ToolDefinition(ApiModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(ApiModel):
    name: str


class NamedToolChoice(ApiModel):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(ApiModel):
    include_usage: bool | None = None


class _GenerationCreate(ApiModel):
    """What chat and text completion requests share. Optional fields may be null (meaning the default)."""

    model: str = Field(min_length=1, max_length=256)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(None, ge=1, le=16)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=MAX_ID_LENGTH)
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16)
    """metadata["session_id"] names the session when no X-Session-Id header does."""
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 4 or not all(0 < len(s) <= 256 for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings of at most 256 characters")
        return v

    @field_validator("user", "metadata")
    @classmethod
    def _stored_text(cls, v: str | dict[str, str] | None) -> str | dict[str, str] | None:
        texts = [v] if isinstance(v, str) else [*v, *v.values()] if v else []
        if any("\x00" in text for text in texts):  # checked before generating, not when the store refuses it
            raise ValueError("NUL characters (U+0000) are not accepted: the event store's text cannot hold them")
        return v

    @field_validator("metadata")
    @classmethod
    def _session(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        session = (v or {}).get("session_id")
        if session is not None and not 0 < len(session) <= MAX_ID_LENGTH:
            raise ValueError(f'metadata["session_id"] takes 1 to {MAX_ID_LENGTH} characters (feedback names '
                             "the session by it, as gen_ai.conversation.id)")
        return v

    @model_validator(mode="after")
    def _check_generation(self) -> _GenerationCreate:
        if self.frequency_penalty or self.presence_penalty:
            raise ValueError("frequency_penalty and presence_penalty are not supported (only 0)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ResponseFormat(ApiModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionCreate(_GenerationCreate):
    """POST /v1/chat/completions."""

    messages: list[MessageCreate] = Field(min_length=1, max_length=4096)
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    """auto (default): tools are offered; none: the prompt is rendered without them."""
    parallel_tool_calls: bool | None = None
    """false (with tools offered): the reply ends with its first tool call. true or unset: as many as the
    model writes."""
    max_completion_tokens: int | None = Field(None, ge=1)
    """Preferred over max_tokens when both are given."""
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    """{"type": "text"} (the default) only: JSON modes need constrained decoding, which the engine lacks."""

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionCreate:
        if self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice):
            raise ValueError('tool_choice "required" and forcing a named function are not supported; '
                             'use "auto" or "none"')
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools must have distinct function names")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.response_format is not None and (self.response_format.type != "text"
                                                 or self.response_format.json_schema is not None):
            raise ValueError(f'response_format "{self.response_format.type}" is not supported (no '
                             'constrained decoding); only "text"')
        return self


class CompletionCreate(_GenerationCreate):
    """POST /v1/completions: a raw prompt continued as it is (no chat template). One prompt per request: a
    string or token ids (a list of one of either is read as that one)."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: int | None = Field(None, ge=1)
    """16 when unset (OpenAI's default for this API), cut to the room the context leaves."""
    logprobs: int | None = Field(None, ge=0, le=20)
    """Each token's logprob and up to this many alternatives (the sampled token added when not among them)."""
    echo: bool | None = None
    """Answer the prompt's text before the completion's."""
    best_of: int | None = Field(None, ge=1, le=16)
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError(f"one prompt per request (got a batch of {len(v)}); send one request each")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        if isinstance(v, list) and min(v) < 0:
            raise ValueError("prompt token ids must be >= 0")
        return v

    @model_validator(mode="after")
    def _check(self) -> CompletionCreate:
        if self.suffix:
            raise ValueError("suffix (fill in the middle) is not supported")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of must equal n (ranking extra samples is not supported)")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (the prompt's logprobs are not computed)")
        return self


# ---------------------------------------------------------------------------------------------- answers


class TopLogprobPublic(ApiModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobPublic(TopLogprobPublic):
    top_logprobs: list[TopLogprobPublic] = Field(default_factory=list)


class ChoiceLogprobsPublic(ApiModel):
    content: list[TokenLogprobPublic] | None = None


class AssistantMessagePublic(ApiModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


FinishReason = Literal["stop", "length", "tool_calls"]


class ChoicePublic(ApiModel):
    index: int
    message: AssistantMessagePublic
    logprobs: ChoiceLogprobsPublic | None = None
    finish_reason: FinishReason


class UsagePublic(ApiModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionPublic(ApiModel):
    """`id` is the completion id under which the gateway recorded it; feedback names it."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    """"rtrl-v{model_version}": the policy version that served the request."""
    choices: list[ChoicePublic]
    usage: UsagePublic


class CompletionLogprobsPublic(ApiModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoicePublic(ApiModel):
    index: int
    text: str
    logprobs: CompletionLogprobsPublic | None = None
    finish_reason: Literal["stop", "length"] | None = None
    """None only in a stream's chunks before the choice's last."""


class TextCompletionPublic(ApiModel):
    """POST /v1/completions' answer, and (with `usage` None until the last) each chunk of its stream."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoicePublic]
    usage: UsagePublic | None = None


class FunctionDeltaPublic(ApiModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaPublic(ApiModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDeltaPublic


class DeltaPublic(ApiModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDeltaPublic] | None = None


class ChunkChoicePublic(ApiModel):
    index: int
    delta: DeltaPublic
    logprobs: ChoiceLogprobsPublic | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunkPublic(ApiModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChunkChoicePublic]
    usage: UsagePublic | None = None


class ModelPublic(ApiModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "realtime-rl"


class ModelListPublic(ApiModel):
    object: Literal["list"] = "list"
    data: list[ModelPublic]


class ArmHealthPublic(ApiModel):
    status: Literal["ok", "unavailable"] | None
    """"unavailable" once the arm's engine thread died (a dead candidate's users go to the champion); null
    while the arm does not exist (no candidate yet)."""
    version: int | None


class ArmsHealthPublic(ApiModel):
    champion: ArmHealthPublic
    candidate: ArmHealthPublic


class HealthPublic(ApiModel):
    """`status` and the engine fields are the champion's: the gateway serves every user while it runs."""

    status: Literal["ok", "unavailable"]
    model: str
    model_version: int
    engine_waiting: int
    engine_running: int
    arms: ArmsHealthPublic


# ---------------------------------------------------------------------------------------------- admin: traffic


class TrafficUpdate(ApiModel):
    """PUT /v1/admin/traffic (and the content of run_dir/traffic.json)."""

    candidate_fraction: float = Field(ge=0.0, le=1.0, strict=True)  # true was 1.0: every user a canary's
    """Share of users the candidate arm serves (0: none, 1: all), by a stable hash of user and salt."""
    salt: str | None = Field(None, min_length=1, max_length=128)
    """A new salt draws a new split of users; left out, the current salt stays."""


class ArmPublic(ApiModel):
    version: int | None
    """The policy version the arm serves; null while the arm does not exist (no candidate yet)."""


class ArmsPublic(ApiModel):
    champion: ArmPublic
    candidate: ArmPublic


class TrafficPublic(ApiModel):
    candidate_fraction: float
    salt: str
    arms: ArmsPublic
