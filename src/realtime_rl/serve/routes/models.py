"""GET /v1/models and /v1/models/{model}: the one model this gateway serves (needs the inference scope).
A model id may hold "/" ("org/name"), so {model} takes the rest of the path."""

from __future__ import annotations

from fastapi import APIRouter

from realtime_rl.serve.deps import InferenceKey, ServeState, StateDep
from realtime_rl.serve.errors import ERROR_RESPONSES, ApiError
from realtime_rl.serve.schemas import ModelListPublic, ModelPublic

router = APIRouter(prefix="/v1", tags=["models"])


def _model(state: ServeState) -> ModelPublic:
    return ModelPublic(id=state.settings.model_name, created=state.started_at)


@router.get("/models", response_model=ModelListPublic, responses=ERROR_RESPONSES)
async def list_models(state: StateDep, key: InferenceKey) -> ModelListPublic:
    return ModelListPublic(data=[_model(state)])


@router.get("/models/{model:path}", response_model=ModelPublic, responses=ERROR_RESPONSES)
async def get_model(model: str, state: StateDep, key: InferenceKey) -> ModelPublic:
    if model != state.settings.model_name:
        raise ApiError(404, f"model {model!r} does not exist; this gateway serves {state.settings.model_name!r}",
                       param="model", code="model_not_found")
    return _model(state)
