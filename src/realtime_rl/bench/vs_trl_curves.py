"""bench vs-trl's arithmetic on pass@1 curves: minutes to the target, the ratio of the two sides' minutes, its
bootstrap intervals over the evaluation's tasks, the isotonic fit, the per-step comparison, and where the runs
are snapshotted. Pure functions of numbers (bench/vs_trl.py runs the two sides and evaluates the snapshots)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats
from scipy.optimize import isotonic_regression

RESAMPLES = 2000
"""Bootstrap resamples of the evaluation's tasks behind `ratio_ci95`."""
SNAPSHOT_FRACTIONS = (1 / 24, 2 / 24, 3 / 24, 4 / 24, 6 / 24, 8 / 24, 12 / 24, 18 / 24, 1.0)
"""Where each run is snapshotted, as fractions of the budget (0.8, 1.7, 2.5, 3.3, 5, 6.7, 10, 15 and 20
minutes of 20): dense early, where ours crosses base + 10 points (both sides did before the quarter mark on
2026-11-24, which left the crossing times to interpolation between the base and that one snapshot)."""

def minutes_to_target(curve: list[tuple[float, float]], target: float) -> float | None:
    """Minutes at which pass@1 first reaches `target` on a curve of (minutes, pass@1) points, starting with
    the base at 0: linear between the last point below and the first at or above; None if never. Pass rates
    are counts over the evaluation's tasks, so the target is met to within rounding: 88/200 reaches a base
    of 0.34 + 0.10, which is 0.44000000000000006 in floating point."""
    target -= 1e-9
    for (m0, p0), (m1, p1) in zip(curve, curve[1:]):
        if p0 >= target:
            return m0
        if p1 >= target:
            return m0 + (target - p0) / (p1 - p0) * (m1 - m0)
    return curve[-1][0] if curve and curve[-1][1] >= target else None


def monotone(curve: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The non-decreasing curve nearest `curve` in least squares (isotonic regression, pool adjacent
    violators): each snapshot's pass@1 is a sample (+-4.4 points at 95% on 500 tasks), and one lucky snapshot
    at the target decides `minutes_to_target` on the raw curve; the fit pools a dip with the points around
    it, so a crossing needs the curve's level, not one point, to reach the target. Progress over a short run
    is taken to be monotone; a real regression shows as a pooled plateau, not as a fall."""
    fitted = isotonic_regression([p for _, p in curve]).x
    return [(m, float(p)) for (m, _), p in zip(curve, fitted)]


def per_step(ours_pass_rates: Sequence[float], trl_pass_rates: Sequence[float]) -> dict[str, Any]:
    """Ours' step i against TRL's step i: both draw from the same task stream, 4 tasks a step, so the
    difference of their on-policy pass rates, averaged over the steps both took, with its 95% t-interval,
    says whether one learns more per step. Paired by step, not by task: TRL's step i is tasks 4i..4i+3, while
    ours (asynchronous) trains on the groups that finished first, which may include the next step's, and a
    group dropped as too stale moves its stream on by one task (`ours_dropped_stale_groups`). The snapshots'
    crossing reads minutes off 500-task evaluations (+-4.4 points each); this reads every step's 32 replies."""
    n = min(len(ours_pass_rates), len(trl_pass_rates))
    if n < 2:
        return {"steps": n, "mean": None, "ci95": None}
    diff = np.asarray(ours_pass_rates[:n]) - np.asarray(trl_pass_rates[:n])
    sem = stats.sem(diff)
    low, high = (diff.mean(), diff.mean()) if sem == 0 else stats.t.interval(0.95, n - 1, diff.mean(), sem)
    return {"steps": n, "mean": float(diff.mean()), "ci95": [float(low), float(high)]}


def ratio_of(ours: float | None, trl: float | None, trl_budget: float) -> tuple[float | None, bool]:
    """(TRL's minutes / ours', is_lower_bound): None when ours never reaches the target or starts there; when
    only TRL never does, its whole budget stands in and the ratio is a lower bound."""
    if not ours:
        return None, False
    return (trl if trl is not None else trl_budget) / max(ours, 1e-9), trl is None


def crossings(curves: dict[str, list[tuple[float, float]]], target: float, trl_budget: float,
              suffix: str = "") -> dict[str, Any]:
    """Both sides' minutes to `target` on these curves and their ratio, under the JSON's names + `suffix`."""
    ours, trl = minutes_to_target(curves["ours"], target), minutes_to_target(curves["trl"], target)
    ratio, lower_bound = ratio_of(ours, trl, trl_budget)
    return {f"ours_minutes_to_target{suffix}": ours, f"trl_minutes_to_target{suffix}": trl,
            f"ratio{suffix}": ratio, f"ratio{suffix}_is_lower_bound": lower_bound}


def ratio_intervals(base: np.ndarray, snapshots: dict[str, list[tuple[float, np.ndarray]]], gain: float,
                    trl_budget: float, resamples: int = RESAMPLES, seed: int = 0) -> dict[str, list[float]]:
    """95% percentile intervals of `ratio` and `ratio_monotone` over the evaluation's tasks. `base` and each
    side's snapshots are per-task outcomes (1 passed) on the same tasks in the same order; a resample draws
    the tasks with replacement, the same draw for the base (and so the target) and every snapshot, and reads
    both crossings off the resampled curves. It covers which tasks the evaluation drew, not the training runs'
    own randomness (a replicate shows that). A resample in which ours never reaches the target counts as 0,
    one in which only TRL never does as its lower bound: either pushes the interval down, never up."""
    draws = np.random.default_rng(seed).integers(0, len(base), size=(resamples, len(base)))
    base_b = base[draws].mean(axis=1)
    sides = {side: ([m for m, _ in snaps], np.stack([passed[draws].mean(axis=1) for _, passed in snaps]))
             for side, snaps in snapshots.items()}
    ratios: dict[str, list[float]] = {"ratio_ci95": [], "ratio_monotone_ci95": []}
    for b in range(resamples):
        curves = {side: [(0.0, float(base_b[b]))] + [(m, float(p)) for m, p in zip(minutes, rates[:, b])]
                  for side, (minutes, rates) in sides.items()}
        target = float(base_b[b]) + gain
        for key, fit in (("ratio_ci95", lambda c: c), ("ratio_monotone_ci95", monotone)):
            ratio, _ = ratio_of(minutes_to_target(fit(curves["ours"]), target),
                                minutes_to_target(fit(curves["trl"]), target), trl_budget)
            ratios[key].append(ratio or 0.0)
    return {key: [float(q) for q in np.percentile(values, [2.5, 97.5])] for key, values in ratios.items()}


def marks(budget: float) -> list[float]:
    return [budget * f for f in SNAPSHOT_FRACTIONS]


def snapshot_steps(step_minutes: list[float], budget: float) -> list[int]:
    """Ours' snapshots: for each mark, the last step that ended by it (a mark no step ended by is the base's),
    each step once, in time order; the first step when none ended within the budget."""
    steps: list[int] = []
    for mark in marks(budget):
        done = [i for i, m in enumerate(step_minutes) if m <= mark + 1e-9]
        if done and (not steps or steps[-1] != done[-1]):
            steps.append(done[-1])
    return steps or [0]
