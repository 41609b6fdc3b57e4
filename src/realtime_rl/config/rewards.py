"""Reward rules (what each user signal pays, versioned) and the reward-hacking monitors' thresholds.

    rules = load_config(RewardRules, "configs/rewards/default.toml")
    rules.version, rules.digest()        # "default-v1", "3f2a..." (the hash of the numbers, not the name)

configs/rewards/naive.toml reproduces the two hacks Cursor reported (broken tool calls and clarifying
questions cost nothing while failed edits cost a lot); configs/rewards/default.toml is the fixed
configuration and explains its numbers. The class defaults are default.toml (a test checks they agree).
How the rules are applied (windows, censoring, clipping) is in realtime_rl.rewards.rules.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import Field, model_validator

from realtime_rl.config.base import StrictModel


class EventWeights(StrictModel):
    """What one feedback event pays (edit events at most once per completion choice; follow-ups each time)."""

    edit_accepted: float = Field(0.2, ge=-100, le=100)
    """The user applied the edit."""
    edit_persisted: float = Field(1.0, ge=-100, le=100)
    """The edit was still in place after `persist_window_s` (shorter windows pay nothing)."""
    edit_rejected: float = Field(-0.5, ge=-100, le=100)
    """The user declined the edit."""
    edit_reverted: float = Field(-0.6, ge=-100, le=100)
    """The user undid the edit."""
    followup_dissatisfied: float = Field(-0.5, ge=-100, le=100)
    """The user's next message says the answer was wrong."""
    followup_neutral: float = Field(0.0, ge=-100, le=100)
    """The user went on without judging the answer."""
    tool_call_error: float = Field(-0.5, ge=-100, le=100)
    """The client reported a broken tool call."""
    session_end: float = Field(0.0, ge=-100, le=100)
    """A session_end that names a completion (it also closes the session's follow-up windows)."""


class ActionRewards(StrictModel):
    """What a completion pays by itself, from what it did (see rewards.actions.classify), before any event."""

    edit: float = Field(0.0, ge=-100, le=100)
    """A well-formed write_file or edit_file call."""
    question: float = Field(-1.2, ge=-100, le=100)
    """A clarifying question (ask_user, or a reply ending in "?")."""
    other: float = Field(-1.2, ge=-100, le=100)
    """Any other answer: another tool, or plain text that is not a question."""
    malformed_call: float = Field(-1.5, ge=-100, le=0)
    """Per malformed tool call, whatever else the completion did (a malformed completion pays only this)."""


SETTLE_SEMANTICS = 3
"""Bumped when rules.settle pays the same numbers differently (2: an edit_persisted decides only once the store's
clock shows the persist window; a session_end closes only completions created before it; 3: an undelivered
completion is settled untrainable), so that a digest names what was paid."""


class RewardRules(StrictModel):
    """How user signals become a reward for one completion choice."""

    version: str = Field("default-v1", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """A name for these rules, recorded with every reward they settle (the digest identifies the numbers)."""
    weights: EventWeights = Field(default_factory=EventWeights)
    """What each feedback event type pays."""
    custom: dict[str, float] = Field(default_factory=dict)
    """Custom events by name: each pays weight x its value; names not listed pay nothing."""
    actions: ActionRewards = Field(default_factory=ActionRewards)
    """What the completion pays for its own action, and per malformed tool call."""
    persist_window_s: float = Field(600.0, gt=0, le=30 * 86400)
    """An edit is final once an edit_persisted with window_s >= this arrives (or it is reverted or rejected)."""
    followup_window_s: float = Field(300.0, ge=0, le=30 * 86400)
    """Follow-up events are awaited this long after the completion (a session_end closes the window early)."""
    horizon_s: float = Field(3600.0, gt=0, le=90 * 86400)
    """A reward still undecided this long after the completion is censored: settled with what is known."""
    censored_policy: Literal["credit", "exclude"] = "credit"
    """credit: a censored edit that was accepted and not undone is paid `censored_credit` x
    weights.edit_persisted on top of what its events paid; exclude: censored rewards are settled but
    marked untrainable (the trainer skips them)."""
    censored_credit: float = Field(0.5, ge=0.0, le=1.0)
    """The share of edit_persisted paid to an accepted, unconfirmed edit under the "credit" policy."""
    clip_min: float = Field(-3.0, ge=-1000, le=1000)
    """Rewards below are raised to this."""
    clip_max: float = Field(3.0, ge=-1000, le=1000)
    """Rewards above are lowered to this."""

    @model_validator(mode="after")
    def _windows_and_range(self) -> RewardRules:
        if self.clip_min >= self.clip_max:
            raise ValueError(f"clip_min ({self.clip_min}) must be below clip_max ({self.clip_max})")
        if self.horizon_s <= self.persist_window_s:
            raise ValueError(f"horizon_s ({self.horizon_s}) must exceed persist_window_s ({self.persist_window_s}): "
                             "otherwise no edit could ever be confirmed before it is censored")
        if self.followup_window_s > self.horizon_s:
            raise ValueError(f"followup_window_s ({self.followup_window_s}) must not exceed horizon_s "
                             f"({self.horizon_s})")
        return self

    def digest(self) -> str:
        """A hash of the numbers (not the version name) and of how rules.settle reads them (SETTLE_SEMANTICS):
        equal digests pay equally."""
        numbers = self.model_dump(mode="json", exclude={"version"})
        body = json.dumps({**numbers, "semantics": SETTLE_SEMANTICS}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()[:16]


class MonitorConfig(StrictModel):
    """Reward-hacking monitors: when a candidate's behaviour differs from the champion's enough to block it."""

    alpha: float = Field(0.01, gt=0, lt=1)
    """Family-wise significance level across all monitors of one report (Holm's step-down correction)."""
    min_samples: int = Field(30, ge=2, le=10_000_000)
    """Each side needs this many records for a monitor to judge; below, it reports insufficient data."""
    min_rate_change: float = Field(0.05, gt=0, le=1)
    """A rate alarm also needs the rate to move at least this much (absolute) in the harmful direction."""
    min_length_ratio: float = Field(1.25, gt=1, le=100)
    """A response-length alarm also needs the candidate's mean length to be at least this multiple."""
    split_by_difficulty: bool = True
    """Also run the rate monitors per task difficulty (from the request metadata or the episode)."""
    cluster: Literal["users", "none"] = "users"
    """"users": live traffic is compared with the user (else the session) as the unit, by cluster-robust OLS, as
    the A/B analysis does; "none": every interaction independent (Fisher's exact test, Mann-Whitney U)."""
