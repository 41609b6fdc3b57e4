"""One metric of an A/B in both arms, and the candidate-minus-champion difference, with intervals: edits
kept and dissatisfied follow-ups (rates) and latency (p50 and mean), as evaluate.ab's docstring describes
(cluster-robust by user, or the independent methods with cluster="none")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from scipy import stats
from statsmodels.stats.proportion import confint_proportions_2indep, proportion_confint, test_proportions_2indep

from realtime_rl.config.loop import ABConfig
from realtime_rl.rewards.stats import cluster_robust, finite


@dataclass(frozen=True)
class Estimate:
    """A value with its interval; None where the data cannot give one (an empty arm; clustered, one user or
    a mean without variance)."""

    value: float | None
    low: float | None = None
    high: float | None = None

    def text(self, scale: float = 1.0, digits: int = 3, sign: bool = False) -> str:
        """"41.9 [31.9, 51.8]" (value and interval times `scale`), "-" without a value."""
        if self.value is None:
            return "-"
        fmt = f"{{:{'+' if sign else ''}.{digits}f}}"
        text = fmt.format(self.value * scale)
        if self.low is not None and self.high is not None:
            text += f" [{fmt.format(self.low * scale)}, {fmt.format(self.high * scale)}]"
        return text


@dataclass(frozen=True)
class Comparison:
    """One metric in both arms and the candidate-minus-champion difference."""

    label: str
    unit: str
    """"%" (a rate, stored as a fraction) or "s"."""
    champion: Estimate
    candidate: Estimate
    difference: Estimate
    relative: float | None
    """(candidate - champion) / champion."""
    p_value: float | None
    """Two-sided test of no difference (None: a bootstrap interval, no interval, or no variance)."""
    n_champion: int
    n_candidate: int
    method: str
    """How the intervals were made: "cluster-robust (users)", "cluster bootstrap (users)", "cluster-robust
    (users); Wilson, Newcombe hull (no variance: <arms>)" for a rate constant in an arm, or the independent
    methods ("Wilson; Newcombe", ...) with cluster="none"."""


def _relative(champion: float | None, candidate: float | None) -> float | None:
    if champion is None or candidate is None or champion == 0:
        return None
    return (candidate - champion) / champion


def _clustered(value: float, y: np.ndarray, X: np.ndarray, groups: np.ndarray,
               alpha: float) -> tuple[Estimate, float | None]:
    """`value`, the last coefficient of OLS of y on X computed exactly by the caller, with its cluster-robust
    interval and p-value (CR1, t with G - 1 df). The caller ensures two clusters or more per arm: with one,
    the cluster variance is undefined. No variance within the arms: no interval (the point would be one,
    and decide)."""
    fit = cluster_robust(y, X, groups, alpha)
    if fit is None:
        return Estimate(value), None
    if fit.half_width is None:
        return Estimate(value), fit.p_value
    return Estimate(value, value - fit.half_width, value + fit.half_width), fit.p_value


def _clustered_means(label: str, unit: str, y: np.ndarray, is_candidate: np.ndarray, groups: np.ndarray,
                     alpha: float) -> Comparison:
    """Per-arm means (OLS on a constant) and their difference (OLS on [1, is_candidate]), clustered."""
    arms, clusters = {}, {}
    for arm, mask in (("champion", ~is_candidate), ("candidate", is_candidate)):
        clusters[arm] = len(np.unique(groups[mask]))
        arms[arm] = Estimate(float(y[mask].mean()) if mask.any() else None)
        if clusters[arm] >= 2:
            constant = np.ones((int(mask.sum()), 1))
            arms[arm], _ = _clustered(arms[arm].value, y[mask], constant, groups[mask], alpha)
        if unit == "%" and arms[arm].low is not None:
            arms[arm] = Estimate(arms[arm].value, max(0.0, arms[arm].low), min(1.0, arms[arm].high))
    difference, p_value = Estimate(None), None
    if min(clusters.values()) >= 2:
        difference, p_value = _clustered(arms["candidate"].value - arms["champion"].value, y,
                                         np.column_stack([np.ones(len(y)), is_candidate]), groups, alpha)
    return Comparison(label, unit, arms["champion"], arms["candidate"], difference,
                      _relative(arms["champion"].value, arms["candidate"].value), p_value,
                      int((~is_candidate).sum()), int(is_candidate.sum()), "cluster-robust (users)")


def rate(label: str, y: np.ndarray, is_candidate: np.ndarray, groups: np.ndarray,
          config: ABConfig) -> Comparison:
    """A 0/1 outcome per completion (y) in both arms."""
    alpha = 1 - config.confidence
    independent = _independent_rate(label, y, is_candidate, alpha)
    if config.cluster == "none":
        return independent
    clustered = _clustered_means(label, "%", y, is_candidate, groups, alpha)
    # An arm with the same outcome in every completion gives the cluster fit no variance to estimate, and the
    # clustered difference takes that arm's rate as known exactly. Wilson's interval keeps its binomial
    # uncertainty; the hull with Newcombe's keeps it in the difference while keeping the other arm's clustering
    # (with the larger p-value, as the interval is the wider).
    flat = [arm for arm, mask in (("champion", ~is_candidate), ("candidate", is_candidate))
            if len(np.unique(groups[mask])) >= 2 and np.ptp(y[mask]) == 0]
    if not flat:
        return clustered
    difference, p_value = clustered.difference, clustered.p_value
    if difference.value is not None:  # both arms have two users or more
        both = (difference, independent.difference)
        difference = Estimate(difference.value, min((e.low for e in both if e.low is not None), default=None),
                              max((e.high for e in both if e.high is not None), default=None))
        p_value = max((p for p in (p_value, independent.p_value) if p is not None), default=None)
    return replace(clustered, difference=difference, p_value=p_value,
                   method=f"cluster-robust (users); Wilson, Newcombe hull (no variance: {', '.join(flat)})",
                   **{arm: getattr(independent, arm) for arm in flat})


def _independent_rate(label: str, y: np.ndarray, is_candidate: np.ndarray, alpha: float) -> Comparison:
    """Every completion independent: Wilson per arm, Newcombe and Agresti-Caffo for the difference."""
    arms = {}
    for arm, mask in (("champion", ~is_candidate), ("candidate", is_candidate)):
        k, n = int(y[mask].sum()), int(mask.sum())
        low, high = proportion_confint(k, n, alpha=alpha, method="wilson") if n else (None, None)
        arms[arm] = (k, n, Estimate(k / n if n else None, finite(low), finite(high)))
    (k1, n1, _), (k0, n0, _) = arms["candidate"], arms["champion"]
    difference, p_value = Estimate(None), None
    if n1 and n0:
        # Newcomb's interval and the Agresti-Caffo test stay defined at 0% and 100% (the score interval
        # fails there).
        # (statsmodels also computes the ratio and odds ratio on the way, which divide by zero there.)
        with np.errstate(divide="ignore", invalid="ignore"):
            low, high = confint_proportions_2indep(k1, n1, k0, n0, method="newcomb", compare="diff", alpha=alpha)
            p_value = finite(test_proportions_2indep(k1, n1, k0, n0, value=0, method="agresti-caffo",
                                                      compare="diff").pvalue)
        difference = Estimate(k1 / n1 - k0 / n0, finite(low), finite(high))
    champion, candidate = arms["champion"][2], arms["candidate"][2]
    return Comparison(label, "%", champion, candidate, difference, _relative(champion.value, candidate.value),
                      p_value, n0, n1, "Wilson; Newcombe")


def _pooled_median(latency_s: np.ndarray, groups: np.ndarray) -> tuple[Callable[..., np.ndarray], int]:
    """A vectorized statistic for scipy.stats.bootstrap over one arm's clusters, and their count: given
    cluster indices drawn with replacement (..., k), the median of the pooled completions of the drawn
    clusters (a cluster drawn twice counts twice), as np.median of the repeated completions."""
    order = np.argsort(latency_s, kind="stable")
    sorted_s = latency_s[order]
    _, owner = np.unique(groups[order], return_inverse=True)
    num = int(owner.max()) + 1

    def statistic(drawn: np.ndarray, axis: int = -1) -> np.ndarray:
        drawn = np.moveaxis(drawn, axis, -1)
        shape, drawn = drawn.shape[:-1], drawn.reshape(-1, drawn.shape[-1])
        rows = len(drawn)
        counts = np.bincount((drawn + num * np.arange(rows)[:, None]).ravel(),
                             minlength=rows * num).reshape(rows, num)
        cum = np.cumsum(counts[:, owner], axis=1)  # the completions' weights, in latency order
        n = cum[:, -1:]
        low = (cum < (n + 1) // 2).sum(axis=1)  # 0-based index of the ((n + 1) // 2)-th smallest
        high = (cum < n // 2 + 1).sum(axis=1)
        return ((sorted_s[low] + sorted_s[high]) / 2).reshape(shape)

    return statistic, num


def _cluster_bootstrap_p50(latency_s: np.ndarray, is_candidate: np.ndarray, groups: np.ndarray,
                           config: ABConfig) -> Comparison:
    arms, medians, clusters = {}, {}, {}
    for arm, mask in (("champion", ~is_candidate), ("candidate", is_candidate)):
        x = latency_s[mask]
        arms[arm] = Estimate(float(np.median(x)) if len(x) else None)
        if len(x):
            medians[arm], clusters[arm] = _pooled_median(x, groups[mask])
    # One batch of resamples holds (batch, completions) weights: bound it to ~32 MB.
    batch = max(1, 4_000_000 // max(len(latency_s), 1))

    def boot(statistic: Callable[..., np.ndarray], *counts: int) -> Any:
        """Percentile interval of `statistic` over the arms' clusters (0..count-1) drawn with replacement."""
        return stats.bootstrap(tuple(np.arange(c) for c in counts), statistic,
                               n_resamples=config.bootstrap_resamples, confidence_level=config.confidence,
                               method="percentile", vectorized=True, batch=batch,
                               rng=np.random.default_rng(config.seed)).confidence_interval

    for arm in medians:
        if clusters[arm] >= 2:
            ci = boot(medians[arm], clusters[arm])
            arms[arm] = Estimate(arms[arm].value, finite(ci.low), finite(ci.high))
    difference = Estimate(None)
    if len(clusters) == 2 and min(clusters.values()) >= 2:
        m1, m0 = medians["candidate"], medians["champion"]
        ci = boot(lambda a, b, axis: m1(a, axis) - m0(b, axis), clusters["candidate"], clusters["champion"])
        difference = Estimate(arms["candidate"].value - arms["champion"].value,
                              finite(ci.low), finite(ci.high))
    return Comparison("latency p50 (s)", "s", arms["champion"], arms["candidate"], difference,
                      _relative(arms["champion"].value, arms["candidate"].value), None,
                      int((~is_candidate).sum()), int(is_candidate.sum()), "cluster bootstrap (users)")


def latency(latency_s: np.ndarray, is_candidate: np.ndarray, groups: np.ndarray,
             config: ABConfig) -> tuple[Comparison, Comparison]:
    level = config.confidence
    if config.cluster == "users":
        return (_cluster_bootstrap_p50(latency_s, is_candidate, groups, config),
                _clustered_means("latency mean (s)", "s", latency_s, is_candidate, groups, 1 - level))
    p50, mean = {}, {}
    for arm, x in (("champion", latency_s[~is_candidate]), ("candidate", latency_s[is_candidate])):
        if len(x) >= 2:
            ci = stats.quantile_test(x, q=float(np.median(x)), p=0.5).confidence_interval(level)
            p50[arm] = Estimate(float(np.median(x)), finite(ci.low), finite(ci.high))
            ci = stats.ttest_1samp(x, 0.0).confidence_interval(level)
            mean[arm] = Estimate(float(np.mean(x)), finite(ci.low), finite(ci.high))
        else:
            p50[arm] = mean[arm] = Estimate(float(x[0]) if len(x) else None)
    x1, x0 = latency_s[is_candidate], latency_s[~is_candidate]
    p50_diff, mean_diff, mean_p = Estimate(None), Estimate(None), None
    if len(x1) >= 2 and len(x0) >= 2:
        boot = stats.bootstrap((x1, x0), lambda a, b, axis: np.median(a, axis=axis) - np.median(b, axis=axis),
                               n_resamples=config.bootstrap_resamples, confidence_level=level, method="percentile",
                               vectorized=True, batch=200, rng=np.random.default_rng(config.seed))
        p50_diff = Estimate(float(np.median(x1) - np.median(x0)), finite(boot.confidence_interval.low),
                            finite(boot.confidence_interval.high))
        welch = stats.ttest_ind(x1, x0, equal_var=False)
        ci = welch.confidence_interval(level)
        mean_diff = Estimate(float(np.mean(x1) - np.mean(x0)), finite(ci.low), finite(ci.high))
        mean_p = finite(welch.pvalue)
    n0, n1 = len(x0), len(x1)
    return (Comparison("latency p50 (s)", "s", p50["champion"], p50["candidate"], p50_diff,
                       _relative(p50["champion"].value, p50["candidate"].value), None, n0, n1,
                       "order statistic; bootstrap"),
            Comparison("latency mean (s)", "s", mean["champion"], mean["candidate"], mean_diff,
                       _relative(mean["champion"].value, mean["candidate"].value), mean_p, n0, n1,
                       "Student t; Welch t"))
