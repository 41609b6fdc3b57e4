"""The gateway: an OpenAI-compatible API in front of the engine that records every completion.

    create_app(settings: ServeConfig, engine: AsyncEngine | None = None, store: EventStore | None = None) -> FastAPI
    run_server(settings: ServeConfig) -> None          # `rtrl serve`

Routes: POST /v1/chat/completions (JSON or SSE), POST /v1/feedback (one event or a batch; docs/feedback.md),
GET /v1/models[/{model}], GET /health, GET /metrics. Keys: `Authorization: Bearer <key>` from
settings.api_keys; completions and models need the "inference" scope, feedback the "feedback" scope;
/health and /metrics need no key. Errors have the OpenAI shape.

Not here yet: admin routes (their issue), forcing a tool call (tool_choice "required" or a named
function answers 400), logit_bias and penalties (400).
"""

from realtime_rl.serve.app import create_app
from realtime_rl.serve.server import run_server

__all__ = ["create_app", "run_server"]
