"""POST /v1/chat/completions: validate, render and tokenize, generate, record, answer (JSON or SSE).

The completion is recorded in the event store before the answer is sent: the `id` a client receives
names a record that is already on disk. The session is the `X-Session-Id` header, else
`metadata["session_id"]`; the user is the request's `user` field; both are recorded as given.

The arm (champion or candidate) is picked from the user, else the session (serve/arms.py); it answers
the request, is recorded with it and named in the `X-Rtrl-Arm` header (errors after the pick too);
`system_fingerprint` names the policy version that served ("rtrl-v12").
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Annotated

from fastapi import APIRouter, Header, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from realtime_rl.engine import AsyncEngine
from realtime_rl.serve.completions import (
    ARM_HEADER, RequestInfo, build_choice, build_record, engine_errors, prepare, record_completion, usage,
)
from realtime_rl.serve.deps import InferenceKey, ServeState, StateDep
from realtime_rl.serve.errors import ERROR_RESPONSES, ApiError
from realtime_rl.serve.schemas import ChatCompletionCreate, ChatCompletionPublic
from realtime_rl.serve.streaming import stream_response

router = APIRouter(prefix="/v1", tags=["chat"])


@router.post("/chat/completions", response_model=ChatCompletionPublic, responses=ERROR_RESPONSES)
async def create_chat_completion(
    body: ChatCompletionCreate,
    state: StateDep,
    key: InferenceKey,
    response: Response,
    x_session_id: Annotated[str | None, Header(max_length=256)] = None,
) -> ChatCompletionPublic | StreamingResponse:
    info = RequestInfo(
        completion_id=f"chatcmpl-{uuid.uuid4().hex}", created_at=time.time(), model_name=state.settings.model_name,
        user=body.user, session_id=x_session_id or (body.metadata or {}).get("session_id"),
        api_key_name=key.name if key is not None else None,
    )
    if body.model != info.model_name:
        raise ApiError(404, f"model {body.model!r} does not exist; this gateway serves {info.model_name!r}",
                       param="model", code="model_not_found")
    info.arm, engine = state.arms.pick(info.user, info.session_id)
    try:
        return await _complete(state, engine, body, info, response)
    except ApiError as e:  # errors count against the arm too (overload, timeouts)
        e.headers[ARM_HEADER] = info.arm
        raise


async def _complete(state: ServeState, engine: AsyncEngine, body: ChatCompletionCreate, info: RequestInfo,
                    response: Response) -> ChatCompletionPublic | StreamingResponse:
    try:  # tokenizing a long conversation is CPU work: off the event loop, and bounded
        prepared = await asyncio.wait_for(
            run_in_threadpool(prepare, body, state.tokenizer, engine.engine.max_seq_len, engine.engine.max_batch,
                              state.settings.default_max_tokens),
            state.settings.request_timeout_s)
    except TimeoutError:
        raise ApiError(504, "rendering the prompt took too long", code="timeout") from None
    if body.stream:
        return await stream_response(state, engine, prepared, info)
    with engine_errors(engine.error):
        output = await engine.generate(prepared.prompt_ids, prepared.params, timeout_s=state.settings.request_timeout_s)
    built = [build_choice(s, prepared, state.tokenizer, info.completion_id) for s in output.samples]
    record = build_record(output, prepared, [r for _, r in built], info, stream=False)
    await record_completion(state.store, state.metrics, record)
    response.headers[ARM_HEADER] = info.arm
    return ChatCompletionPublic(
        id=info.completion_id, created=int(info.created_at), model=info.model_name,
        system_fingerprint=f"rtrl-v{record.model_version}", choices=[p for p, _ in built], usage=usage(record),
    )
