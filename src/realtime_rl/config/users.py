"""`rtrl simulate-users`: simulated developers who use the gateway and send feedback."""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from realtime_rl.config.base import StrictModel
from realtime_rl.config.components import SandboxConfig

StylePreference = Literal["type_hints", "docstring", "no_print", "none"]


class SimulateUsersConfig(StrictModel):
    """Simulated developers: each asks the gateway for a task's function, applies the edit it gets, runs the
    task's visible and hidden tests in the sandbox, and reports what it did with the edit as feedback events."""

    base_url: str = "http://127.0.0.1:8000"
    """The gateway, without /v1 (the clients add it)."""
    api_key: str = Field("rtrl-local-inference-key-change-me", min_length=1, max_length=256)
    """A key with the inference and feedback scopes (the example key of configs/serve/default.toml)."""
    model: str = Field("rtrl-policy", min_length=1, max_length=256)
    """The model id the gateway serves."""
    users: int = Field(4, ge=1, le=1000)
    """Simulated users, each on its own thread with its own HTTP connection."""
    sessions: int | None = Field(20, ge=1, le=10_000_000)
    """Sessions to run in total across users; None: until duration_s passes."""
    duration_s: float | None = Field(None, gt=0, le=30 * 86400)
    """Stop starting sessions after this many seconds; None: until `sessions` are done."""
    tasks_dir: Path = Path("runs/users/tasks")
    """Task folder (Exercism layout); generated from the synthetic split below if it holds no task."""
    task_count: int = Field(50, ge=1, le=1_000_000)
    """How many synthetic tasks to generate when tasks_dir holds none."""
    split: Literal["train", "heldout"] = "heldout"
    """The synthetic split generated tasks come from (held out from training by default)."""
    difficulty: int | None = Field(None, ge=1, le=4)
    """Generate tasks of this difficulty only (None: the split's mix)."""
    start: int = Field(0, ge=0, le=10_000_000)
    """Index of the first generated task: tasks start..start+task_count-1 of the split (keep them apart from
    a pre-training corpus or a gate suite drawn from the same split and seed)."""
    seed: int = 0
    """Seed of the users (preferences, patience, task choice, think-times, coin flips) and of generated tasks."""
    think_time_s: tuple[float, float] = (0.5, 2.0)
    """Range of the pause before each request and after each answer (uniform, seconds)."""
    persist_window_s: float = Field(10.0, gt=0, le=7 * 86400)
    """Seconds an accepted edit is watched before edit_persisted is sent (simulated in real time)."""
    style_mix: dict[StylePreference, float] = Field(
        default_factory=lambda: {"type_hints": 0.3, "docstring": 0.3, "no_print": 0.2, "none": 0.2})
    """Share of users with each style preference (weights, normalized)."""
    p_style_revert: float = Field(0.7, ge=0, le=1)
    """Probability that a passing edit that breaks the user's style preference is reverted."""
    p_malformed_complaint: float = Field(0.5, ge=0, le=1)
    """Probability of a dissatisfied follow-up after a malformed tool call."""
    patience: tuple[int, int] = (1, 3)
    """Range of completions a user spends on one session before giving up (uniform per user)."""
    followup_on_failure: bool = True
    """After a failing edit, say so in a follow-up turn of the same session (while patience lasts)."""
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    """max_tokens of each request; None: the gateway's default, cut to the room left in the context."""
    temperature: float = Field(1.0, ge=0, le=2)
    """Sampling temperature asked of the gateway."""
    request_timeout_s: float = Field(120.0, gt=0, le=3600)
    """Timeout of one chat-completion request (the openai client's `timeout`)."""
    max_retries: int = Field(2, ge=0, le=20)
    """Retries of a failed chat-completion request (the openai client's `max_retries`)."""
    feedback_timeout_s: float = Field(10.0, gt=0, le=600)
    """Timeout of one POST /v1/feedback attempt."""
    feedback_retries: int = Field(5, ge=0, le=100)
    """Retries of a feedback post on 5xx or a connection error, with the same event ids (idempotent)."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """Limits of the test runs that decide whether an edit works."""

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, v: str) -> str:
        url = urllib.parse.urlsplit(v)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise ValueError(f"base_url must be an http(s) URL such as http://127.0.0.1:8000, got {v!r}")
        return v.rstrip("/").removesuffix("/v1")

    @field_validator("think_time_s")
    @classmethod
    def _think(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0 <= v[0] <= v[1] <= 3600:
            raise ValueError(f"think_time_s must be [low, high] with 0 <= low <= high <= 3600, got {list(v)}")
        return v

    @field_validator("patience")
    @classmethod
    def _patience(cls, v: tuple[int, int]) -> tuple[int, int]:
        if not 1 <= v[0] <= v[1] <= 100:
            raise ValueError(f"patience must be [low, high] with 1 <= low <= high <= 100, got {list(v)}")
        return v

    @field_validator("style_mix")
    @classmethod
    def _mix(cls, v: dict[str, float]) -> dict[str, float]:
        if any(not w >= 0 for w in v.values()) or not sum(v.values()) > 0:
            raise ValueError("style_mix weights must be >= 0 with a positive sum, e.g. {none = 1.0}")
        return v

    @model_validator(mode="after")
    def _check(self) -> SimulateUsersConfig:
        if self.sessions is None and self.duration_s is None:
            raise ValueError("give sessions or duration_s (or both: whichever comes first ends the run)")
        return self
