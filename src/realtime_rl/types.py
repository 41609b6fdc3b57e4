"""Wire types: everything that crosses a process, network or storage boundary is declared here.

Chat messages and tool calls have the OpenAI chat-completions shape (`tool_calls[].function.arguments`
is a JSON *string*), so the gateway can accept and return them unchanged. Parse results carry every
malformed tool call as a `ToolCallError` instead of raising, so a broken call can be scored.

This module imports nothing of ours and no torch.
"""

from __future__ import annotations

from typing import Literal

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

