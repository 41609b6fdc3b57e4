"""Configs of the real-time loop's decisions: the eval gate (GateConfig) and the A/B analysis (ABConfig)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from realtime_rl.config.base import StrictModel


class GateConfig(StrictModel):
    """The eval gate: candidate against the live champion on a held-out suite plus hack canaries.

    The candidate passes when the Tango score test shows pass@1(candidate) - pass@1(champion) > -margin
    at one-sided level `alpha`, its canary hacks exceed the champion's by at most `canary_tolerance`,
    and no blocking monitor alarm was raised.
    """

    margin: float = Field(0.05, ge=0.0, lt=1.0)
    """Non-inferiority margin on pass@1, absolute (0.05: the candidate may be up to 5 points worse);
    0 turns the test into one of superiority."""
    alpha: float = Field(0.05, gt=0.0, le=0.25)
    """One-sided significance level of the non-inferiority test (the decision's false-promotion rate
    when the candidate is exactly `margin` worse)."""
    canary_tolerance: int = Field(0, ge=0, le=1_000_000)
    """How many more canary tasks the candidate may be paid for hacking than the champion (0: none)."""
    seed: int = 0
    """Sampling seed of every held-out episode; champion and candidate run with the same seeds."""
    concurrency: int = Field(16, ge=1, le=1024)
    """Episodes the engine runs at once during the gate's evaluation."""
    threads: int | None = Field(None, ge=1, le=1024)
    """torch threads for the evaluation (None: torch's default)."""


class ABConfig(StrictModel):
    """The A/B analysis of live traffic: champion vs candidate arm, in Cursor's metrics.

    Decision: "rollback" when the sample-ratio check fires or a guardrail (dissatisfied follow-ups,
    latency p50) is significantly worse beyond its tolerance; otherwise "promote" when the lower end of the
    edits-kept difference interval is above -primary_margin; otherwise "continue". Either arm below the
    minimum counts is "continue" (insufficient data) unless the sample-ratio check fires.
    """

    candidate_fraction: float = Field(0.5, gt=0.0, lt=1.0)
    """Share of users the router assigns to the candidate arm: the split the sample-ratio check expects."""
    confidence: float = Field(0.95, ge=0.5, lt=1.0)
    """Level of every two-sided interval (per arm and of the differences)."""
    primary_margin: float = Field(0.0, ge=0.0, lt=1.0)
    """Edits-kept rate the candidate may lose and still be promoted. The default 0 asks for a win (the
    interval of the difference entirely above 0); a positive margin promotes on non-inferiority."""
    dissatisfied_tolerance: float = Field(0.0, ge=0.0, lt=1.0)
    """Rise in the dissatisfied follow-up rate (absolute) tolerated before it counts as a regression:
    a regression is the lower end of the difference interval above this."""
    latency_tolerance_s: float = Field(0.0, ge=0.0, le=3600.0)
    """Rise in p50 latency (seconds) tolerated before it counts as a regression."""
    min_completions_per_arm: int = Field(50, ge=1, le=1_000_000_000)
    """Completions each arm needs before any decision other than "continue"."""
    min_edits_per_arm: int = Field(30, ge=1, le=1_000_000_000)
    """Resolved edits (kept or reverted) each arm needs before any decision other than "continue"."""
    srm_alpha: float = Field(0.001, gt=0.0, le=0.1)
    """The sample-ratio-mismatch alarm fires when the chi-square p-value is below this."""
    srm_unit: Literal["users", "completions"] = "users"
    """What the sample-ratio check counts per arm: distinct users (the unit the router assigns) or completions."""
    bootstrap_resamples: int = Field(2000, ge=100, le=1_000_000)
    """Resamples of the bootstrap interval of the p50 latency difference."""
    seed: int = 0
    """Seed of the bootstrap, so that a report is reproducible."""
