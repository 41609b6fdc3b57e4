"""`run_server(settings)`: what `rtrl serve` runs. Loads the checkpoint, opens the event store, serves
with uvicorn until SIGINT or SIGTERM, then drains in-flight requests, stops the engine, closes the store
and returns normally. Bad settings (no keys, no checkpoint, an unreadable one, an unreachable Postgres)
raise ValueError before anything binds.

`serve_in_thread(settings)`: the same app under uvicorn on a thread of this process (tests); a context
manager yielding the base URL. `serve_in_process(settings, log_path)`: `run_server` in a child interpreter
(`python -m realtime_rl.serve`), so the gateway's engine and event loop never wait on the caller's threads for
the GIL (the demo runs the gateway beside the loop's trainer and the simulated users); same context manager.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
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


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS's pick), for a gateway started in another process."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def log_tail(log_path: Path, chars: int = 3000) -> str:
    """The last `chars` characters of a gateway's log ("" before it exists)."""
    return log_path.read_text(errors="replace")[-chars:] if log_path.exists() else ""


def wait_until_serving(proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float) -> None:
    """Poll GET {url}/health until it answers 200. RuntimeError if the process exits first, TimeoutError past
    timeout_s, each with the tail of the process's log; stopping the process is the caller's."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {proc.returncode} before serving:\n{log_tail(log_path)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gateway did not answer {url}/health within {timeout_s:.0f} s:\n"
                               f"{log_tail(log_path)}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)


@contextmanager
def serve_in_process(settings: ServeConfig, log_path: Path, threads: int | None = None, niceness: int = 0,
                     start_timeout_s: float = 120.0) -> Iterator[str]:
    """`run_server(settings)` in a child process, its output appended to log_path; yields the base URL once
    GET /health answers. On exit: SIGTERM (the gateway drains and closes its store), SIGKILL if it has not
    exited within request_timeout_s + 10 s. threads: the child's torch threads (None: torch's default);
    niceness: its scheduling priority below this process's (`nice -n`), for a gateway that shares the cores
    with work that should go first."""
    if settings.port == 0:
        settings = settings.model_copy(update={"port": free_port(settings.host)})
    log_path.parent.mkdir(parents=True, exist_ok=True)
    config_path = log_path.with_suffix(".settings.json")  # holds the API keys: readable by this user only
    fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(settings.model_dump_json())
    env = {**os.environ} | ({"OMP_NUM_THREADS": str(threads)} if threads else {})
    with open(log_path, "ab") as log:
        argv = [sys.executable, "-m", "realtime_rl.serve", str(config_path)]
        proc = subprocess.Popen((["nice", "-n", str(niceness)] if niceness else []) + argv, stdout=log,
                                stderr=subprocess.STDOUT, env=env)
    url = f"http://{settings.host}:{settings.port}"
    try:
        wait_until_serving(proc, url, log_path, start_timeout_s)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(settings.request_timeout_s + 10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
