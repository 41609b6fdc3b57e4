"""Request dependencies: the gateway's state and bearer-key authorization, as `Annotated` aliases.

    async def handler(state: StateDep, key: InferenceKey): ...     # or FeedbackKey, AdminKey

A request without a valid key gets 401 with `WWW-Authenticate: Bearer`; a valid key without the
route's scope gets 403. With `allow_unauthenticated` every request passes and the key is None.
Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from realtime_rl.collect import EventStore, GroupCommitter
from realtime_rl.config import ApiKey, ServeConfig
from realtime_rl.engine import AsyncEngine
from realtime_rl.model import Tokenizer
from realtime_rl.serve.arms import Arms
from realtime_rl.serve.errors import ApiError
from realtime_rl.serve.metrics import GatewayMetrics

Scope = Literal["inference", "feedback", "admin"]


@dataclass
class ServeState:
    """What every request needs; built by the app's lifespan, kept in `app.state.serve`."""

    settings: ServeConfig
    engine: AsyncEngine
    """The champion arm's engine."""
    store: EventStore
    tokenizer: Tokenizer
    metrics: GatewayMetrics
    started_at: int
    feedback: GroupCommitter
    """Writes feedback events: concurrent requests share one transaction and one fsync."""
    arms: Arms
    """The champion (`engine`) and the candidate arm, and the split of users between them."""

    def find_key(self, secret: str) -> ApiKey | None:
        found = None
        for key in self.settings.api_keys:  # no early exit: the time taken does not depend on which key matched
            if hmac.compare_digest(key.key.encode(), secret.encode()):
                found = key
        return found


def get_state(request: Request) -> ServeState:
    return request.app.state.serve


StateDep = Annotated[ServeState, Depends(get_state)]

_bearer = HTTPBearer(auto_error=False, description="An API key from ServeConfig.api_keys")
BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def require(scope: Scope) -> Callable[[ServeState, HTTPAuthorizationCredentials | None], ApiKey | None]:
    def check(state: StateDep, credentials: BearerDep) -> ApiKey | None:
        if state.settings.allow_unauthenticated:
            return None
        challenge = {"WWW-Authenticate": "Bearer"}
        if credentials is None:
            raise ApiError(401, "missing API key: send the header Authorization: Bearer <key>",
                           code="missing_api_key", headers=challenge)
        key = state.find_key(credentials.credentials)
        if key is None:
            raise ApiError(401, "invalid API key", code="invalid_api_key", headers=challenge)
        if scope not in key.scopes:
            raise ApiError(403, f"API key {key.name!r} lacks the {scope!r} scope", code="insufficient_scope")
        return key

    return check


InferenceKey = Annotated[ApiKey | None, Depends(require("inference"))]
FeedbackKey = Annotated[ApiKey | None, Depends(require("feedback"))]
AdminKey = Annotated[ApiKey | None, Depends(require("admin"))]
