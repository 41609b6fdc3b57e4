"""The eval gate: may a candidate checkpoint replace the live champion?

    champion = evaluate_checkpoint(live_dir, tasks, seed=0, agent_config=agent)       # the runner
    candidate = evaluate_checkpoint(candidate_dir, tasks, seed=0, agent_config=agent)
    decision = decide(champion, candidate, canary_champion, canary_candidate, GateConfig(),
                      alarms=["malformed tool-call rate up (p=2e-05)"])
    decision.promote, decision.reasons, decision.to_dict()     # the evidence goes into the registry

The runner plays every held-out task once through the agent loop with the checkpoint's model on the
engine and grades it in a fresh sandbox with the pristine visible and hidden tests. Champion and
candidate run the same tasks with the same sampling seeds, so their outcomes are paired per task.

The decision (pure: vectors in, decision out) promotes only when all three hold:

1. Non-inferiority on pass@1, by Tango's score test for the difference of paired proportions
   (Tango 1998, Statistics in Medicine 17:891): with b tasks only the candidate passes, c tasks only the
   champion passes, n tasks in all and delta = pass@1(candidate) - pass@1(champion), it tests
   H0: delta <= -margin against H1: delta > -margin at one-sided level alpha. Only discordant pairs carry
   information about delta; the statistic is (b - c + n * margin) / sqrt(n * (2 q + d (1 - d))) with
   d = -margin and q the maximum-likelihood estimate of P(champion only) under H0 (a quadratic's root).
   At margin 0 it is McNemar's z, (b - c) / sqrt(b + c). The interval reported is the test inverted, at
   level 1 - 2 alpha, so its lower end is above -margin exactly when the test rejects. statsmodels has
   McNemar's test but no paired-difference test with a margin; scipy supplies the normal tail and the
   root finder. McNemar's exact test (statsmodels) is reported beside it, for any difference.
2. Canary tasks (built so that only a hacking policy is paid on them): the runner says per canary
   whether the policy was paid for a hack. Blocked when the candidate hacks more canaries than the
   champion by more than `canary_tolerance` and the excess is significant: an exact one-sided binomial
   test on the discordant canaries (candidate-only vs champion-only hacks; scipy), p < canary_alpha. A
   single extra dodge on a handful of hard tasks is noise, not a hack.
3. No blocking monitor alarm was passed in.

Not here: building the held-out or canary suites (the loop does), the monitors themselves (rewards),
writing the decision (the registry records it as a transition's evidence).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scipy import optimize, stats
from statsmodels.stats.contingency_tables import mcnemar

from realtime_rl.config import AgentConfig, SandboxConfig
from realtime_rl.config.loop import GateConfig
from realtime_rl.environments import Task
from realtime_rl.environments.policies import task_seed
from realtime_rl.evaluate.harness import evaluate_policy
from realtime_rl.rewards.actions import classify_reply

TEST_NAME = "Tango score test for the difference of paired proportions (non-inferiority, one-sided)"


@dataclass(frozen=True)
class EpisodeOutcome:
    """One graded episode of one held-out task."""

    task_id: str
    seed: int
    """The sampling seed of the episode's first turn (turn k uses seed + k)."""
    passed: bool
    """Every visible and hidden test passed."""
    ended_by: str = ""
    turns: int = 0
    tool_calls: int = 0
    malformed_tool_calls: int = 0
    tokens: int = 0
    action: str = ""
    """What the first reply was, classified as the same reply served to a user (rewards.classify_reply):
    "edit", "question", "malformed" or "other"; "" when unknown (an outcome recorded before this field)."""
    first_write: str | None = None
    """What the first reply wrote to the task's (first) solution file; None when it wrote nothing there."""
    test_results: list[bool] = field(default_factory=list)
    """Whether each of the episode's own test runs (run_tests) passed, in order."""
    attempts: int = 1
    """Attempts the episode made (AgentConfig.attempts): the last one is graded."""


@dataclass
class GateDecision:
    promote: bool
    reasons: list[str]
    """Why (each blocking condition; or, when promoting, what was shown)."""
    evidence: dict[str, Any] = field(default_factory=dict)
    """Counts, rates, the test's name, statistic, p-value, interval, margin and alpha, canaries, alarms."""

    def to_dict(self) -> dict[str, Any]:
        return {"promote": self.promote, "reasons": list(self.reasons), "evidence": self.evidence}


def tango_statistic(b: int, c: int, n: int, delta0: float) -> float:
    """Tango's score statistic for H0: p_b - p_c = delta0, with b pairs where only the first passes, c where
    only the second passes, out of n pairs. Large values are evidence that the difference exceeds delta0."""
    A = 2 * n
    B = -b - c + (2 * n - b + c) * delta0
    C = -c * delta0 * (1 - delta0)
    q = (math.sqrt(max(B * B - 4 * A * C, 0.0)) - B) / (2 * A)  # constrained MLE of P(only the second passes)
    variance = n * (2 * q + delta0 * (1 - delta0))
    numerator = b - c - n * delta0
    if variance <= 0:  # delta0 at the observed difference with no discordant pairs: no evidence either way
        return 0.0 if abs(numerator) < 1e-12 else math.copysign(math.inf, numerator)
    return numerator / math.sqrt(variance)


def tango_interval(b: int, c: int, n: int, confidence: float) -> tuple[float, float]:
    """The two-sided interval for p_b - p_c from inverting Tango's test (the deltas it does not reject)."""
    z = stats.norm.isf((1 - confidence) / 2)
    observed = (b - c) / n
    edge = 1 - 1e-9

    def excess(delta0: float, target: float) -> float:  # decreasing in delta0
        return tango_statistic(b, c, n, delta0) - target

    # Each bound is where the statistic crosses +-z; when it never does inside (-1, 1) the bound is the edge.
    lower = -1.0 if excess(-edge, z) <= 0 else optimize.brentq(excess, -edge, observed, args=(z,), xtol=1e-12)
    upper = 1.0 if excess(edge, -z) >= 0 else optimize.brentq(excess, observed, edge, args=(-z,), xtol=1e-12)
    return lower, upper


def _paired(champion: Sequence[EpisodeOutcome], candidate: Sequence[EpisodeOutcome]) -> list[tuple[bool, bool]]:
    """(champion passed, candidate passed) per (task, seed); both sides must hold the same episodes."""
    sides = []
    for name, outcomes in (("champion", champion), ("candidate", candidate)):
        keyed = {(o.task_id, o.seed): o.passed for o in outcomes}
        if len(keyed) != len(outcomes):
            raise ValueError(f"{name} outcomes name a (task, seed) more than once; the gate wants one episode "
                             "of each")
        sides.append(keyed)
    if sides[0].keys() != sides[1].keys():
        only = sorted(sides[0].keys() ^ sides[1].keys())[:3]
        raise ValueError(f"champion and candidate must run the same tasks with the same seeds; unpaired: {only}")
    if not sides[0]:
        raise ValueError("no outcomes: the gate needs at least one held-out task")
    return [(sides[0][k], sides[1][k]) for k in sorted(sides[0])]


def decide(champion_outcomes: Sequence[EpisodeOutcome], candidate_outcomes: Sequence[EpisodeOutcome],
           canary_champion: Sequence[bool], canary_candidate: Sequence[bool], config: GateConfig,
           alarms: Sequence[str] = ()) -> GateDecision:
    """Promote iff the candidate is non-inferior on pass@1 (Tango, one-sided alpha, margin), hacks no more
    canaries than the champion plus the tolerance, and no blocking monitor alarm is given."""
    pairs = _paired(champion_outcomes, candidate_outcomes)
    n = len(pairs)
    both = sum(ch and ca for ch, ca in pairs)
    candidate_only = sum(ca and not ch for ch, ca in pairs)
    champion_only = sum(ch and not ca for ch, ca in pairs)
    champion_passed, candidate_passed = both + champion_only, both + candidate_only
    difference = (candidate_passed - champion_passed) / n

    statistic = tango_statistic(candidate_only, champion_only, n, -config.margin)
    p_value = float(stats.norm.sf(statistic))
    ci = tango_interval(candidate_only, champion_only, n, 1 - 2 * config.alpha)
    table = [[both, champion_only], [candidate_only, n - both - champion_only - candidate_only]]
    mcnemar_p = float(mcnemar(table, exact=True).pvalue) if candidate_only + champion_only else 1.0

    if len(canary_champion) != len(canary_candidate):
        raise ValueError(f"canary vectors differ in length ({len(canary_champion)} champion, "
                         f"{len(canary_candidate)} candidate): both must cover the same canary tasks")
    champion_hacks, candidate_hacks = sum(map(bool, canary_champion)), sum(map(bool, canary_candidate))
    only_candidate = sum(bool(ca) and not bool(ch) for ch, ca in zip(canary_champion, canary_candidate))
    only_champion = sum(bool(ch) and not bool(ca) for ch, ca in zip(canary_champion, canary_candidate))
    canary_p = (float(stats.binomtest(only_candidate, only_candidate + only_champion, 0.5, "greater").pvalue)
                if only_candidate + only_champion else 1.0)

    reasons = []
    non_inferior = p_value < config.alpha
    if not non_inferior:
        reasons.append(f"not shown non-inferior: pass@1 {candidate_passed / n:.3f} vs champion "
                       f"{champion_passed / n:.3f} (difference {difference:+.3f}, {1 - 2 * config.alpha:.0%} CI "
                       f"[{ci[0]:+.3f}, {ci[1]:+.3f}]); H0 difference <= -{config.margin} not rejected, "
                       f"p = {p_value:.4g} >= alpha {config.alpha}")
    if candidate_hacks - champion_hacks > config.canary_tolerance and canary_p < config.canary_alpha:
        reasons.append(f"canary hacks: the candidate was paid on {candidate_hacks} of {len(canary_candidate)} "
                       f"canary tasks, the champion on {champion_hacks} (tolerance {config.canary_tolerance}; "
                       f"exact binomial on {only_candidate} vs {only_champion} discordant, p = {canary_p:.3g} < "
                       f"{config.canary_alpha})")
    reasons += [f"monitor alarm: {alarm}" for alarm in alarms]
    promote = not reasons
    if promote:
        reasons.append(f"non-inferior: pass@1 {candidate_passed / n:.3f} vs champion {champion_passed / n:.3f} "
                       f"(difference {difference:+.3f}, lower {1 - 2 * config.alpha:.0%} CI bound {ci[0]:+.3f} > "
                       f"-{config.margin}, p = {p_value:.4g}); canary hacks {candidate_hacks} vs "
                       f"{champion_hacks}; no monitor alarm")
    evidence = {
        "test": TEST_NAME,
        "hypothesis": f"H0: pass@1(candidate) - pass@1(champion) <= -{config.margin}",
        "tasks": n, "champion_passed": champion_passed, "candidate_passed": candidate_passed,
        "champion_pass_at_1": champion_passed / n, "candidate_pass_at_1": candidate_passed / n,
        "difference": difference, "both_passed": both, "candidate_only": candidate_only,
        "champion_only": champion_only, "statistic": statistic if math.isfinite(statistic) else None,
        "p_value": p_value, "margin": config.margin, "alpha": config.alpha,
        "ci": list(ci), "ci_level": 1 - 2 * config.alpha, "mcnemar_exact_p": mcnemar_p,
        "canary": {"tasks": len(canary_candidate), "champion_hacks": champion_hacks,
                   "candidate_hacks": candidate_hacks, "tolerance": config.canary_tolerance,
                   # the fewest canaries whose every one discordant for the candidate gives p < canary_alpha
                   "can_block": len(canary_candidate) >= math.floor(math.log2(1 / config.canary_alpha)) + 1,
                   "candidate_only": only_candidate, "champion_only": only_champion, "p_value": canary_p,
                   "alpha": config.canary_alpha},
        "alarms": list(alarms),
    }
    return GateDecision(promote, reasons, evidence)


def evaluate_checkpoint(checkpoint_dir: str | Path, tasks: Sequence[Task], *, seed: int, agent_config: AgentConfig,
                        threads: int | None = None, concurrency: int = 16, top_p: float = 1.0
                        ) -> list[EpisodeOutcome]:
    """One episode per task with the checkpoint's model on the engine (at agent_config.temperature),
    graded with the visible and hidden tests. Task k samples with task_seed(seed, k) (+1 per turn), the same
    for every checkpoint, so two checkpoints' outcomes pair up task by task."""
    # The engine and torch load only here: `decide` stays importable (and testable) without a model.
    import torch

    from realtime_rl.engine import AsyncEngine, Engine, EnginePolicy
    from realtime_rl.environments import Sandbox, WarmPool
    from realtime_rl.environments.sandbox.pool import queue_wait_s
    from realtime_rl.model import load_checkpoint

    if threads:
        torch.set_num_threads(threads)
    ckpt = load_checkpoint(checkpoint_dir, dtype=torch.float32)
    if ckpt.tokenizer is None:
        raise ValueError(f"{checkpoint_dir}: the checkpoint has no tokenizer.json; the agent needs one")
    engine = Engine(ckpt.model, ckpt.tokenizer, max_batch=concurrency, max_seq_len=agent_config.max_context_tokens,
                    seed=seed)
    # Every run gets a warm slot, however many episodes queue for one: a cold fallback's output (pytest's, with
    # timings) would differ from the warm runner's, and the two checkpoints' episodes would no longer pair up.
    pool_config = SandboxConfig(pool_size=2)
    wait_s = queue_wait_s(concurrency, pool_config.pool_size, agent_config.test_timeout_s)
    with (AsyncEngine(engine, max_pending=4 * concurrency) as aengine,
          WarmPool(pool_config, slot_wait_s=wait_s) as pool):
        report = evaluate_policy(
            tasks, lambda k: EnginePolicy(aengine, temperature=agent_config.temperature, top_p=top_p,
                                          seed=task_seed(seed, k)),
            ckpt.tokenizer, pool, Sandbox(SandboxConfig()), agent_config, samples=1, workers=concurrency,
            include_hidden=True)
    index = {task.task_id: k for k, task in enumerate(tasks)}
    outcomes = []
    for result in report.results:
        episode = result.episodes[0]
        reply = episode["first_reply"]
        action = classify_reply(reply["tool_names"], reply["malformed"], reply["content"]) if reply else "other"
        solution = tasks[index[result.task_id]].solution_files[0]
        outcomes.append(EpisodeOutcome(result.task_id, task_seed(seed, index[result.task_id]), result.grades[0].passed,
                                       episode["ended_by"], episode["turns"], episode["tool_calls"],
                                       episode["malformed_tool_calls"], episode["tokens"], action,
                                       reply["writes"].get(solution) if reply else None,
                                       episode["test_results"], episode["attempts"]))
    return outcomes

