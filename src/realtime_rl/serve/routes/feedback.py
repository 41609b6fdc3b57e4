"""POST /v1/feedback: one event or a batch, acknowledged only once on disk (needs the feedback scope).

The events of a request are written atomically: a bad event is a 400 and an id already recorded with
other content a 409, and then nothing of the request is stored. A retry (same ids, same content) is
acknowledged again and listed under `duplicates`, never stored twice. Concurrent requests share one
transaction and one fsync (collect.GroupCommitter); the answer waits for that commit. If the store
fails or stalls the answer is 503 and the client retries the same batch: nothing is lost, nothing doubles.
"""

from __future__ import annotations

import asyncio
import logging
import queue
from collections import Counter

from fastapi import APIRouter

from realtime_rl.serve.deps import FeedbackKey, StateDep
from realtime_rl.serve.errors import ERROR_RESPONSES, ApiError, ErrorPublic, UnicodeBodyRoute
from realtime_rl.serve.feedback_schemas import FeedbackAckPublic, FeedbackBatchCreate, FeedbackCreate

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["feedback"], route_class=UnicodeBodyRoute)
STORE_TIMEOUT_S = 30.0
_RETRY = {"Retry-After": "1"}
_RESPONSES = {status: v for status, v in ERROR_RESPONSES.items() if status in (400, 401, 403, 503)} | {
    409: {"model": ErrorPublic, "description": "An event id is already recorded with other content"}}


@router.post("/feedback", response_model=FeedbackAckPublic, responses=_RESPONSES)
async def create_feedback(body: FeedbackCreate, state: StateDep, key: FeedbackKey) -> FeedbackAckPublic:
    wire = body.events if isinstance(body, FeedbackBatchCreate) else [body]
    events = [e.to_record(key.name if key is not None else None) for e in wire]
    try:
        future = state.feedback.submit(events)
    except queue.Full:
        raise ApiError(503, "too many feedback events wait for the event store; retry the same batch shortly",
                       code="overloaded", headers=_RETRY) from None
    except RuntimeError:  # closed: the gateway is shutting down
        raise ApiError(503, "the gateway is shutting down; retry the same batch", code="shutting_down",
                       headers=_RETRY) from None
    try:
        result = await asyncio.wait_for(asyncio.wrap_future(future), STORE_TIMEOUT_S)
    except Exception as e:  # a store that fails or stalls: the client retries with the same ids (idempotent)
        log.warning("feedback batch of %d events not acknowledged: %s", len(events), e)
        raise ApiError(503, f"the event store could not record the events ({type(e).__name__}); retry the same "
                            "batch (event ids make retries safe)", code="store_unavailable", headers=_RETRY) from None
    if result.conflicts:
        state.metrics.feedback_conflicts.inc()
        shown = ", ".join(repr(i) for i in result.conflicts[:5]) + (" ..." if len(result.conflicts) > 5 else "")
        raise ApiError(409, f"event id {shown} is already recorded with different content; nothing of this request "
                            "was stored. Resend a retry unchanged, or give a new event a new id.",
                       param="log.record.uid", code="event_id_conflict")
    types = {e.event_id: e.type for e in events}
    for event_type, n in Counter(types[i] for i in result.stored).items():
        state.metrics.feedback_events.labels(event_type).inc(n)
    state.metrics.feedback_duplicates.inc(len(result.duplicates))
    return FeedbackAckPublic(received=len(events), stored=len(result.stored), duplicates=result.duplicates)
