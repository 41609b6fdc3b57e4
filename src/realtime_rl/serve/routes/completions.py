"""POST /v1/completions: a raw prompt continued, answered as a `text_completion` (JSON or SSE).

The same request flow as chat completions (routes/chat.py `serve_completion`): the model check, the arm,
one time budget, the completion recorded before the answer, `X-Session-Id`, `user` and `metadata` read
alike. What differs is the prompt (text encoded as it is, or token ids; no chat template), the default of
16 new tokens, the answer's shape (`choices[].text`, legacy `logprobs`), and `echo`. One prompt per request;
`suffix`, `logit_bias`, `best_of` other than n, and `echo` with `logprobs` are refused (400).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Request, Response
from fastapi.responses import StreamingResponse

from realtime_rl.serve.completions import TEXT_DEFAULT_MAX_TOKENS, prepare_text
from realtime_rl.serve.deps import InferenceKey, StateDep
from realtime_rl.serve.errors import ERROR_RESPONSES, UnicodeBodyRoute
from realtime_rl.serve.routes.chat import Api, serve_completion
from realtime_rl.serve.schemas import MAX_ID_LENGTH, CompletionCreate, TextCompletionPublic
from realtime_rl.serve.streaming import TextChunks

router = APIRouter(prefix="/v1", tags=["completions"], route_class=UnicodeBodyRoute)
TEXT = Api("cmpl-", prepare_text, TextChunks, TextCompletionPublic, default_max_tokens=TEXT_DEFAULT_MAX_TOKENS)


@router.post("/completions", response_model=TextCompletionPublic, responses=ERROR_RESPONSES)
async def create_completion(
    body: CompletionCreate,
    state: StateDep,
    key: InferenceKey,
    request: Request,
    response: Response,
    x_session_id: Annotated[str | None, Header(max_length=MAX_ID_LENGTH)] = None,
) -> TextCompletionPublic | StreamingResponse:
    return await serve_completion(TEXT, body, state, key, request, response, x_session_id)
