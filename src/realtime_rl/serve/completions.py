"""From a validated request to engine input, and from engine output to the answer and the record.

    prepared = prepare(body, tokenizer, max_seq_len, max_batch, default_max_tokens)   # may raise ApiError(400)
    public, record = build_choice(sample, prepared, tokenizer, completion_id)      # for each sample
    prepared = prepare_text(body, tokenizer, max_seq_len, max_batch)               # /v1/completions
    public, record = build_text_choice(sample, prepared, tokenizer, completion_id)
    record = build_record(output, prepared, choice_records, info, stream)
    await record_completion(state, record)                  # before the answer; a store failure is a 503
    mark_undelivered(state, record, reason)                 # the client never got it (recorded, never trained)

The prompt is `tokenizer.encode(render_messages(messages, tools, add_generation_prompt=True))`, with the
tools left out when tool_choice is "none". Generation stops at the tokenizer's stop tokens, and with
parallel_tool_calls false (tools offered) at the end of the first tool call, so what is recorded is what
the client got (vLLM generates on and drops the calls after the first). A prompt
that leaves no room in the context, or an explicit max_tokens that does not fit beside it, is a 400;
without max_tokens the default is cut to the room left.

A choice whose text holds tool calls that all parse (against the offered tools) is answered in the
OpenAI `tool_calls` shape with finish_reason "tool_calls"; if any call is malformed, or no tools were
offered, the whole text is answered as content, and the record keeps the parser's errors.

/v1/completions continues a raw prompt (its text encoded as it is, or token ids): no chat template, no
tool-call parsing; generation stops at the same stop tokens. Its record is a completion like any other
(request_json holds `prompt` where a chat's holds `messages`), so feedback can name it.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import logging
import queue
import time
from collections.abc import Awaitable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from realtime_rl.collect import ChoiceRecord, CompletionRecord, FeedbackEvent
from realtime_rl.engine import EngineOverloaded, RequestOutput, SampleOutput, SamplingParams
from realtime_rl.model import Tokenizer, parse_assistant, render_messages
from realtime_rl.model.chat import TOOL_CALL_CLOSE
from realtime_rl.serve.deps import ServeState
from realtime_rl.serve.errors import ApiError
from realtime_rl.serve.schemas import (
    AssistantMessagePublic, ChatCompletionCreate, ChoiceLogprobsPublic, ChoicePublic, CompletionChoicePublic,
    CompletionCreate, CompletionLogprobsPublic, TokenLogprobPublic, TopLogprobPublic, UsagePublic,
)
from realtime_rl.types import ToolCall, ToolCallError

log = logging.getLogger(__name__)
T = TypeVar("T")
STORE_TIMEOUT_S = 180.0
"""Longest wait for the store to record a completion: past what the stores' own bounds usually add up to
(SQLite: its lock 30 s, then its busy timeout 10 s; PostgreSQL: its lock 90 s, then statement_timeout 60 s per
statement), which fail the write and roll it back, so a 503 means not recorded. A store slower than that (a
PostgreSQL write of several slow statements, or a hung one) reaches this wait, and then whether the record
landed is unknown (it may still commit after the 503)."""
ARM_HEADER = "X-Rtrl-Arm"
"""Response header naming the arm ("champion" or "candidate") that served a completion."""


@dataclass
class Prepared:
    body: ChatCompletionCreate | CompletionCreate
    tools: list[dict[str, Any]] | None
    """The tools offered to the model (None when none were given or tool_choice is "none")."""
    prompt_ids: list[int]
    params: SamplingParams
    echo: str = ""
    """A text completion's prompt text, answered before each choice's text (`echo`)."""


def prepare(body: ChatCompletionCreate, tokenizer: Tokenizer, max_seq_len: int, max_batch: int,
            default_max_tokens: int) -> Prepared:
    tools = None
    if body.tools and body.tool_choice != "none":
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
    messages = [m.to_chat() for m in body.messages]
    prompt_ids = tokenizer.encode(render_messages(messages, tools, add_generation_prompt=True))
    stop_ids = list(tokenizer.stop_token_ids)
    if tools and body.parallel_tool_calls is False:
        stop_ids.append(_tool_call_close_id(tokenizer))
    name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    params = _params(body, prompt_ids, "messages", name, body.max_completion_tokens or body.max_tokens,
                     default_max_tokens, stop_ids, (body.top_logprobs or 0) if body.logprobs else 0,
                     max_seq_len, max_batch)
    return Prepared(body, tools, prompt_ids, params)


TEXT_DEFAULT_MAX_TOKENS = 16
"""/v1/completions without max_tokens: OpenAI's default for that API (and vLLM's)."""


def prepare_text(body: CompletionCreate, tokenizer: Tokenizer, max_seq_len: int, max_batch: int,
                 default_max_tokens: int = TEXT_DEFAULT_MAX_TOKENS) -> Prepared:
    """A raw prompt: its text encoded as it is, or its token ids (outside the vocabulary: a 400)."""
    prompt = body.prompt
    prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not prompt_ids:
        raise ApiError(400, "the prompt encodes to no tokens", param="prompt", code="invalid_value")
    if max(prompt_ids) >= tokenizer.vocab_size:
        raise ApiError(400, f"prompt token ids must be in 0..{tokenizer.vocab_size - 1}", param="prompt",
                       code="invalid_value")
    params = _params(body, prompt_ids, "prompt", "max_tokens", body.max_tokens, default_max_tokens,
                     list(tokenizer.stop_token_ids), body.logprobs or 0, max_seq_len, max_batch)
    echo = (prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)) if body.echo else ""
    return Prepared(body, None, prompt_ids, params, echo=echo)


def _params(body: ChatCompletionCreate | CompletionCreate, prompt_ids: list[int], prompt_field: str,
            name: str, requested: int | None, default_max_tokens: int, stop_ids: list[int], top_logprobs: int,
            max_seq_len: int, max_batch: int) -> SamplingParams:
    """The engine's parameters. A prompt that leaves no room in the context, or an explicit max_tokens
    (`name`) that does not fit beside it, is a 400; the default is cut to the room left."""
    room = max_seq_len - len(prompt_ids)
    if room < 1:
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; this model's context holds {max_seq_len} "
                            f"(prompt and completion together). Shorten the {prompt_field}.",
                       param=prompt_field, code="context_length_exceeded")
    if requested is not None and requested > room:
        raise ApiError(400, f"{name}={requested} does not fit: the context holds {max_seq_len} tokens and the "
                            f"prompt takes {len(prompt_ids)}, leaving {room}", param=name,
                       code="context_length_exceeded")
    n = body.n or 1
    if n > max_batch:
        raise ApiError(400, f"n={n} exceeds the engine's batch of {max_batch}", param="n", code="invalid_value")
    try:  # the schema already bounds every field; this keeps any disagreement a 400
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,  # the engine always keeps the top token
            max_tokens=requested or min(default_max_tokens, room),
            n=n, seed=body.seed, stop=body.stops, stop_token_ids=stop_ids, top_logprobs=top_logprobs,
        )
    except ValueError as e:
        raise ApiError(400, str(e), code="invalid_value") from None


def _tool_call_close_id(tokenizer: Tokenizer) -> int:
    """The token that ends a tool call, where the tokenizer has one (Qwen's and ours do)."""
    ids = tokenizer.encode(TOOL_CALL_CLOSE)
    if len(ids) != 1:
        raise ApiError(400, f"parallel_tool_calls=false ends a reply at its first {TOOL_CALL_CLOSE}, which this "
                            f"model's tokenizer splits into {len(ids)} tokens; leave parallel_tool_calls unset",
                       param="parallel_tool_calls", code="unsupported_value")
    return ids[0]


@contextmanager
def engine_errors(engine_error: BaseException | None) -> Iterator[None]:
    """Map engine failures to answers: overload 503 (Retry-After), an engine thread that died (before or
    during the request) 503, timeout 504, a refused prompt 400."""
    stopped = ApiError(503, "the engine has stopped; the gateway cannot serve completions",
                       code="engine_unavailable")
    if engine_error is not None:
        raise stopped
    try:
        yield
    except EngineOverloaded as e:
        raise ApiError(503, f"the engine is overloaded ({e}); retry shortly", code="overloaded",
                       headers={"Retry-After": "1"}) from None
    except RuntimeError:  # AsyncEngine: its thread died while the request waited
        log.exception("the engine stopped during a request")
        raise stopped from None
    except TimeoutError as e:
        raise ApiError(504, f"{e}; ask for fewer tokens or retry", code="timeout") from None
    except ValueError as e:  # the engine's own checks of the prompt and parameters
        raise ApiError(400, str(e), code="invalid_value") from None


def _finish_reason(sample: SampleOutput) -> str:
    assert sample.finish_reason in ("stop", "length"), f"unexpected finish {sample.finish_reason}"
    return sample.finish_reason


def _logprobs(sample: SampleOutput, tokenizer: Tokenizer) -> ChoiceLogprobsPublic:
    """Untempered model logprobs (those the top alternatives come from); a final stop token is left out."""
    ids = sample.token_ids
    if ids and ids[-1] in tokenizer.stop_token_ids and sample.finish_reason == "stop":
        ids = ids[:-1]

    def entry(token_id: int, logprob: float) -> TopLogprobPublic:
        text = tokenizer.decode([token_id])
        return TopLogprobPublic(token=text, logprob=logprob, bytes=list(tokenizer.token_bytes(token_id)))

    content = []
    for t, token_id in enumerate(ids):
        head = entry(token_id, sample.raw_logprobs[t])
        top = [entry(i, lp) for i, lp in sample.top_logprobs[t]] if t < len(sample.top_logprobs) else []
        content.append(TokenLogprobPublic(**head.model_dump(), top_logprobs=top))
    return ChoiceLogprobsPublic(content=content)


def build_choice(sample: SampleOutput, prepared: Prepared, tokenizer: Tokenizer,
                 completion_id: str) -> tuple[ChoicePublic, ChoiceRecord]:
    text = sample.text or ""
    parsed = parse_assistant(text, prepared.tools or [])
    if prepared.tools and parsed.tool_calls and parsed.ok:
        suffix = completion_id.removeprefix("chatcmpl-")
        calls = [ToolCall(id=f"call_{suffix}_{sample.index}_{i}", function=c.function)
                 for i, c in enumerate(parsed.tool_calls)]
        message = AssistantMessagePublic(content=parsed.content or None, tool_calls=calls)
        finish = "tool_calls"
    else:
        calls = parsed.tool_calls
        message = AssistantMessagePublic(content=text)
        finish = _finish_reason(sample)
    logprobs = _logprobs(sample, tokenizer) if prepared.body.logprobs else None
    public = ChoicePublic(index=sample.index, message=message, logprobs=logprobs, finish_reason=finish)
    return public, _choice_record(sample, finish, text, message.content, calls, parsed.errors)


def _choice_record(sample: SampleOutput, finish: str, text: str, content: str | None,
                   calls: list[ToolCall] | None = None, errors: list[ToolCallError] | None = None
                   ) -> ChoiceRecord:
    return ChoiceRecord(
        index=sample.index, token_ids=list(sample.token_ids), logprobs=list(sample.logprobs),
        raw_logprobs=list(sample.raw_logprobs), versions=list(sample.versions), finish_reason=finish,
        text=text, content=content, tool_calls=calls or [], tool_call_errors=errors or [],
        routing=sample.routing,
    )


def build_text_choice(sample: SampleOutput, prepared: Prepared, tokenizer: Tokenizer,
                      completion_id: str) -> tuple[CompletionChoicePublic, ChoiceRecord]:
    """A /v1/completions choice: the text as generated (no tool-call parsing), after the echoed prompt."""
    text = sample.text or ""
    finish = _finish_reason(sample)
    logprobs = None
    if prepared.body.logprobs is not None:
        content = _logprobs(sample, tokenizer).content or []
        offsets = text_offsets(sample.token_ids[:len(content)], tokenizer, len(prepared.echo))
        logprobs = _text_logprobs(content, offsets)
    public = CompletionChoicePublic(index=sample.index, text=prepared.echo + text, logprobs=logprobs,
                                    finish_reason=finish)
    return public, _choice_record(sample, finish, text, text)


def text_offsets(token_ids: list[int], tokenizer: Tokenizer, start: int) -> list[int]:
    """Where each token begins in the answered text (after `start` characters of echoed prompt). The
    tokens' bytes go through an incremental UTF-8 decoder, as the text was decoded: a token whose text is
    whole sits where that text ends up; one that holds part of a character (or bytes that never make one)
    sits where its character starts; a special token dropped from the text, where the text goes on."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, length = [], start
    for token in token_ids:
        piece = tokenizer.decode([token], skip_special_tokens=True)
        emitted = decoder.decode(tokenizer.token_bytes(token)) if piece else ""
        whole = piece and "\ufffd" not in piece and emitted.endswith(piece)
        offsets.append(length + len(emitted) - len(piece) if whole else length)
        length += len(emitted)
    return offsets


def _text_logprobs(content: list[TokenLogprobPublic], offsets: list[int]) -> CompletionLogprobsPublic:
    """The legacy shape: parallel lists, each token's alternatives as {text: logprob} with the sampled token
    among them."""
    return CompletionLogprobsPublic(
        tokens=[c.token for c in content], token_logprobs=[c.logprob for c in content],
        top_logprobs=[{**{t.token: t.logprob for t in c.top_logprobs}, c.token: c.logprob} for c in content],
        text_offset=offsets)


@dataclass
class RequestInfo:
    """Who asked, when, and the id the answer and the record share."""

    completion_id: str
    created_at: float
    model_name: str
    user: str | None
    session_id: str | None
    api_key_name: str | None
    arm: str = "champion"
    """The traffic arm serving the request."""


def oldest_version(output: RequestOutput) -> int:
    """The policy version of a completion: its oldest token's (weights can swap between decode steps)."""
    return min(min(s.versions) for s in output.samples)


def build_record(output: RequestOutput, prepared: Prepared, choices: list[ChoiceRecord], info: RequestInfo,
                 stream: bool) -> CompletionRecord:
    return CompletionRecord(
        completion_id=info.completion_id, created_at=info.created_at, model_name=info.model_name,
        model_version=oldest_version(output), prompt_token_ids=list(output.prompt_ids),
        choices=choices, request_json=prepared.body.model_dump_json(exclude_none=True), user=info.user,
        session_id=info.session_id, api_key_name=info.api_key_name, latency_s=time.time() - info.created_at,
        queued_s=output.queued_s, first_token_s=output.first_token_s, stream=stream, arm=info.arm,
    )


async def record_completion(state: ServeState, record: CompletionRecord) -> None:
    """Write the record before the answer goes out; a store that fails or stalls is a 503, never a lost record.
    A write that outlasted STORE_TIMEOUT_S may still commit after the 503: it is marked undelivered. A store that
    failed by itself wrote nothing (its lock's TimeoutError included): no mark, which would name a completion that
    never exists."""
    def write() -> Exception | None:  # the store's own failure comes back as a value, apart from the deadline's
        try:
            state.store.add_completion(record)
        except Exception as e:  # the store is a real boundary: disk full, locked, closed, slow
            return e
        return None

    try:
        failed = await asyncio.wait_for(run_in_threadpool(write), STORE_TIMEOUT_S)
    except asyncio.CancelledError:  # the client left (or the server stops) mid-write; the write may still commit
        mark_undelivered(state, record, "client_disconnected")
        raise
    except TimeoutError:
        failed = TimeoutError(f"the write took more than {STORE_TIMEOUT_S} s")
        mark_undelivered(state, record, "store_timeout")
    if failed is not None:
        log.error("could not record completion %s", record.completion_id, exc_info=failed)
        raise ApiError(503, f"the event store could not record the completion ({type(failed).__name__}); retry",
                       code="store_unavailable", headers={"Retry-After": "1"}) from None
    metrics = state.metrics
    metrics.completions.inc()
    metrics.prompt_tokens.inc(len(record.prompt_token_ids))
    metrics.generated_tokens.inc(record.completion_tokens)
    metrics.malformed_tool_calls.inc(sum(c.malformed_tool_calls for c in record.choices))


UndeliveredReason = Literal["client_disconnected", "stream_error", "store_timeout"]


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`await work`, unless the client disconnects first: then `work` is cancelled (an engine request is
    aborted, freeing its slots) and the answer is a 499 that nobody reads. The body is read by now, so the
    next ASGI message is the disconnect (as vLLM's with_cancellation listens for it)."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task  # its cleanup aborts the engine request
    if task.cancelled():
        raise ApiError(499, "the client closed the request before the completion was ready",
                       code="client_closed_request")
    return task.result()


def mark_undelivered(state: ServeState, record: CompletionRecord, reason: UndeliveredReason) -> None:
    """Record that a recorded completion's answer never reached the client (it went away after the record, a
    stream ended in an error event, or the record's write outlasted the 503): an `undelivered` event, which
    the reward rules settle as untrainable (nobody saw the reply, so no feedback on it means nothing).
    Synchronous and never raises: it runs where the request is being torn down (a cancelled stream); the
    write goes through the feedback group commit, and a failure is logged. Its id is derived from the
    completion's, so marking twice stores one event."""
    state.metrics.undelivered.labels(reason).inc()
    try:
        future = state.feedback.submit([FeedbackEvent(
            event_id=f"undelivered-{record.completion_id}", type="undelivered", completion_id=record.completion_id,
            session_id=record.session_id, user=record.user, attributes={"reason": reason})])
    except (ValueError, queue.Full, RuntimeError) as e:  # full, or closed at shutdown
        log.warning("completion %s was not delivered (%s) and could not be marked: %s", record.completion_id,
                    reason, e)
        return

    def done(f: Future) -> None:
        if f.exception() is not None:
            log.warning("completion %s was not delivered (%s) and could not be marked: %s", record.completion_id,
                        reason, f.exception())

    future.add_done_callback(done)


def usage(record: CompletionRecord) -> UsagePublic:
    prompt = len(record.prompt_token_ids)
    return UsagePublic(prompt_tokens=prompt, completion_tokens=record.completion_tokens,
                       total_tokens=prompt + record.completion_tokens)
