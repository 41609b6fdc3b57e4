"""GET /health (no key: for load balancers) and GET /metrics (no key: Prometheus text).

/health is 503 once the champion's engine thread died; `arms` says whether each arm's engine runs and
the version it serves (a dead candidate leaves it 200: its users go to the champion).

/metrics needs no key, as scrapers usually expect: it holds aggregate counters only (no prompts, users
or keys). Expose the gateway beyond a trusted network only behind a proxy that guards /metrics.
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from realtime_rl.engine import AsyncEngine
from realtime_rl.serve.deps import StateDep
from realtime_rl.serve.schemas import ArmHealthPublic, ArmsHealthPublic, HealthPublic

router = APIRouter(tags=["health"])


def _arm(engine: AsyncEngine | None) -> ArmHealthPublic:
    if engine is None:
        return ArmHealthPublic(status=None, version=None)
    return ArmHealthPublic(status="ok" if engine.error is None else "unavailable", version=engine.version)


@router.get("/health", response_model=HealthPublic, responses={503: {"model": HealthPublic}})
async def health(state: StateDep) -> JSONResponse:
    engine = state.engine  # the champion's
    arms = ArmsHealthPublic(champion=_arm(engine), candidate=_arm(state.arms.candidate))
    body = HealthPublic(status=arms.champion.status, model=state.settings.model_name,
                        model_version=engine.version, engine_waiting=engine.engine.num_waiting,
                        engine_running=engine.engine.num_running, arms=arms)
    return JSONResponse(body.model_dump(), status_code=200 if body.status == "ok" else 503)


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(state: StateDep) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
