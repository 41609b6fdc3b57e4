"""Runs an Engine on its own thread and serves concurrent callers: asyncio (the gateway) or threads
(rollout workers, the agent loop).

    aengine = AsyncEngine(engine, max_pending=256).start()
    out = await aengine.generate(prompt_ids, params, timeout_s=60)        # asyncio
    async for event in aengine.stream(prompt_ids, params, timeout_s=60):   # token by token (SSE)
        ...
    out = aengine.generate_sync(prompt_ids, params, timeout_s=60)          # from any thread
    aengine.update_weights(state, version)                                 # swapped between decode steps
    aengine.stop()

Backpressure: at most `max_pending` requests are queued or running; one more raises EngineOverloaded
at once (the gateway answers 503 with Retry-After) instead of queueing without bound. Every wait has a
timeout; a request that times out is aborted in the engine and its slots are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from realtime_rl.engine.engine import Engine
from realtime_rl.engine.requests import RequestOutput
from realtime_rl.engine.sampling import SamplingParams


class EngineOverloaded(RuntimeError):
    """The engine's queue is full; retry later."""


class EngineStopped(RuntimeError):
    """The engine was stopped: requests queued or running then, and any submitted after, end with this."""


@dataclass
class TokenEvent:
    """A streamed event: a new token of sample `index` and the policy version that sampled it, or (token None)
    the finished request."""

    index: int
    token: int | None
    output: RequestOutput | None = None
    version: int | None = None


class AsyncEngine:
    def __init__(self, engine: Engine, max_pending: int = 256, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.max_pending = max_pending
        self.idle_wait_s = idle_wait_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending = 0
        self._pending_lock = threading.Lock()
        self.error: BaseException | None = None

    def start(self, timeout_s: float = 10.0) -> AsyncEngine:
        """Start the engine thread (again, after stop(): a stopped engine serves new requests once restarted).
        The thread of a stop() that timed out is waited for up to timeout_s, then RuntimeError."""
        if self._thread is not None and self._stop.is_set():  # stopping: it would leave, and nothing would serve
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError("the engine thread is still finishing its last step after stop(); start again later")
            self._thread = None
        if self._thread is None:
            self._stop.clear()
            if isinstance(self.error, EngineStopped):
                self.error = None
            self._thread = threading.Thread(target=self._loop, name="rtrl-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if not self._thread.is_alive():  # one still mid-step stays known: start() must not run a second
                self._thread = None

    def __enter__(self) -> AsyncEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def version(self) -> int:
        return self.engine.version

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        try:
            while not self._stop.is_set():
                self._wake.clear()  # before looking for work, so a submit in between is never missed
                if self.engine.has_work():
                    self.engine.step()
                else:
                    self._wake.wait(self.idle_wait_s)
        except BaseException as e:  # surfaced to every caller, waiting or later, instead of hanging them
            self.error = e
            self.engine.abort_all()
            raise
        self.error = EngineStopped("the engine was stopped")  # set first: an aborted caller sees why
        self.engine.abort_all()

    def _raise_if_dead(self) -> None:
        if isinstance(self.error, EngineStopped):
            raise EngineStopped(str(self.error))  # a fresh one per caller: one shared traceback would grow
        if self.error is not None:
            raise RuntimeError(f"the engine thread died: {self.error!r}") from self.error

    def _raise_if_cut_off(self, output: RequestOutput) -> None:
        """Why `output` ended, when the engine's stop or death aborted it; an output that finished before
        (a stop right after its last step) is the caller's, whole."""
        samples = output.samples  # none: aborted before it was admitted
        if self.error is not None and (not samples or any(s.finish_reason == "abort" for s in samples)):
            self._raise_if_dead()

    def _submit(self, prompt_ids: Sequence[int], params: SamplingParams, on_update,
                release: Callable[[], None] | None = None) -> str:
        """Queue the request (counted as pending until `release`, by default `_release`, is called)."""
        self._raise_if_dead()
        if self._thread is None:
            raise RuntimeError("AsyncEngine is not started")
        with self._pending_lock:
            if self._pending >= self.max_pending:
                raise EngineOverloaded(f"{self._pending} requests pending (max {self.max_pending})")
            self._pending += 1
        try:
            rid = self.engine.add_request(prompt_ids, params, on_update=on_update)
            if self.error is not None:  # the thread ended (stopped or died) after the check above: nobody would run it
                self.engine.abort(rid)
                self._raise_if_dead()
        except BaseException:
            (release or self._release)()
            raise
        self._wake.set()
        return rid

    def _release(self) -> None:
        with self._pending_lock:
            self._pending -= 1

    def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        self.engine.update_weights(state, version)
        self._wake.set()

    # ------------------------------------------------------------------------------------------ asyncio

    async def stream(self, prompt_ids: Sequence[int], params: SamplingParams,
                     timeout_s: float = 300.0) -> AsyncIterator[TokenEvent]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

        released = threading.Lock()  # held once the request no longer counts as pending

        def release_once() -> None:
            if released.acquire(blocking=False):
                self._release()

        def on_update(_rid: str, index: int, token: int | None, output: RequestOutput | None) -> None:
            if output is not None:  # done in the engine: a consumer that stops reading holds no place in it
                release_once()
            if not loop.is_closed():  # a caller gone with its loop: nobody to tell (the engine aborts it)
                # On the engine's thread, which applies swaps between steps: its version sampled the token.
                event = TokenEvent(index, token, output, self.engine.version if token is not None else None)
                loop.call_soon_threadsafe(queue.put_nowait, event)

        rid = self._submit(prompt_ids, params, on_update, release_once)
        deadline = loop.time() + timeout_s
        try:
            while True:
                try:  # what has arrived is delivered even past the deadline (a caller that reads late)
                    event = queue.get_nowait()
                except asyncio.QueueEmpty:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        raise TimeoutError(f"generation did not finish within {timeout_s} s") from None
                    event = await asyncio.wait_for(queue.get(), remaining)
                if event.output is not None:
                    self._raise_if_cut_off(event.output)
                yield event
                if event.output is not None:
                    return
        finally:
            self.engine.abort(rid)  # no-op once finished; frees slots if the caller went away
            release_once()

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       timeout_s: float = 300.0) -> RequestOutput:
        async with contextlib.aclosing(self.stream(prompt_ids, params, timeout_s)) as events:
            async for event in events:  # closed on return, not when collected: no longer counted as pending
                if event.output is not None:
                    return event.output
        raise AssertionError("stream ended without an output")

    # ------------------------------------------------------------------------------------------ threads

    def generate_sync(self, prompt_ids: Sequence[int], params: SamplingParams,
                      timeout_s: float = 300.0) -> RequestOutput:
        done = threading.Event()
        box: list[RequestOutput] = []

        def on_update(_rid: str, _index: int, _token: int | None, output: RequestOutput | None) -> None:
            if output is not None:
                box.append(output)
                done.set()

        rid = self._submit(prompt_ids, params, on_update)
        try:
            if not done.wait(timeout_s):
                raise TimeoutError(f"generation did not finish within {timeout_s} s")
            self._raise_if_cut_off(box[0])
            return box[0]
        finally:
            self.engine.abort(rid)
            self._release()
