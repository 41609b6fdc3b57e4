"""Server-sent events in the OpenAI chunk format: `data: {chunk}` lines, then `data: [DONE]`. Chat
completions stream `chat.completion.chunk` objects (ChatChunks), text completions `text_completion` ones
(TextChunks); every chunk's `system_fingerprint` is the version of the reply's first token, the record's.

The engine request is submitted before the response starts, so overload (503) and refused prompts
(400) are still plain HTTP errors. Then: a role chunk per choice, content deltas as tokens arrive, and
at the end, once the completion is recorded, the rest of the recorded content and the tool calls, a finish
chunk per choice, a usage chunk when `stream_options.include_usage`, and `[DONE]`. A stream that ends
without `[DONE]` carries an error event instead and was not acknowledged.

Deltas never need retracting: text that may still turn into a stop string, a `<tool_call>` block (when
tools are offered) or an incomplete UTF-8 character is held back until it is decided. A client that
goes away mid-stream aborts the engine request; such a completion is not recorded (it was never
acknowledged, and its logprobs were never computed into an output). One that goes away after the record,
before `[DONE]` was sent (or a stream that ends in an error event there), leaves a record marked
`undelivered` (completions.mark_undelivered): kept, never trained.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from realtime_rl.collect import ChoiceRecord
from realtime_rl.engine import AsyncEngine, RequestOutput, SampleOutput, TokenEvent
from realtime_rl.model import Tokenizer
from realtime_rl.model.chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from realtime_rl.serve.completions import (
    ARM_HEADER, Prepared, RequestInfo, UndeliveredReason, build_choice, build_record, build_text_choice,
    engine_errors, mark_undelivered, oldest_version, record_completion, unless_disconnected, usage,
)
from realtime_rl.serve.deps import ServeState
from realtime_rl.serve.errors import ApiError
from realtime_rl.serve.schemas import (
    ChatCompletionChunkPublic, ChoicePublic, ChunkChoicePublic, CompletionChoicePublic, DeltaPublic,
    FunctionDeltaPublic, TextCompletionPublic, ToolCallDeltaPublic, UsagePublic,
)

log = logging.getLogger(__name__)


class TextStreamer:
    """The decided prefix of one choice's text, fed token by token; `finish` sends the rest of the content
    recorded (for tool calls, the text around them, which parse_assistant joins and trims). With tools
    offered, trailing whitespace is held too: before a tool call the record trims it. Newlines that open
    a reply before its first tool call are the one thing the record trims after they were sent."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str], hold_tool_calls: bool) -> None:
        self.tokenizer = tokenizer
        self.markers = stops + ([TOOL_CALL_OPEN, TOOL_CALL_CLOSE] if hold_tool_calls else [])
        self.hold_space = hold_tool_calls
        self.token_ids: list[int] = []
        self.sent = ""
        self._decoded = (0, "")  # the first k tokens and their text, complete characters only

    def text(self) -> str:
        """The text of every token pushed, decoding only those since the last complete character: byte-level
        tokens decode to the concatenation of their bytes, so a prefix that ends on a whole character keeps
        its text (decoding everything at each token was quadratic in the reply's length)."""
        k, head = self._decoded
        tail = self.tokenizer.decode(self.token_ids[k:], skip_special_tokens=True)
        if not tail.endswith("\ufffd"):
            self._decoded = (len(self.token_ids), head + tail)
        return head + tail

    def push(self, token: int) -> str:
        self.token_ids.append(token)
        text = self.text()
        cut = len(text)
        for marker in self.markers:
            at = text.find(marker)
            cut = min(cut, at if at != -1 else cut)
            for k in range(min(len(marker) - 1, len(text)), 0, -1):  # a suffix that may grow into the marker
                if text.endswith(marker[:k]):
                    cut = min(cut, len(text) - k)
                    break
        while cut > 0 and text[cut - 1] == "\ufffd":  # an incomplete UTF-8 character
            cut -= 1
        return self._advance(text[:cut].rstrip() if self.hold_space else text[:cut])

    def finish(self, content: str) -> str:
        """What `content` adds to the text sent ("" if it does not begin with it: nothing is retracted)."""
        return self._advance(content)

    def _advance(self, decided: str) -> str:
        if len(decided) <= len(self.sent) or not decided.startswith(self.sent):
            return ""
        delta, self.sent = decided[len(self.sent):], decided
        return delta


def _sse(chunk: BaseModel | dict) -> str:
    data = chunk.model_dump_json(exclude_none=True) if isinstance(chunk, BaseModel) else json.dumps(chunk)
    return f"data: {data}\n\n"


class Chunks:
    """How one API shapes a stream: its opening chunks, a text delta, and a choice's closing chunks once the
    completion is recorded (`rest`: what the recorded text adds to the deltas sent)."""

    build_choice: Callable[[SampleOutput, Prepared, Tokenizer, str], tuple[Any, ChoiceRecord]]

    def __init__(self, info: RequestInfo, version: int, prepared: Prepared) -> None:
        self.info, self.fingerprint, self.prepared = info, f"rtrl-v{version}", prepared

    def chunk(self, choices: list[Any], usage_: UsagePublic | None = None) -> str:
        raise NotImplementedError

    def opening(self, n: int) -> list[str]:
        raise NotImplementedError

    def delta(self, index: int, text: str) -> str:
        raise NotImplementedError

    def content(self, public: Any) -> str:
        """The text a choice's deltas add up to."""
        raise NotImplementedError

    def closing(self, public: Any, rest: str) -> Iterator[str]:
        raise NotImplementedError


class ChatChunks(Chunks):
    """/v1/chat/completions' chunks: a role chunk per choice, content deltas, then the rest of the recorded
    content, the tool calls and a finish chunk per choice."""

    build_choice = staticmethod(build_choice)

    def chunk(self, choices: list[ChunkChoicePublic], usage_: UsagePublic | None = None) -> str:
        return _sse(ChatCompletionChunkPublic(id=self.info.completion_id, created=int(self.info.created_at),
                                              model=self.info.model_name, system_fingerprint=self.fingerprint,
                                              choices=choices, usage=usage_))

    def opening(self, n: int) -> list[str]:
        return [self.chunk([ChunkChoicePublic(index=i, delta=DeltaPublic(role="assistant", content=""))
                            for i in range(n)])]

    def delta(self, index: int, text: str) -> str:
        return self.chunk([ChunkChoicePublic(index=index, delta=DeltaPublic(content=text))])

    def content(self, public: ChoicePublic) -> str:
        return public.message.content or ""  # with tool calls, the text around them

    def closing(self, public: ChoicePublic, rest: str) -> Iterator[str]:
        if rest:
            yield self.delta(public.index, rest)
        if public.finish_reason == "tool_calls":
            calls = [ToolCallDeltaPublic(index=j, id=c.id, type="function",
                                         function=FunctionDeltaPublic(name=c.function.name,
                                                                      arguments=c.function.arguments))
                     for j, c in enumerate(public.message.tool_calls or [])]
            yield self.chunk([ChunkChoicePublic(index=public.index, delta=DeltaPublic(tool_calls=calls))])
        yield self.chunk([ChunkChoicePublic(index=public.index, delta=DeltaPublic(), logprobs=public.logprobs,
                                            finish_reason=public.finish_reason)])


class TextChunks(Chunks):
    """/v1/completions' chunks: the echoed prompt first (with `echo`), text deltas, then one chunk per
    choice with the rest of its text, its logprobs and its finish reason."""

    build_choice = staticmethod(build_text_choice)

    def chunk(self, choices: list[CompletionChoicePublic], usage_: UsagePublic | None = None) -> str:
        return _sse(TextCompletionPublic(id=self.info.completion_id, created=int(self.info.created_at),
                                         model=self.info.model_name, system_fingerprint=self.fingerprint,
                                         choices=choices, usage=usage_))

    def opening(self, n: int) -> list[str]:
        echo = self.prepared.echo
        return [self.chunk([CompletionChoicePublic(index=i, text=echo) for i in range(n)])] if echo else []

    def delta(self, index: int, text: str) -> str:
        return self.chunk([CompletionChoicePublic(index=index, text=text)])

    def content(self, public: CompletionChoicePublic) -> str:
        return public.text.removeprefix(self.prepared.echo)

    def closing(self, public: CompletionChoicePublic, rest: str) -> Iterator[str]:
        yield self.chunk([public.model_copy(update={"text": rest})])


async def stream_response(request: Request, state: ServeState, engine: AsyncEngine, prepared: Prepared,
                          info: RequestInfo, timeout_s: float, chunks: type[Chunks] = ChatChunks) -> StreamingResponse:
    """Stream from `engine` (the request's arm), within what is left of the request's time, as `chunks`
    (ChatChunks or TextChunks) shapes them. A client that leaves before the first token (a request queued
    behind others) aborts it there, a 499, as a plain request's does."""
    events = engine.stream(prepared.prompt_ids, prepared.params, timeout_s=timeout_s)
    with engine_errors(engine.error):  # submits the request: overload and refusals are still HTTP errors
        first = await unless_disconnected(request, anext(events))
    # The first token's version: the oldest of every sample's (all n start in one step), so the record's
    # (unless a rollback to older weights lands mid-reply: the record then names the older version).
    version = first.version if first.output is None else oldest_version(first.output)
    return StreamingResponse(_body(state, chunks(info, version, prepared), first, events),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", ARM_HEADER: info.arm})


async def _body(state: ServeState, shape: Chunks, first: TokenEvent,
                events: AsyncIterator[TokenEvent]) -> AsyncIterator[str]:
    prepared, info = shape.prepared, shape.info
    n = prepared.params.n
    hold_tool_calls = prepared.tools is not None
    streamers = [TextStreamer(state.tokenizer, prepared.params.stop, hold_tool_calls) for _ in range(n)]
    try:
        for line in shape.opening(n):
            yield line
        event = first
        while event.output is None:
            delta = streamers[event.index].push(event.token)
            if delta:
                yield shape.delta(event.index, delta)
            with engine_errors(None):  # a timeout (504) or an engine thread that died (503)
                event = await anext(events)
        async with contextlib.aclosing(_finish(state, shape, event.output, streamers)) as lines:
            async for line in lines:  # closed with this stream: a client gone after the record is marked there
                yield line
    except Exception as e:  # the status line is sent (200): the client learns of it from the last event
        if isinstance(e, ApiError):
            err = e
        else:  # a bug
            log.exception("stream %s failed", info.completion_id)
            err = ApiError(500, "internal error; the gateway logged it", code="internal_error")
        state.metrics.stream_errors.labels(info.arm, err.code or "none").inc()
        yield _sse(err.body().model_dump())
    finally:
        await events.aclose()  # aborts the engine request if it is still running (the client went away)


async def _finish(state: ServeState, shape: Chunks, output: RequestOutput,
                  streamers: list[TextStreamer]) -> AsyncIterator[str]:
    prepared, info = shape.prepared, shape.info
    built = await run_in_threadpool(  # decoding (logprobs: every alternative) is CPU work: off the event loop
        lambda: [shape.build_choice(s, prepared, state.tokenizer, info.completion_id)
                 for s in output.samples])
    record = build_record(output, prepared, [r for _, r in built], info, stream=True)
    await record_completion(state, record)  # acknowledged only after this
    reason: UndeliveredReason | None = "client_disconnected"  # closed or cancelled at a yield: the client went away
    try:
        for (public, _), streamer in zip(built, streamers):
            for line in shape.closing(public, streamer.finish(shape.content(public))):
                yield line
        options = prepared.body.stream_options
        if options is not None and options.include_usage:
            yield shape.chunk([], usage(record))
        yield "data: [DONE]\n\n"
        reason = None  # resumed after [DONE] was sent
    except Exception:
        reason = "stream_error"  # the client gets an error event, not the completion
        raise
    finally:
        if reason is not None:
            mark_undelivered(state, record, reason)
