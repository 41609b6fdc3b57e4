"""`run_server(settings)`: what `rtrl serve` runs. Loads the checkpoint, opens the event store, serves
with uvicorn until SIGINT or SIGTERM, then drains in-flight requests, stops the engine, closes the store
and returns normally. Bad settings (no keys, no checkpoint, an unreadable one, an unreachable Postgres)
raise ValueError before anything binds.

`serve_in_thread(settings)`: the same app under uvicorn on a thread of this process (the demo runs the
gateway beside the loop and the simulated users); a context manager yielding the base URL.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from realtime_rl.collect import open_event_store
from realtime_rl.config import ServeConfig
from realtime_rl.serve.app import build_engine, create_app

log = logging.getLogger(__name__)


def run_server(settings: ServeConfig) -> None:
    if not settings.allow_unauthenticated and not settings.api_keys:
        raise ValueError("api_keys: give at least one key, or set allow_unauthenticated=true for local use")
    store = open_event_store(settings.run_dir, settings.store)
    try:
        engine = build_engine(settings)
    except BaseException:
        store.close()
        raise
    # uvicorn drains on SIGINT/SIGTERM, then restores the previous handlers and re-raises the signal; with
    # these no-op handlers in place the re-raise returns here, so the engine and store are closed cleanly.
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda signum, frame: log.info("signal %d: shutting down", signum))
    try:
        app = create_app(settings, engine=engine, store=store)
        config = uvicorn.Config(app, host=settings.host, port=settings.port, lifespan="on",
                                timeout_graceful_shutdown=int(settings.request_timeout_s) + 5)
        log.info("serving %s (version %d) on %s:%d", settings.model_name, engine.version, settings.host, settings.port)
        uvicorn.Server(config).run()
    finally:
        engine.stop()
        store.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("gateway stopped; events are in %s", settings.run_dir if settings.store == "sqlite" else "Postgres")


@contextmanager
def serve_in_thread(settings: ServeConfig, start_timeout_s: float = 120.0) -> Iterator[str]:
    """Serve create_app(settings) on settings.host (port 0: a free one) in a daemon thread; yields the base
    URL, then drains and stops the server on exit. The lifespan builds and closes the engine and store."""
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                                           log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=int(settings.request_timeout_s) + 5))
    thread = threading.Thread(target=server.run, name="rtrl-gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the gateway failed to start (see the log above)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"the gateway did not start within {start_timeout_s:.0f} s")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{settings.host}:{port}"
    finally:
        server.should_exit = True
        thread.join(settings.request_timeout_s + 10)
