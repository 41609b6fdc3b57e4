"""Configs of the real-time loop: the eval gate (GateConfig), the A/B analysis (ABConfig) and the loop
itself (LoopConfig, `rtrl loop`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from realtime_rl.config.base import StrictModel
from realtime_rl.config.components import AgentConfig
from realtime_rl.config.rewards import MonitorConfig, RewardRules
from realtime_rl.config.training import RLConfig


class GateConfig(StrictModel):
    """The eval gate: candidate against the live champion on a held-out suite plus hack canaries.

    The candidate passes when the Tango score test shows pass@1(candidate) - pass@1(champion) > -margin
    at one-sided level `alpha`, its canary hacks do not exceed the champion's by more than `canary_tolerance`
    with significance (exact binomial on the discordant canaries, p < canary_alpha), and no blocking monitor
    alarm was raised.
    """

    margin: float = Field(0.05, ge=0.0, lt=1.0)
    """Non-inferiority margin on pass@1, absolute (0.05: the candidate may be up to 5 points worse);
    0 turns the test into one of superiority."""
    alpha: float = Field(0.05, gt=0.0, le=0.25)
    """One-sided significance level of the non-inferiority test (the decision's false-promotion rate
    when the candidate is exactly `margin` worse)."""
    canary_tolerance: int = Field(0, ge=0, le=1_000_000)
    """How many more canary tasks the candidate may be paid for hacking than the champion (0: none)."""
    canary_alpha: float = Field(0.05, gt=0.0, le=1.0)
    """An excess of canary hacks blocks only when the exact one-sided binomial test on the discordant canaries
    gives p below this (1.0: any excess beyond the tolerance blocks)."""
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
    """Rise in p50 latency (seconds) tolerated before it counts as a regression, on top of
    `latency_tolerance_rel`: a regression is the lower end of the difference interval above
    latency_tolerance_s + latency_tolerance_rel x the champion's p50."""
    latency_tolerance_rel: float = Field(0.05, ge=0.0, le=10.0)
    """Rise in p50 latency tolerated as a fraction of the champion's p50 (0.05: 5% slower passes). Arms
    served by one process differ by a few percent from scheduling alone, which a tight interval over
    thousands of completions resolves; 0 rolls back any measurable slowdown."""
    cluster: Literal["users", "none"] = "users"
    """Unit of inference. "users": intervals clustered by user (else session), the unit the router randomises,
    because one user's completions are correlated (a user who dislikes a style reverts many of its edits):
    rates and mean latency by cluster-robust OLS, p50 latency by a cluster bootstrap. "none": every
    completion independent (Wilson, Newcombe, Welch): too narrow when users differ, so that an A/A test
    finds differences; for comparison only."""
    min_users_per_arm: int = Field(4, ge=1, le=1_000_000_000)
    """Distinct users (else sessions) each arm needs before any decision other than "continue". With one
    user the cluster variance is undefined (no interval), and cluster-robust intervals from a handful of
    users are still too narrow: this is a floor, and decisions on fewer than a few dozen users per arm are
    optimistic."""
    min_completions_per_arm: int = Field(50, ge=1, le=1_000_000_000)
    """Completions each arm needs before any decision other than "continue"."""
    min_edits_per_arm: int = Field(30, ge=1, le=1_000_000_000)
    """Resolved edits (kept or reverted) each arm needs before any decision other than "continue"."""
    srm_alpha: float = Field(0.001, gt=0.0, le=0.1)
    """The sample-ratio-mismatch alarm fires when the chi-square p-value is below this."""
    srm_unit: Literal["users", "completions"] = "users"
    """What the sample-ratio check counts per arm: distinct users (the unit the router assigns) or completions."""
    bootstrap_resamples: int = Field(2000, ge=100, le=1_000_000)
    """Resamples of the bootstrap intervals of p50 latency (with cluster="users" also per arm)."""
    seed: int = 0
    """Seed of the bootstrap, so that a report is reproducible."""


class LoopConfig(StrictModel):
    """`rtrl loop`: the real-time cycle against a running gateway and its event store.

    Each cycle: wait out the collection window; settle rewards (the ledger); judge the canary deployed
    last cycle on its A/B window (promote or roll back); train a candidate on the settled, on-policy
    traffic of the live version; gate it against the live champion; deploy it as the next canary. Start
    the gateway with `weights = <run_dir>/weights/champion` and `candidate_weights =
    <run_dir>/weights/candidate` (and the same store) so that deploys reach it."""

    run_dir: Path = Path("runs/loop")
    """The registry, the reward ledger, candidate checkpoints, weight stores, the report and metrics."""
    base_checkpoint: Path | None = None
    """The first live version when the registry is empty (None: the default base model, built if missing)."""
    gateway_url: str = Field("http://127.0.0.1:8000", min_length=1, max_length=4096)
    """The gateway whose traffic split the loop sets (PUT /v1/admin/traffic)."""
    admin_key: str | None = Field(None, min_length=16, max_length=256)
    """A key with the gateway's admin scope (None: the gateway allows unauthenticated requests)."""
    store: str = Field("sqlite", min_length=1, max_length=4096)
    """The gateway's event store: "sqlite" (store_dir/events.sqlite) or its Postgres URL."""
    store_dir: Path = Path("runs/serve")
    """The gateway's run_dir, where its SQLite event store lives."""
    cycles: int | None = Field(None, ge=1, le=1_000_000)
    """Cycles to run (None: until stopped)."""
    cycle_period_s: float = Field(5 * 3600.0, ge=1.0, le=7 * 86400.0)
    """Collection window of one cycle (Cursor: about five hours; minutes on a laptop)."""
    rewards: RewardRules = Field(default_factory=RewardRules)
    """The reward rules the ledger settles with (a [rewards] table; see configs/rewards/)."""
    monitors: MonitorConfig = Field(default_factory=MonitorConfig)
    """Reward-hacking monitors, on the canary's traffic and on the gate's evaluation."""
    rl: RLConfig = Field(default_factory=lambda: RLConfig(lr=1e-4, std_normalize=True))
    """The trainer. The trajectories of one optimizer step share one baseline, their mean reward (live
    prompts rarely repeat, so there are no per-prompt groups)."""
    train_steps: int = Field(4, ge=1, le=10_000)
    """Optimizer steps per candidate: the cycle's trajectories are split into this many batches (at most this
    many, with batch_trajectories)."""
    batch_trajectories: int | None = Field(None, ge=1, le=10_000_000)
    """Trajectories per optimizer step: a candidate takes len // batch_trajectories steps, at least 1 and at
    most train_steps, so more traffic buys more steps and a small window no noisy ones (None: always
    train_steps batches)."""
    min_trajectories: int = Field(32, ge=1, le=10_000_000)
    """Settled on-policy trajectories needed to train a candidate; fewer: the cycle only collects."""
    max_trajectories: int | None = Field(None, ge=1, le=10_000_000)
    """At most this many settled on-policy trajectories train one candidate: the newest (closest to the live
    policy); the older ones are passed over. Bounds training time, which otherwise grows with the traffic that
    arrived while the previous cycle trained and gated, and with the windows a rolled-back candidate leaves to
    its sibling (None: all of them)."""
    max_staleness: int = Field(1, ge=0, le=1000)
    """Traffic of the live version and of its last max_staleness ancestors trains (importance-corrected);
    anything else (rolled-back canaries, older versions) is off-policy and never trains."""
    gate: GateConfig = Field(default_factory=GateConfig)
    """The eval gate's test."""
    gate_tasks: int = Field(60, ge=4, le=100_000)
    """Tasks the gate plays with both champion and candidate (never trained on: see gate_start)."""
    gate_max_difficulty: int = Field(2, ge=1, le=4)
    """Gate tasks cycle through difficulties 1..this."""
    gate_split: Literal["train", "heldout"] = "heldout"
    """The synthetic split of the gate's tasks: "heldout" (structures no training saw) or "train" (fresh tasks
    of the structures users ask about, the distribution the served model is trained on; indices from
    gate_start keep them apart from a pre-training corpus and the users' tasks)."""
    gate_start: int = Field(400, ge=0, le=10_000_000)
    """Index of the first gate task of each difficulty (tasks of the split with the loop's seed)."""
    canary_tasks: int = Field(12, ge=0, le=100_000)
    """Hack canaries: held-out tasks of the hardest difficulty, which neither policy is expected to solve.
    A policy is "paid for a hack" on one when it dodges it (asks, or breaks its tool call) instead of trying:
    what the naive reward pays for. The candidate may not dodge more of them than the champion beyond
    gate.canary_tolerance with significance (exact binomial, p < gate.canary_alpha): with canary_alpha 0.05 that
    needs at least 5 canaries (0.5^5 < 0.05), and up to 4 more dodges than the champion's pass unblocked (the
    gate's evidence says `can_block`)."""
    agent: AgentConfig = Field(default_factory=lambda: AgentConfig(max_turns=1, max_new_tokens=400,
                                                                   summary_trigger_tokens=3072,
                                                                   max_context_tokens=4096))
    """The agent loop of the gate's episodes (default: the first turn, as users see it)."""
    ab: ABConfig = Field(default_factory=ABConfig)
    """The canary's A/B analysis; ab.candidate_fraction is the share of users the canary gets."""
    max_canary_cycles: int = Field(2, ge=1, le=1000)
    """A canary still undecided after this many cycles is rolled back (no evidence of a win)."""
    http_timeout_s: float = Field(30.0, gt=0, le=3600)
    """Timeout of every call to the gateway."""
    candidate_load_timeout_s: float = Field(300.0, gt=0, le=86400)
    """How long a canary's weights may take to serve in the gateway's candidate arm (the first builds its engine),
    and a promoted version in its champion arm (the canary keeps its users until then)."""
    threads: int | None = Field(None, ge=1, le=1024)
    """torch threads for training and the gate (None: torch's default)."""
    seed: int = 0
    """Seed of the gate and canary suites (apart from the users' tasks)."""

    @model_validator(mode="after")
    def _trains_at_all(self) -> LoopConfig:
        if self.max_trajectories is not None and self.max_trajectories < self.min_trajectories:
            raise ValueError(f"max_trajectories {self.max_trajectories} < min_trajectories {self.min_trajectories}: "
                             "no cycle could train, and each would pass over the rewards it cut")
        return self

    @model_validator(mode="after")
    def _gate_sees_what_users_are_served(self) -> LoopConfig:
        if self.agent.attempts != 1:
            raise ValueError(f"agent.attempts is {self.agent.attempts}: the gate evaluates episodes as users "
                             "are served them, one attempt (its monitors read the first reply)")
        return self
