"""Prometheus metrics of one gateway, in a registry of its own (several apps may share a process in tests).

    rtrl_serve_requests_total{route, method, status}    every answered request; route is the template
    rtrl_serve_request_duration_seconds{route}           until the last byte of the body (streams included)
    rtrl_serve_prompt_tokens_total, rtrl_serve_generated_tokens_total, rtrl_serve_completions_total
    rtrl_serve_malformed_tool_calls_total
    rtrl_serve_feedback_events_total{type}               feedback events stored (retries not counted again)
    rtrl_serve_feedback_duplicates_total                 events acknowledged as retries of stored ones
    rtrl_serve_feedback_conflicts_total                  batches refused (409): an id stored with other content
    rtrl_serve_feedback_commit_events, ..._commit_seconds   events per group commit and its duration
    rtrl_serve_engine_waiting, rtrl_serve_engine_running, rtrl_serve_model_version   (read at scrape time)
    rtrl_serve_arm_requests_total{arm, status}           chat-completion requests, by the arm that took them
    rtrl_serve_arm_request_duration_seconds{arm}         their duration, to the last body byte
    rtrl_serve_arm_version{arm}                          policy version each arm serves (NaN: no candidate yet)
    rtrl_serve_stream_errors_total{arm, code}            streams ended by an error event, its code (counted
                                                         above as 200: the status went out before the failure)

A request's arm is the `X-Rtrl-Arm` header of its answer, so only requests an arm took are counted by arm.

`MetricsMiddleware` is plain ASGI so that it sees the end of streamed bodies. Unmatched paths count
under route "unmatched", so a scanner cannot grow the label set.
"""

from __future__ import annotations

import math
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from realtime_rl.collect import EVENT_TYPES
from realtime_rl.engine import AsyncEngine
from realtime_rl.serve.arms import ARMS, Arms

_METHODS = {"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"}
_GROUP_BUCKETS = (1, 10, 100, 1_000, 10_000, 100_000)
_ARM_HEADER = b"x-rtrl-arm"
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("rtrl_serve_requests", "Answered requests", ["route", "method", "status"], registry=r)
        self.duration = Histogram("rtrl_serve_request_duration_seconds", "Request duration to the last body byte",
                                  ["route"], buckets=_BUCKETS, registry=r)
        self.prompt_tokens = Counter("rtrl_serve_prompt_tokens", "Prompt tokens of recorded completions", registry=r)
        self.generated_tokens = Counter("rtrl_serve_generated_tokens", "Tokens generated and recorded", registry=r)
        self.completions = Counter("rtrl_serve_completions", "Completions recorded in the event store", registry=r)
        self.malformed_tool_calls = Counter("rtrl_serve_malformed_tool_calls", "Tool calls the parser rejected",
                                            registry=r)
        self.feedback_events = Counter("rtrl_serve_feedback_events", "Feedback events stored, by type", ["type"],
                                       registry=r)
        for event_type in EVENT_TYPES:  # every type is scraped, 0 until seen
            self.feedback_events.labels(event_type)
        self.feedback_duplicates = Counter("rtrl_serve_feedback_duplicates",
                                           "Feedback events acknowledged as retries of stored ones", registry=r)
        self.feedback_conflicts = Counter("rtrl_serve_feedback_conflicts",
                                          "Feedback batches refused: an event id stored with other content", registry=r)
        self.feedback_commit_events = Histogram("rtrl_serve_feedback_commit_events", "Events per group commit",
                                                buckets=_GROUP_BUCKETS, registry=r)
        self.feedback_commit_seconds = Histogram("rtrl_serve_feedback_commit_seconds", "Duration of a group commit",
                                                 buckets=_BUCKETS, registry=r)
        self.engine_waiting = Gauge("rtrl_serve_engine_waiting", "Requests queued in the engine", registry=r)
        self.engine_running = Gauge("rtrl_serve_engine_running", "Sequences decoding in the engine", registry=r)
        self.model_version = Gauge("rtrl_serve_model_version", "Policy version the engine serves", registry=r)
        self.arm_requests = Counter("rtrl_serve_arm_requests", "Requests answered, by the arm that took them",
                                    ["arm", "status"], registry=r)
        self.arm_duration = Histogram("rtrl_serve_arm_request_duration_seconds",
                                      "Duration to the last body byte, by arm", ["arm"], buckets=_BUCKETS, registry=r)
        self.undelivered = Counter("rtrl_serve_undelivered_completions",
                                   "Recorded completions whose answer did not reach the client (never trained)",
                                   ["reason"], registry=r)
        self.stream_errors = Counter("rtrl_serve_stream_errors", "Streams ended by an error event",
                                     ["arm", "code"], registry=r)
        self.arm_version = Gauge("rtrl_serve_arm_version", "Policy version each arm serves (NaN: no such arm yet)",
                                 ["arm"], registry=r)

    def bind_engine(self, engine: AsyncEngine) -> None:
        self.engine_waiting.set_function(lambda: engine.engine.num_waiting)
        self.engine_running.set_function(lambda: engine.engine.num_running)
        self.model_version.set_function(lambda: engine.version)

    def bind_arms(self, arms: Arms) -> None:
        for arm in ARMS:
            self.arm_version.labels(arm).set_function(
                lambda arm=arm: math.nan if (v := arms.version(arm)) is None else v)

    def observe_commit(self, batches: int, events: int, seconds: float) -> None:
        self.feedback_commit_events.observe(events)
        self.feedback_commit_seconds.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500  # what the client sees if the app fails before starting a response
        arm = None

        async def send_wrapper(message: Message) -> None:
            nonlocal status, arm
            if message["type"] == "http.response.start":
                status = message["status"]
                for name, value in message.get("headers", ()):
                    if name.lower() == _ARM_HEADER and value.decode("latin-1") in ARMS:
                        arm = value.decode("latin-1")
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            method = scope["method"] if scope["method"] in _METHODS else "other"
            self.metrics.requests.labels(template, method, str(status)).inc()
            seconds = time.perf_counter() - t0
            self.metrics.duration.labels(template).observe(seconds)
            if arm is not None:
                self.metrics.arm_requests.labels(arm, str(status)).inc()
                self.metrics.arm_duration.labels(arm).observe(seconds)
