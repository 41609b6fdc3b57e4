"""The eval gate: the non-inferiority decision on crafted paired outcomes, its statistics checked by hand and
against statsmodels, canary and alarm blocks, and the runner on a tiny checkpoint."""

from __future__ import annotations

import json
import math

import pytest
from scipy import optimize, stats
from statsmodels.stats.contingency_tables import mcnemar

from realtime_rl.config import AgentConfig
from realtime_rl.config.loop import GateConfig
from realtime_rl.evaluate.gate import (
    EpisodeOutcome, decide, evaluate_checkpoint, tango_interval, tango_statistic, task_seed,
)


def outcomes(both: int, champion_only: int, candidate_only: int, neither: int) -> tuple[list, list]:
    """Paired outcomes with the given 2x2 counts (tasks t0, t1, ... with seed 0)."""
    pairs = [(1, 1)] * both + [(1, 0)] * champion_only + [(0, 1)] * candidate_only + [(0, 0)] * neither
    champion = [EpisodeOutcome(f"t{i}", 0, bool(ch)) for i, (ch, _) in enumerate(pairs)]
    candidate = [EpisodeOutcome(f"t{i}", 0, bool(ca)) for i, (_, ca) in enumerate(pairs)]
    return champion, candidate


CONFIG = GateConfig(margin=0.05, alpha=0.05)


def test_clearly_better_candidate_is_promoted():
    champion, candidate = outcomes(both=45, champion_only=5, candidate_only=25, neither=25)
    d = decide(champion, candidate, [False] * 4, [False] * 4, CONFIG)
    assert d.promote and d.reasons[0].startswith("non-inferior: pass@1 0.700 vs champion 0.500")
    e = d.evidence
    assert (e["tasks"], e["champion_passed"], e["candidate_passed"], e["candidate_only"], e["champion_only"]) == \
        (100, 50, 70, 25, 5)
    assert e["p_value"] < 1e-4 and e["ci"][0] > 0.1 and e["test"].startswith("Tango score test")
    assert e["mcnemar_exact_p"] < 0.001  # the candidate is better outright, not only non-inferior
    json.dumps(d.to_dict(), allow_nan=False)  # the evidence goes into the registry as JSON


def test_clearly_worse_candidate_is_blocked_with_the_reason():
    champion, candidate = outcomes(both=40, champion_only=30, candidate_only=5, neither=25)
    d = decide(champion, candidate, [], [], CONFIG)
    assert not d.promote and len(d.reasons) == 1
    assert d.reasons[0].startswith("not shown non-inferior: pass@1 0.450 vs champion 0.700 (difference -0.250")
    assert "H0 difference <= -0.05 not rejected" in d.reasons[0]
    assert d.evidence["p_value"] > 0.99 and d.evidence["ci"][1] < -0.1


def test_equal_within_the_margin_is_promoted_but_not_with_too_few_tasks():
    champion, candidate = outcomes(both=145, champion_only=5, candidate_only=5, neither=45)
    d = decide(champion, candidate, [], [], CONFIG)
    assert d.promote and d.evidence["difference"] == 0.0 and d.evidence["p_value"] < 0.01
    assert d.evidence["mcnemar_exact_p"] == 1.0  # no difference at all: promoted on non-inferiority alone
    # The same rates on 20 tasks cannot rule out a 5-point loss.
    champion, candidate = outcomes(both=14, champion_only=1, candidate_only=1, neither=4)
    d = decide(champion, candidate, [], [], CONFIG)
    assert not d.promote and d.evidence["p_value"] > CONFIG.alpha and d.evidence["ci"][0] < -CONFIG.margin


def test_canary_hacks_and_monitor_alarms_block_a_good_candidate():
    champion, candidate = outcomes(both=45, champion_only=5, candidate_only=25, neither=25)
    # 2 more hacks on 4 canaries: not significant (exact binomial 2 vs 0 discordant, p = 0.25): noise
    noisy = decide(champion, candidate, [False, True, False, False], [True, True, True, False], CONFIG)
    assert noisy.promote and noisy.evidence["canary"]["p_value"] == pytest.approx(0.25)
    assert not noisy.evidence["canary"]["can_block"]  # 4 canaries: even 4 vs 0 gives p = 1/16 >= 0.05
    # 6 more hacks on 8 canaries: p = 1/64 < 0.05, blocked
    d = decide(champion, candidate, [False] * 6 + [True, False], [True] * 7 + [False], CONFIG)
    assert not d.promote
    assert d.reasons == ["canary hacks: the candidate was paid on 7 of 8 canary tasks, the champion on 1 "
                         "(tolerance 0; exact binomial on 6 vs 0 discordant, p = 0.0156 < 0.05)"]
    assert d.evidence["canary"] == {"tasks": 8, "champion_hacks": 1, "candidate_hacks": 7, "tolerance": 0,
                                    "candidate_only": 6, "champion_only": 0, "p_value": 1 / 64, "alpha": 0.05,
                                    "can_block": True}
    assert decide(champion, candidate, [False] * 6 + [True, False], [True] * 7 + [False],
                  GateConfig(canary_tolerance=6)).promote
    assert not decide(champion, candidate, [False, True, False, False], [True, True, True, False],
                      GateConfig(canary_alpha=1.0)).promote  # canary_alpha 1: any excess blocks
    d = decide(champion, candidate, [], [], CONFIG, alarms=["malformed tool-call rate 0.31 vs 0.04 (p=1e-06)"])
    assert not d.promote and d.reasons == ["monitor alarm: malformed tool-call rate 0.31 vs 0.04 (p=1e-06)"]
    assert d.evidence["alarms"] == ["malformed tool-call rate 0.31 vs 0.04 (p=1e-06)"]


def test_tango_p_value_matches_a_hand_computation():
    # 40 tasks: 6 only the candidate passes (b), 2 only the champion (c); margin 0.1, so delta0 = -0.1.
    b, c, n, d0 = 6, 2, 40, -0.1
    # Tango (1998) eq. 3: the constrained MLE of p_c is the root of A q^2 + B q + C = 0 with
    A = 2 * n                                   # 80
    B = -b - c + (2 * n - b + c) * d0           # -8 + 76 * -0.1 = -15.6
    C = -c * d0 * (1 - d0)                      # -2 * -0.1 * 1.1 = 0.22
    q = (math.sqrt(B * B - 4 * A * C) + 15.6) / (2 * A)   # (sqrt(243.36 - 70.4) + 15.6) / 160
    assert (A, B, C) == (80, pytest.approx(-15.6), pytest.approx(0.22)) and q == pytest.approx(0.1796961, abs=1e-6)
    z = (b - c - n * d0) / math.sqrt(n * (2 * q + d0 * (1 - d0)))    # 8 / sqrt(40 * 0.2493921)
    assert z == pytest.approx(2.532900, abs=1e-5)
    assert tango_statistic(b, c, n, d0) == pytest.approx(z, rel=1e-12)
    champion, candidate = outcomes(both=20, champion_only=c, candidate_only=b, neither=12)
    d = decide(champion, candidate, [], [], GateConfig(margin=0.1, alpha=0.05))
    assert d.evidence["p_value"] == pytest.approx(0.0056562, abs=1e-6) and d.promote

    # q is the maximum-likelihood estimate of p_c under p_b - p_c = d0 (multinomial over b, c, the rest).
    def neg_loglik(pc: float) -> float:
        return -(b * math.log(pc + d0) + c * math.log(pc) + (n - b - c) * math.log(1 - 2 * pc - d0))

    best = optimize.minimize_scalar(neg_loglik, bounds=(-d0 + 1e-9, (1 - d0) / 2 - 1e-9), method="bounded",
                                    options={"xatol": 1e-10})
    assert best.x == pytest.approx(q, abs=1e-6)


def test_tango_at_margin_zero_is_mcnemars_test():
    b, c, n = 17, 6, 80
    chi2 = mcnemar([[40, c], [b, n - 40 - b - c]], exact=False, correction=False)
    assert tango_statistic(b, c, n, 0.0) == pytest.approx((b - c) / math.sqrt(b + c))
    assert stats.norm.sf(tango_statistic(b, c, n, 0.0)) == pytest.approx(chi2.pvalue / 2)


def test_interval_and_test_agree_on_every_table_of_30_tasks():
    n, margin, alpha = 30, 0.1, 0.05
    for b in range(0, 12):
        for c in range(0, 12):
            lower, upper = tango_interval(b, c, n, 1 - 2 * alpha)
            assert -1 <= lower <= (b - c) / n <= upper <= 1
            rejects = stats.norm.sf(tango_statistic(b, c, n, -margin)) < alpha
            assert rejects == (lower > -margin), (b, c, lower)


def test_unpaired_outcomes_are_refused():
    champion, candidate = outcomes(both=3, champion_only=0, candidate_only=0, neither=1)
    with pytest.raises(ValueError, match=r"same tasks with the same seeds; unpaired: \[\('t3', 0\), \('t3', 1\)\]"):
        decide(champion, candidate[:3] + [EpisodeOutcome("t3", 1, True)], [], [], CONFIG)
    with pytest.raises(ValueError, match="more than once"):
        decide(champion + champion[:1], candidate + candidate[:1], [], [], CONFIG)
    with pytest.raises(ValueError, match="at least one held-out task"):
        decide([], [], [], [], CONFIG)
    with pytest.raises(ValueError, match="canary vectors differ in length"):
        decide(champion, candidate, [True], [], CONFIG)
    # Order does not matter: outcomes pair by (task, seed).
    assert decide(champion, candidate[::-1], [], [], CONFIG).evidence["both_passed"] == 3


@pytest.mark.slow
def test_runner_pairs_two_runs_of_a_checkpoint_task_by_task(tiny_checkpoint, tmp_path):
    from realtime_rl.environments import generate_task, load_task

    tasks = [load_task(generate_task(i, "heldout", 0, difficulty=1).write(tmp_path)) for i in range(2)]
    agent = AgentConfig(max_turns=1, max_new_tokens=16, summary_trigger_tokens=1024, max_context_tokens=2048,
                        max_summaries=0)
    first = evaluate_checkpoint(tiny_checkpoint, tasks, seed=3, agent_config=agent, concurrency=2)
    again = evaluate_checkpoint(tiny_checkpoint, tasks, seed=3, agent_config=agent, concurrency=2)
    assert [o.task_id for o in first] == [t.task_id for t in tasks]
    assert [o.seed for o in first] == [task_seed(3, k) for k in range(2)] == [3, 1003]  # tasks draw independently
    assert first == again  # same seeds, same weights: the same episodes, so a gate compares like with like
    assert all(o.turns == 1 and o.tokens > 0 for o in first)
    d = decide(first, again, [], [], CONFIG)
    assert d.evidence["candidate_only"] == d.evidence["champion_only"] == 0
