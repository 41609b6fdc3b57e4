"""ChatML with Hermes-style tool calls: rendering, the equivalent Jinja template, and the parser.

    <|im_start|>system
    {system}

    # Tools
    ...<tools>
    {"type": "function", "function": {...}}
    </tools>...<|im_end|>
    <|im_start|>user
    {content}<|im_end|>
    <|im_start|>assistant
    {content}
    <tool_call>
    {"name": "read_file", "arguments": {"path": "a.py"}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    {result}
    </tool_response><|im_end|>

This is the layout Qwen2.5/Qwen3 use. `render_messages` is the Python renderer; `CHAT_TEMPLATE` is
the same thing in Jinja for `tokenizer_config.json`, and a test checks that transformers'
`apply_chat_template` renders exactly our text and tokens. `parse_assistant` splits generated text into
content and tool calls, reporting malformed calls precisely instead of raising or guessing.
"""

from __future__ import annotations

import json
import re
import math
from collections.abc import Sequence
from typing import Any

from realtime_rl.types import ChatMessage, FunctionCall, ParsedAssistant, ToolCall, ToolCallError

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""A tool call's name, as OpenAI's function names (and "."): the renderers write it back unescaped."""
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE]

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

# Jinja twin of render_messages; transformers renders it with trim_blocks and lstrip_blocks.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- (messages[0].content or '') + '\\n\\n' }}{%- endif %}"
    "{{- " + json.dumps(TOOLS_PREAMBLE) + " }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- " + json.dumps(TOOLS_POSTAMBLE) + " }}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + (messages[0].content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- if not message.content and not message.tool_calls %}{{- '\\n' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _as_message(m: ChatMessage | dict[str, Any]) -> ChatMessage:
    return m if isinstance(m, ChatMessage) else ChatMessage.model_validate(m)


def render_tool_call(name: str, arguments: str | dict[str, Any]) -> str:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'{TOOL_CALL_OPEN}\n{{"name": "{name}", "arguments": {args}}}\n{TOOL_CALL_CLOSE}'


def render_messages(
    messages: Sequence[ChatMessage | dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """Render a conversation as ChatML text (special tokens included as text)."""
    msgs = [_as_message(m) for m in messages]
    if not msgs and not tools:
        return f"{IM_START}assistant\n" if add_generation_prompt else ""
    parts: list[str] = []
    has_system = bool(msgs) and msgs[0].role == "system"
    if tools:
        parts.append(f"{IM_START}system\n")
        if has_system:
            parts.append((msgs[0].content or "") + "\n\n")
        parts.append(TOOLS_PREAMBLE)
        for tool in tools:
            parts.append("\n" + json.dumps(tool, ensure_ascii=False))
        parts.append(TOOLS_POSTAMBLE + f"{IM_END}\n")
    elif has_system:
        parts.append(f"{IM_START}system\n{msgs[0].content or ''}{IM_END}\n")
    for i, m in enumerate(msgs):
        if m.role == "system" and i == 0:
            continue
        if m.role in ("user", "system"):
            parts.append(f"{IM_START}{m.role}\n{m.content or ''}{IM_END}\n")
        elif m.role == "assistant":
            parts.append(f"{IM_START}assistant")
            if m.content:
                parts.append("\n" + m.content)
            for call in m.tool_calls or []:
                parts.append("\n" + render_tool_call(call.function.name, call.function.arguments))
            if not m.content and not m.tool_calls:
                parts.append("\n")
            parts.append(f"{IM_END}\n")
        else:  # tool results: consecutive ones share one user turn
            if i == 0 or msgs[i - 1].role != "tool":
                parts.append(f"{IM_START}user")
            parts.append(f"\n{TOOL_RESPONSE_OPEN}\n{m.content or ''}\n{TOOL_RESPONSE_CLOSE}")
            if i == len(msgs) - 1 or msgs[i + 1].role != "tool":
                parts.append(f"{IM_END}\n")
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
    return "".join(parts)


def render_tool_responses(contents: Sequence[str], add_generation_prompt: bool = True) -> str:
    """The text that follows an assistant turn ending in tool calls: one user turn of tool responses.

    Identical to what render_messages emits for a run of `tool` messages (then the generation prompt),
    so an agent loop can append observations as tokens without re-rendering the conversation.
    """
    body = "".join(f"\n{TOOL_RESPONSE_OPEN}\n{c}\n{TOOL_RESPONSE_CLOSE}" for c in contents)
    text = f"{IM_START}user{body}{IM_END}\n"
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def tool_parameters(tools: Sequence[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Map tool name -> its JSON-schema `parameters`, for OpenAI-style or bare function definitions."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool)
        out[fn["name"]] = fn.get("parameters") or {}
    return out


class _NotPortableJson(ValueError):
    """JSON that Python parses but that cannot go back out as JSON clients read: NaN or an infinity (JSON has
    neither; `1e999` overflows to one), or a string holding a lone UTF-16 surrogate (`"\\ud800"`: no UTF-8)."""


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotPortableJson(f"the number {text[:20]} is out of range")
    return value


def _not_json(constant: str) -> float:
    raise _NotPortableJson(f"{constant} is not JSON")


def _loads(text: str) -> Any:
    """json.loads, refusing what the tool call could not be re-serialized as (see _NotPortableJson)."""
    obj = json.loads(text, parse_float=_finite, parse_constant=_not_json)
    try:
        json.dumps(obj, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise _NotPortableJson("a string holds a lone surrogate escape (no UTF-8 for it)") from None
    return obj


def _parse_call(index: int, raw: str, schemas: dict[str, dict[str, Any]] | None) -> ToolCall | ToolCallError:
    def error(kind: str, message: str) -> ToolCallError:
        return ToolCallError(index=index, kind=kind, message=message, raw=raw)  # type: ignore[arg-type]

    try:
        obj = _loads(raw)
    except json.JSONDecodeError as e:
        return error("bad_json", f"tool call {index} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}")
    except _NotPortableJson as e:
        return error("bad_json", f"tool call {index} is not portable JSON: {e}")
    except (ValueError, RecursionError):  # an integer past 4300 digits, nesting past the recursion limit
        return error("bad_json", f"tool call {index} cannot be parsed: a number too long or nesting too deep")
    if not isinstance(obj, dict):
        return error("not_an_object", f"tool call {index} must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return error("missing_name", f'tool call {index} has no "name" string')
    if not TOOL_NAME.fullmatch(name):  # as OpenAI's function names; the renderers write it back unescaped
        return error("missing_name", f"tool call {index} names {name[:80]!r}: a tool's name is 1 to 64 letters, "
                                     "digits, '_', '-' or '.'")
    if schemas is not None and name not in schemas:
        known = ", ".join(sorted(schemas)) or "none"
        return error("unknown_tool", f"tool call {index} names unknown tool {name!r} (available: {known})")
    if "arguments" not in obj:
        return error("missing_arguments", f'tool call {index} ({name}) has no "arguments" object')
    args = obj["arguments"]
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = _loads(args)
        except (ValueError, RecursionError):  # not JSON, not portable, too many digits or too deep, as above
            return error("bad_arguments", f"tool call {index} ({name}): arguments string is not JSON")
    if not isinstance(args, dict):
        return error("bad_arguments", f"tool call {index} ({name}): arguments must be an object")
    schema = (schemas or {}).get(name) or {}
    missing = [p for p in schema.get("required", []) if p not in args]
    if missing:
        return error("missing_arguments", f"tool call {index} ({name}) lacks required arguments: {', '.join(missing)}")
    props = schema.get("properties")
    if props is not None and schema.get("additionalProperties") is False:
        extra = sorted(set(args) - set(props))
        if extra:
            return error("bad_arguments", f"tool call {index} ({name}) got unknown arguments: {', '.join(extra)}")
    return ToolCall(
        id=f"call_{index}",
        function=FunctionCall(name=name, arguments=json.dumps(args, ensure_ascii=False)),
    )


def parse_assistant(text: str, tools: Sequence[dict[str, Any]] | None = None) -> ParsedAssistant:
    """Split assistant text (without <|im_end|>) into content, tool calls and malformed calls.

    With `tools`, names are checked against them and required arguments against their schemas.
    Never raises on model output.
    """
    schemas = tool_parameters(tools) if tools is not None else None
    content_parts: list[str] = []
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    rest, index = text, 0
    while True:
        open_at = rest.find(TOOL_CALL_OPEN)
        close_at = rest.find(TOOL_CALL_CLOSE)
        if close_at != -1 and (open_at == -1 or close_at < open_at):
            errors.append(ToolCallError(index=index, kind="unopened", raw=rest[: close_at + len(TOOL_CALL_CLOSE)],
                                        message=f"{TOOL_CALL_CLOSE} without a matching {TOOL_CALL_OPEN}"))
            index += 1
            content_parts.append(rest[:close_at])
            rest = rest[close_at + len(TOOL_CALL_CLOSE):]
            continue
        if open_at == -1:
            content_parts.append(rest)
            break
        content_parts.append(rest[:open_at])
        body_start = open_at + len(TOOL_CALL_OPEN)
        body_end = rest.find(TOOL_CALL_CLOSE, body_start)
        if body_end == -1:
            errors.append(ToolCallError(index=index, kind="unclosed", raw=rest[open_at:],
                                        message=f"tool call {index}: {TOOL_CALL_OPEN} is never closed"))
            break
        result = _parse_call(index, rest[body_start:body_end].strip(), schemas)
        (calls if isinstance(result, ToolCall) else errors).append(result)  # type: ignore[arg-type]
        index += 1
        rest = rest[body_end + len(TOOL_CALL_CLOSE):]
    content = "\n".join(p.strip("\n") for p in content_parts if p.strip())
    return ParsedAssistant(content=content, tool_calls=calls, errors=errors)
