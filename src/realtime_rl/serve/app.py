"""`create_app(settings, engine=None, store=None, candidate_engine=None)`: the gateway as a FastAPI app.

    app = create_app(ServeConfig(checkpoint="runs/demo/checkpoint", allow_unauthenticated=True))
    uvicorn.run(app)                      # or run_server(settings), which `rtrl serve` calls

An engine or store passed in belongs to the caller (the app starts the engine's thread if needed and
never stops or closes them); missing ones are built by the lifespan from the settings (the checkpoint;
the store named by settings.store) and torn down with the app. Feedback events go through a
GroupCommitter the app owns (one writer thread; concurrent requests share a commit). The engine's own
max_seq_len and max_batch bound requests. With `settings.weights` the gateway follows a weight store
(the deploy path: verified lossless deltas, hot-swapped between decode steps).

Two arms (serve/arms.py): the engine above is the champion; the candidate is `candidate_engine`, or is
built from the champion's architecture and tokenizer when `settings.candidate_weights` first has a
version, and follows that store as the champion follows its own. Users are split between the arms by
a stable hash (deploy.canary) under the traffic in run_dir/traffic.json (else the settings'
candidate_fraction and traffic_salt), which PUT /v1/admin/traffic changes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import torch
from fastapi import FastAPI

from realtime_rl.collect import EventStore, GroupCommitter, open_event_store
from realtime_rl.config import ServeConfig
from realtime_rl.deploy import FilesystemTransport, HttpTransport, WeightSubscriber, WeightSyncError
from realtime_rl.engine import AsyncEngine, Engine
from realtime_rl.model import load_checkpoint
from realtime_rl.serve.arms import Arms, Traffic, build_candidate, load_traffic
from realtime_rl.serve.deps import ServeState
from realtime_rl.serve.errors import BodyLimitMiddleware, install_error_handlers
from realtime_rl.serve.metrics import GatewayMetrics, MetricsMiddleware
from realtime_rl.serve.routes import admin, chat, completions, feedback, health, models

log = logging.getLogger(__name__)
TRAFFIC_FILE = "traffic.json"


def build_engine(settings: ServeConfig) -> AsyncEngine:
    """Load the checkpoint and wrap it in a started AsyncEngine; ValueError names what is wrong."""
    if settings.checkpoint is None:
        raise ValueError("checkpoint: give the checkpoint directory to serve (--set checkpoint=DIR)")
    dtype = getattr(torch, settings.dtype) if settings.dtype else None
    ckpt = load_checkpoint(settings.checkpoint, device=settings.device, dtype=dtype)
    if ckpt.tokenizer is None:
        raise ValueError(f"{settings.checkpoint}: no tokenizer.json; the gateway needs the checkpoint's tokenizer")
    engine = Engine(ckpt.model, ckpt.tokenizer, max_batch=settings.max_batch, max_seq_len=settings.max_seq_len,
                    compile_decode=settings.compile_decode)
    return AsyncEngine(engine, max_pending=settings.max_pending).start()


def follow_weights(location: str, poll_s: float, apply: Callable[[dict[str, torch.Tensor], int], None],
                   name: str = "rtrl-weights") -> Callable[[], None]:
    """Follow the weight store at `location` (a directory or an http(s) URL) on a thread: every new
    version is fetched, verified and rebuilt beside the live weights, then handed to `apply` (an engine's
    update_weights swaps it in between decode steps: requests in flight are paused, not dropped); a bad
    delta is rejected and the old weights keep serving. Returns the function that stops following."""
    if location.startswith(("http://", "https://")):
        transport = HttpTransport(location)
    else:
        transport = FilesystemTransport(location)

    def checked(state: dict[str, torch.Tensor], version: int) -> None:
        try:
            apply(state, version)
        except ValueError as e:  # names or shapes that do not fit the model: logged and retried, never fatal
            raise WeightSyncError(f"version {version} does not fit the served model: {e}") from e
        except Exception as e:  # out of memory staging it, say: the old weights keep serving, retried next poll
            raise WeightSyncError(f"version {version} could not be applied: {e!r}") from e

    subscriber = WeightSubscriber(transport, apply=checked)
    stop = threading.Event()
    thread = threading.Thread(target=subscriber.run, args=(stop, poll_s), name=name, daemon=True)
    thread.start()

    def close() -> None:
        stop.set()
        thread.join(timeout=30)

    return close


def follow_candidate(settings: ServeConfig, arms: Arms) -> Callable[[], None]:
    """Follow settings.candidate_weights: the first version builds the candidate arm (unless a caller gave
    one), later versions are hot-swapped into it. Returns the function that stops following (and stops
    the engine it built)."""
    built: list[AsyncEngine] = []

    def apply(state: dict[str, torch.Tensor], version: int) -> None:
        if arms.candidate is None:
            built.append(build_candidate(arms.champion, state, version))
            arms.candidate = built[0]
            log.info("candidate arm serves version %d", version)
        else:
            arms.candidate.update_weights(state, version)

    stop_following = follow_weights(settings.candidate_weights, settings.weights_poll_s, apply, "rtrl-candidate")

    def close() -> None:
        stop_following()
        for engine in built:
            engine.stop()

    return close


def create_app(settings: ServeConfig, engine: AsyncEngine | None = None, store: EventStore | None = None,
               candidate_engine: AsyncEngine | None = None) -> FastAPI:
    for given in (engine, candidate_engine):
        if given is not None and given.engine.tokenizer is None:
            raise ValueError("the engine has no tokenizer; the gateway renders and decodes text with it")
    if engine is not None and candidate_engine is not None and (
            candidate_engine.engine.tokenizer.vocab_size != engine.engine.tokenizer.vocab_size):
        raise ValueError("the candidate engine's tokenizer differs from the champion's; both arms share one tokenizer")
    traffic = load_traffic(settings.run_dir / TRAFFIC_FILE, Traffic(settings.candidate_fraction, settings.traffic_salt))
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            live_engine = engine
            if live_engine is None:
                live_engine = build_engine(settings)
                stack.callback(live_engine.stop)
            live_engine.start()
            if candidate_engine is not None:
                candidate_engine.start()
            live_store = store
            if live_store is None:
                live_store = open_event_store(settings.run_dir, settings.store)
                stack.callback(live_store.close)
            committer = GroupCommitter(live_store, on_commit=metrics.observe_commit)
            stack.callback(committer.close)  # before the store closes: what was submitted is written
            arms = Arms(live_engine, candidate_engine, traffic, settings.run_dir / TRAFFIC_FILE)
            if settings.weights:
                stack.callback(follow_weights(settings.weights, settings.weights_poll_s, live_engine.update_weights))
            if settings.candidate_weights:
                stack.callback(follow_candidate(settings, arms))
            metrics.bind_engine(live_engine)
            metrics.bind_arms(arms)
            app.state.serve = ServeState(settings, live_engine, live_store, live_engine.engine.tokenizer, metrics,
                                         int(time.time()), committer, arms)
            yield

    app = FastAPI(title="realtime-rl gateway", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible chat completions and a feedback API; every completion and "
                              "event is recorded before it is answered.")
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # the outer one: it counts the 413s too
    app.include_router(chat.router)
    app.include_router(completions.router)
    app.include_router(feedback.router)
    app.include_router(models.router)
    app.include_router(admin.router)
    app.include_router(health.router)
    return app
