"""GET and PUT /v1/admin/traffic: the split of users between the champion and candidate arms (admin scope).

    GET /v1/admin/traffic  -> {"candidate_fraction", "salt", "arms": {"champion": {"version"}, "candidate": {...}}}
    PUT /v1/admin/traffic     {"candidate_fraction": 0.05, "salt": "exp-8"}   (salt optional: kept when left out)

A PUT is written to run_dir/traffic.json (atomic rename, fsynced) before it takes effect, so a restarted
gateway keeps it; then new requests follow it, and requests in flight finish on the arm they started on.
A fraction outside [0, 1] or an unknown field is a 400; a disk that refuses the file a 503 (nothing changed).
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool

from realtime_rl.serve.arms import Arms, Traffic
from realtime_rl.serve.deps import AdminKey, StateDep
from realtime_rl.serve.errors import ERROR_RESPONSES, ApiError, UnicodeBodyRoute
from realtime_rl.serve.schemas import ArmPublic, ArmsPublic, TrafficPublic, TrafficUpdate

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/admin", tags=["admin"], route_class=UnicodeBodyRoute)
WRITE_TIMEOUT_S = 30.0
_RESPONSES = {status: v for status, v in ERROR_RESPONSES.items() if status in (400, 401, 403, 503)}


def _public(arms: Arms, traffic: Traffic) -> TrafficPublic:
    return TrafficPublic(candidate_fraction=traffic.candidate_fraction, salt=traffic.salt, arms=ArmsPublic(
        champion=ArmPublic(version=arms.version("champion")), candidate=ArmPublic(version=arms.version("candidate"))))


@router.get("/traffic", response_model=TrafficPublic, responses=_RESPONSES)
async def get_traffic(state: StateDep, key: AdminKey) -> TrafficPublic:
    return _public(state.arms, state.arms.traffic)


@router.put("/traffic", response_model=TrafficPublic, responses=_RESPONSES)
async def put_traffic(body: TrafficUpdate, state: StateDep, key: AdminKey) -> TrafficPublic:
    path = state.arms.path
    try:
        traffic = await asyncio.wait_for(
            run_in_threadpool(state.arms.set_traffic, body.candidate_fraction, body.salt), WRITE_TIMEOUT_S)
    except OSError as e:
        log.exception("could not persist the traffic split to %s", path)
        raise ApiError(503, f"could not write {path} ({type(e).__name__}); the split did not change",
                       code="traffic_not_saved", headers={"Retry-After": "1"}) from None
    except TimeoutError:
        raise ApiError(503, f"writing {path} took more than {WRITE_TIMEOUT_S:.0f} s; GET /v1/admin/traffic shows "
                            "whether the new split applied", code="timeout", headers={"Retry-After": "1"}) from None
    log.info("traffic: candidate_fraction=%s salt=%r (key %s)", traffic.candidate_fraction, traffic.salt,
             key.name if key is not None else None)
    return _public(state.arms, traffic)
