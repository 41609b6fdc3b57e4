"""`create_app(settings, engine=None, store=None)`: the gateway as a FastAPI app.

    app = create_app(ServeConfig(checkpoint="runs/demo/checkpoint", allow_unauthenticated=True))
    uvicorn.run(app)                      # or run_server(settings), which `rtrl serve` calls

An engine or store passed in belongs to the caller (the app starts the engine's thread if needed and
never stops or closes them); missing ones are built by the lifespan from the settings (the checkpoint;
the store named by settings.store) and torn down with the app. Feedback events go through a
GroupCommitter the app owns (one writer thread; concurrent requests share a commit). The engine's own
max_seq_len and max_batch bound requests. With `settings.weights` the gateway follows a weight store
(the deploy path: verified lossless deltas, hot-swapped between decode steps).
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import torch
from fastapi import FastAPI

from realtime_rl.collect import EventStore, GroupCommitter, open_event_store
from realtime_rl.config import ServeConfig
from realtime_rl.deploy import FilesystemTransport, HttpTransport, WeightSubscriber
from realtime_rl.engine import AsyncEngine, Engine
from realtime_rl.model import load_checkpoint
from realtime_rl.serve.deps import ServeState
from realtime_rl.serve.errors import install_error_handlers
from realtime_rl.serve.metrics import GatewayMetrics, MetricsMiddleware
from realtime_rl.serve.routes import chat, feedback, health, models


def build_engine(settings: ServeConfig) -> AsyncEngine:
    """Load the checkpoint and wrap it in a started AsyncEngine; ValueError names what is wrong."""
    if settings.checkpoint is None:
        raise ValueError("checkpoint: give the checkpoint directory to serve (--set checkpoint=DIR)")
    dtype = getattr(torch, settings.dtype) if settings.dtype else None
    ckpt = load_checkpoint(settings.checkpoint, device=settings.device, dtype=dtype)
    if ckpt.tokenizer is None:
        raise ValueError(f"{settings.checkpoint}: no tokenizer.json; the gateway needs the checkpoint's tokenizer")
    engine = Engine(ckpt.model, ckpt.tokenizer, max_batch=settings.max_batch, max_seq_len=settings.max_seq_len)
    return AsyncEngine(engine, max_pending=settings.max_pending).start()


def follow_weights(settings: ServeConfig, engine: AsyncEngine) -> Callable[[], None]:
    """Follow settings.weights on a thread: every new version is fetched, verified, rebuilt beside the live
    weights and swapped in between decode steps (requests in flight are paused, not dropped); a bad
    delta is rejected and the old weights keep serving. Returns the function that stops following."""
    if settings.weights.startswith(("http://", "https://")):
        transport = HttpTransport(settings.weights)
    else:
        transport = FilesystemTransport(settings.weights)
    subscriber = WeightSubscriber(transport, apply=engine.update_weights)
    stop = threading.Event()
    thread = threading.Thread(target=subscriber.run, args=(stop, settings.weights_poll_s), name="rtrl-weights",
                              daemon=True)
    thread.start()

    def close() -> None:
        stop.set()
        thread.join(timeout=30)

    return close


def create_app(settings: ServeConfig, engine: AsyncEngine | None = None, store: EventStore | None = None) -> FastAPI:
    if engine is not None and engine.engine.tokenizer is None:
        raise ValueError("the engine has no tokenizer; the gateway renders and decodes text with it")
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            live_engine = engine
            if live_engine is None:
                live_engine = build_engine(settings)
                stack.callback(live_engine.stop)
            live_engine.start()
            live_store = store
            if live_store is None:
                live_store = open_event_store(settings.run_dir, settings.store)
                stack.callback(live_store.close)
            committer = GroupCommitter(live_store, on_commit=metrics.observe_commit)
            stack.callback(committer.close)  # before the store closes: what was submitted is written
            if settings.weights:
                stack.callback(follow_weights(settings, live_engine))
            metrics.bind_engine(live_engine)
            app.state.serve = ServeState(settings, live_engine, live_store, live_engine.engine.tokenizer, metrics,
                                         int(time.time()), committer)
            yield

    app = FastAPI(title="realtime-rl gateway", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible chat completions and a feedback API; every completion and "
                              "event is recorded before it is answered.")
    install_error_handlers(app)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.include_router(chat.router)
    app.include_router(feedback.router)
    app.include_router(models.router)
    app.include_router(health.router)
    return app
