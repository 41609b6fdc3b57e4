"""POST /v1/chat/completions: validate, render and tokenize, generate, record, answer (JSON or SSE).

The completion is recorded in the event store before the answer is sent: the `id` a client receives
names a record that is already on disk. The session is the `X-Session-Id` header, else
`metadata["session_id"]`; the user is the request's `user` field; both are recorded as given.

A client that goes away before a plain (non-stream) answer is ready aborts its engine request, and the
completion is not recorded, as for streams (streaming.py): nobody received it. One that goes away while the
record is written leaves it marked `undelivered` (kept, never trained). A disconnect after that is not seen
(the server drops what it writes to a closed connection).

The arm (champion or candidate) is picked from the user, else the session (serve/arms.py); it answers
the request, is recorded with it and named in the `X-Rtrl-Arm` header (errors after the pick too);
`system_fingerprint` names the policy version that served ("rtrl-v12").

The flow from here on (`serve_completion`) is shared with POST /v1/completions (routes/completions.py);
an `Api` names what differs: the id prefix, preparing the prompt, the choices' and chunks' shapes.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Header, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from realtime_rl.config import ApiKey
from realtime_rl.engine import AsyncEngine
from realtime_rl.serve.completions import (
    ARM_HEADER, Prepared, RequestInfo, build_record, engine_errors, mark_undelivered, prepare, record_completion,
    unless_disconnected, usage,
)
from realtime_rl.serve.deps import InferenceKey, ServeState, StateDep
from realtime_rl.serve.errors import ERROR_RESPONSES, ApiError, UnicodeBodyRoute
from realtime_rl.serve.schemas import (
    MAX_ID_LENGTH, ChatCompletionCreate, ChatCompletionPublic, CompletionCreate, TextCompletionPublic,
)
from realtime_rl.serve.streaming import ChatChunks, Chunks, stream_response

router = APIRouter(prefix="/v1", tags=["chat"], route_class=UnicodeBodyRoute)


@dataclass(frozen=True)
class Api:
    """What /v1/chat/completions and /v1/completions (routes/completions.py) do differently; the rest of a
    request (the model check, the arm, the deadline, recording before answering) is `serve_completion`."""

    id_prefix: str
    prepare: Callable[..., Prepared]
    """(body, tokenizer, max_seq_len, max_batch, default_max_tokens) -> Prepared"""
    chunks: type[Chunks]
    """The stream's shape; its build_choice builds a plain answer's choices too."""
    answer: type[ChatCompletionPublic] | type[TextCompletionPublic]
    default_max_tokens: int | None = None
    """Without max_tokens; None: the gateway's setting."""


CHAT = Api("chatcmpl-", prepare, ChatChunks, ChatCompletionPublic)


@router.post("/chat/completions", response_model=ChatCompletionPublic, responses=ERROR_RESPONSES)
async def create_chat_completion(
    body: ChatCompletionCreate,
    state: StateDep,
    key: InferenceKey,
    request: Request,
    response: Response,
    x_session_id: Annotated[str | None, Header(max_length=MAX_ID_LENGTH)] = None,
) -> ChatCompletionPublic | StreamingResponse:
    return await serve_completion(CHAT, body, state, key, request, response, x_session_id)


async def serve_completion(api: Api, body: ChatCompletionCreate | CompletionCreate, state: ServeState,
                           key: ApiKey | None, request: Request, response: Response, x_session_id: str | None
                           ) -> ChatCompletionPublic | TextCompletionPublic | StreamingResponse:
    info = RequestInfo(
        completion_id=f"{api.id_prefix}{uuid.uuid4().hex}", created_at=time.time(),
        model_name=state.settings.model_name, user=body.user,
        session_id=x_session_id or (body.metadata or {}).get("session_id"),
        api_key_name=key.name if key is not None else None,
    )
    if body.model != info.model_name:
        raise ApiError(404, f"model {body.model!r} does not exist; this gateway serves {info.model_name!r}",
                       param="model", code="model_not_found")
    info.arm, engine = state.arms.pick(info.user, info.session_id)
    try:
        return await _complete(api, state, engine, body, info, request, response)
    except ApiError as e:  # errors count against the arm too (overload, timeouts)
        e.headers[ARM_HEADER] = info.arm
        raise


async def _complete(api: Api, state: ServeState, engine: AsyncEngine,
                    body: ChatCompletionCreate | CompletionCreate, info: RequestInfo, request: Request,
                    response: Response) -> ChatCompletionPublic | TextCompletionPublic | StreamingResponse:
    deadline = time.monotonic() + state.settings.request_timeout_s  # one budget for rendering and generating
    default_max_tokens = api.default_max_tokens or state.settings.default_max_tokens
    try:  # tokenizing a long conversation is CPU work: off the event loop, and bounded
        prepared = await asyncio.wait_for(
            run_in_threadpool(api.prepare, body, state.tokenizer, engine.engine.max_seq_len,
                              engine.engine.max_batch, default_max_tokens),
            state.settings.request_timeout_s)
    except TimeoutError:
        raise ApiError(504, "rendering the prompt took too long", code="timeout") from None
    left = deadline - time.monotonic()
    if left <= 0:
        raise ApiError(504, "rendering the prompt took the request's whole time", code="timeout")
    if body.stream:
        return await stream_response(request, state, engine, prepared, info, left, api.chunks)
    with engine_errors(engine.error):
        output = await unless_disconnected(request, engine.generate(prepared.prompt_ids, prepared.params,
                                                                     timeout_s=left))
    built = await run_in_threadpool(  # decoding (logprobs: every alternative) is CPU work: off the event loop
        lambda: [api.chunks.build_choice(s, prepared, state.tokenizer, info.completion_id)
                 for s in output.samples])
    record = build_record(output, prepared, [r for _, r in built], info, stream=False)
    await record_completion(state, record)
    if await request.is_disconnected():  # gone while the record was written: recorded, never trained
        mark_undelivered(state, record, "client_disconnected")
        raise ApiError(499, "the client closed the request before the completion was sent",
                       code="client_closed_request")
    response.headers[ARM_HEADER] = info.arm
    return api.answer(
        id=info.completion_id, created=int(info.created_at), model=info.model_name,
        system_fingerprint=f"rtrl-v{record.model_version}", choices=[p for p, _ in built], usage=usage(record),
    )
