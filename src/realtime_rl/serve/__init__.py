"""The gateway: an OpenAI-compatible API in front of the engine that records every completion.

    create_app(settings: ServeConfig, engine: AsyncEngine | None = None, store: EventStore | None = None,
               candidate_engine: AsyncEngine | None = None) -> FastAPI
    run_server(settings: ServeConfig) -> None          # `rtrl serve`
    serve_in_thread(settings) -> base URL              # a context manager: the gateway on a thread
    serve_in_process(settings, log_path) -> base URL   # ... in a child process (python -m realtime_rl.serve)

Routes: POST /v1/chat/completions and POST /v1/completions (JSON or SSE), POST /v1/feedback (one event
or a batch; docs/feedback.md), GET /v1/models[/{model}], GET and PUT /v1/admin/traffic, GET /health,
GET /metrics. Keys: `Authorization: Bearer <key>` from settings.api_keys; completions and models need the
"inference" scope, feedback the "feedback" scope, /v1/admin the "admin" scope; /health and /metrics need
no key. Errors have the OpenAI shape.

Two arms (arms.py): the champion engine and, once it exists, a candidate (passed in, or built when
settings.candidate_weights first has a version). Users are split between them by a stable hash
(deploy.canary) at the fraction PUT /v1/admin/traffic sets; every answer names its arm in `X-Rtrl-Arm`
and its policy version in `system_fingerprint`, and every record carries its arm.

Not here yet: forcing a tool call (tool_choice "required" or a named function answers 400), logit_bias
and penalties, JSON response formats (no constrained decoding), text completions' `suffix` and batched
prompts (all 400).
"""

from realtime_rl.serve.app import create_app
from realtime_rl.serve.server import (
    free_port, log_tail, run_server, serve_in_process, serve_in_thread, wait_until_serving,
)

__all__ = ["create_app", "free_port", "log_tail", "run_server", "serve_in_process", "serve_in_thread",
           "wait_until_serving"]
