"""A/B analysis of live traffic: champion vs candidate arm, in the metrics Cursor reports for Composer.

    records = ab_records(store.list_completions(since=t0), store.list_events(since=t0),
                         rules.persist_window_s, rules.horizon_s)
    report = analyze(records, ABConfig(candidate_fraction=0.5))
    report.decision          # "promote" | "rollback" | "continue"
    report.reasons, report.to_dict(), Console().print(report.table())

One `ABRecord` per completion: its arm, its user (else session: the unit the router assigns arms by),
whether the user made an edit from it, whether the edit was kept or reverted, whether a dissatisfied
follow-up came, and its latency. From feedback events (joined by completion id; session-only events
are not attributed to a completion and are ignored here):

- an edit was made: edit_accepted, edit_persisted or edit_reverted (unless a rejection decided first);
- kept or reverted, as the reward rules decide it: by the first deciding event on the store's clock within
  the horizon, an edit_reverted, an edit_rejected, or an edit_persisted whose window_s and the store's
  clock both reach persist_window_s; a contrary event after it changes nothing (see `ab_records`);
- edits kept % = kept / (kept + reverted): edits not decided yet are pending, and so are those never
  decided by the horizon (censored); both are left out of numerator and denominator alike (counted in
  the report). So is a revert of a completion younger than persist_window_s at `as_of` (when the events
  were read): a keep could not have been seen yet, and counting its reverts alone would bias the rate
  down by however much traffic came in the last window; so the rate does not depend on when the analysis
  runs;
- dissatisfied follow-ups % = completions with followup_dissatisfied / completions;
- latency: p50 and mean of the completion's latency_s.

Intervals (level `confidence`). The router assigns arms per user, and one user's completions are
correlated (a user who dislikes a style reverts many of its edits), so by default (`cluster="users"`) the
unit of inference is the unit of randomisation, ABRecord.unit (the user, else the session; a completion
with neither is a cluster of its own). The difference (candidate -
champion) of edits kept, dissatisfied follow-ups and mean latency, with its p-value, comes from OLS of
the outcome on [1, is_candidate] with cluster-robust standard errors (statsmodels cov_type="cluster":
CR1, t with G - 1 degrees of freedom; the delta-method analysis of user-randomised experiments); each
arm's rate or mean from OLS on a constant in that arm, clustered the same way (rates clipped to [0, 1]).
p50 latency per arm and its difference: a cluster bootstrap (users resampled with replacement within
each arm, every completion of a drawn user counted; scipy bootstrap, percentile, seeded). An arm with
fewer than two users has no cluster variance: no interval (None). A rate equal in every completion of an
arm (zero variance, e.g. every edit kept) gives the cluster fit nothing to estimate for that arm: its
interval would be the point, and 52 of 52 edits kept is not a rate of 1 for sure. Such an arm gets
Wilson's interval, and the difference the hull of the cluster-robust interval and Newcombe's (Newcombe's
alone when neither arm varies), and the method says so. A mean equal in every completion of an arm has
no interval there (nor has the difference when both are): a zero-width interval would decide.
Cluster-robust intervals are too narrow with few users (the sandwich is only asymptotic in the number
of clusters); `min_users_per_arm` is a floor, not a guarantee: read intervals from fewer than a few
dozen users per arm as optimistic.

With `cluster="none"` every completion counts as independent (too narrow when users differ: an A/A test
then finds differences): rates per arm by Wilson's score interval, their difference by Newcombe's hybrid
score interval and the Agresti-Caffo test (statsmodels confint_proportions_2indep /
test_proportions_2indep); p50 per arm by the distribution-free order-statistic interval (scipy
quantile_test), its difference by a percentile bootstrap of completions (seeded); the mean per arm by
Student's t, its difference by Welch's t. Each metric names its method (Comparison.method).
"relative" is (candidate - champion) / champion, as in Cursor's "+2.28% edits kept".

Sample-ratio mismatch: chi-square goodness of fit of users (or completions) per arm against
`candidate_fraction` (scipy chisquare); p < srm_alpha means the assignment or the logging is broken and
no metric can be trusted.

Decision, in order: SRM -> "rollback"; either arm below the minimum users, completions or resolved
edits -> "continue" (insufficient data); a guardrail significantly worse beyond its tolerance
(dissatisfied rate, p50 latency: the lower end of the difference's interval above the tolerance) ->
"rollback"; edits kept significantly worse beyond the margin (upper end below -primary_margin) ->
"rollback"; edits kept winning (lower end above -primary_margin; margin 0 by default, so a win) ->
"promote"; else "continue". A metric without an interval decides nothing.

Not here: sequential-testing corrections. Looking at a running experiment every cycle and stopping at
the first significant result inflates the false-positive rate; keep the number of looks small or widen
`confidence`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
from rich.table import Table
from rich.text import Text
from scipy import stats

from realtime_rl.collect import CompletionRecord, FeedbackEvent
from realtime_rl.config.loop import ABConfig
from realtime_rl.evaluate.ab_metrics import Comparison, Estimate, latency, rate
from realtime_rl.rewards.rules import decides

ARMS = ("champion", "candidate")
EDIT_EVENTS = {"edit_accepted", "edit_persisted", "edit_reverted"}
Decision = Literal["promote", "rollback", "continue"]


@dataclass(frozen=True)
class ABRecord:
    """One completion as the A/B analysis sees it."""

    completion_id: str
    arm: str
    """"champion" or "candidate"."""
    unit: str | None
    """The request's user, else its session id: what the router assigns arms by (None: neither was sent)."""
    edited: bool
    kept: bool
    reverted: bool
    dissatisfied: bool
    latency_s: float
    delivered: bool = True
    """False: the gateway marked it `undelivered` (the answer never reached the user). It has no outcome, so
    only its latency counts: a slow arm whose users leave must not look faster for the replies they left."""


def ab_records(completions: Iterable[CompletionRecord], events: Iterable[FeedbackEvent],
               persist_window_s: float = 0.0, horizon_s: float = math.inf,
               as_of: float | None = None) -> list[ABRecord]:
    """One record per completion, with the stored feedback events that name it (by completion id).

    An edit's outcome is decided as the reward rules decide it (rewards.rules), on the store's clock: by
    the first deciding event in recorded order (recorded_at, then seq) recorded within `horizon_s` of the
    completion's created_at: an edit_reverted, an edit_rejected, or an edit_persisted whose window_s and
    the store's clock (recorded_at - created_at) both reach `persist_window_s`. Kept: that first
    decision is an edit_persisted; reverted: an edit_reverted; a rejection means no edit was made; a
    contrary event after the decision changes nothing (an edit persisted past its window, then reverted,
    is kept, as the rewards pay it). An edit without a decision is pending: not decided yet, or censored at
    the horizon. Pass the rules' persist_window_s and horizon_s so that the two agree on what "kept" means.
    `as_of`, the time the events were read (the store's `event_horizon()` before reading them): an edit
    reverted before its completion was persist_window_s old at `as_of` is pending too, since its keep, had it
    been kept, could not have been recorded yet (None: every completion is taken as old enough).

    Where they still differ: the rules decide per choice and only for an item that awaits an edit (an edit
    reply, or one accepted within the follow-up window); here any completion with an edit event counts,
    and a dissatisfied follow-up counts whenever it was recorded (the rules pay it only before the close).

    A completion with an `undelivered` event counts for latency only (`delivered` False): its answer never
    reached the user, so it has no outcome (the rules settle it untrainable). One with neither user nor session is
    left out: the router sends such requests to the champion without a draw (serve/arms.py), so they are no part
    of the randomised comparison and would shift the champion's rates (scripted API clients, say)."""
    by_completion: dict[str, list[FeedbackEvent]] = defaultdict(list)
    for event in events:
        if event.completion_id is not None:
            assert event.recorded_at is not None, "ab_records needs stored events (recorded_at set)"
            by_completion[event.completion_id].append(event)
    records = []
    for c in completions:
        seen = sorted(by_completion.get(c.completion_id, []), key=lambda e: (e.recorded_at, e.seq or 0))
        decision = next((e.type for e in seen if _decides(e, c.created_at, persist_window_s, horizon_s)), None)
        if decision == "edit_reverted" and as_of is not None and as_of - c.created_at < persist_window_s:
            decision = None  # only a revert can have decided it by now: it waits, as a keep would
        types = {e.type for e in seen}
        if not (c.user or c.session_id):
            continue
        delivered = "undelivered" not in types
        records.append(ABRecord(
            completion_id=c.completion_id, arm=c.arm, unit=c.user or c.session_id,
            edited=delivered and bool(types & EDIT_EVENTS) and decision != "edit_rejected",
            kept=delivered and decision == "edit_persisted", reverted=delivered and decision == "edit_reverted",
            dissatisfied=delivered and "followup_dissatisfied" in types, latency_s=c.latency_s, delivered=delivered))
    return records


def _decides(event: FeedbackEvent, created_at: float, persist_window_s: float, horizon_s: float) -> bool:
    """Whether a stored event decides the edit's outcome of the completion created at `created_at`: the reward
    rules' own test (rules.decides), within their horizon."""
    return event.recorded_at <= created_at + horizon_s and decides(event, persist_window_s, created_at)


@dataclass
class ABReport:
    decision: Decision
    reasons: list[str]
    metrics: dict[str, Comparison]
    """edits_kept, dissatisfied, latency_p50_s, latency_mean_s."""
    arms: dict[str, dict[str, int]]
    """Per arm: completions, units, edits, resolved_edits, pending_edits, kept, reverted, dissatisfied."""
    srm: dict[str, Any]
    confidence: float
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"decision": self.decision, "reasons": list(self.reasons), "confidence": self.confidence,
                "metrics": {k: asdict(v) for k, v in self.metrics.items()}, "arms": self.arms, "srm": self.srm,
                "config": self.config}

    def table(self) -> Table:
        """A rich Table in Cursor's terms: edits kept %, dissatisfied follow-ups %, latency p50 and mean (s)."""
        level = f"{self.confidence:.0%}"
        # Text, not markup strings: "[56.7, 63.0]" must print as written.
        table = Table(title=f"A/B: {self.decision}", caption=Text("; ".join(self.reasons)))
        for column in ("metric", "champion", "candidate", f"difference [{level} CI]", "relative", "method"):
            table.add_column(Text(column), justify="left" if column in ("metric", "method") else "right")
        for m in self.metrics.values():
            scale, digits = (100.0, 1) if m.unit == "%" else (1.0, 3)
            cells = (m.label, _cell(m.champion, scale, digits, m.n_champion),
                     _cell(m.candidate, scale, digits, m.n_candidate), _cell(m.difference, scale, digits, sign=True),
                     "-" if m.relative is None else f"{100 * m.relative:+.2f}%", m.method)
            table.add_row(*map(Text, cells))
        return table


def _cell(e: Estimate, scale: float, digits: int, n: int | None = None, sign: bool = False) -> str:
    return e.text(scale, digits, sign) + (f" (n={n})" if n is not None and e.value is not None else "")


def _srm(records: Sequence[ABRecord], config: ABConfig) -> dict[str, Any]:
    if config.srm_unit == "users":
        units = {arm: {r.unit for r in records if r.arm == arm and r.unit is not None} for arm in ARMS}
        observed = [len(units[arm]) for arm in ARMS]
        extra = {"units_in_both_arms": len(units["champion"] & units["candidate"]),
                 "completions_without_user": sum(r.unit is None for r in records)}
    else:
        observed = [sum(r.arm == arm for r in records) for arm in ARMS]
        extra = {}
    total = sum(observed)
    expected = [total * (1 - config.candidate_fraction), total * config.candidate_fraction]
    p_value = float(stats.chisquare(observed, expected).pvalue) if total else None
    return {"unit": config.srm_unit, "observed": dict(zip(ARMS, observed)), "expected": dict(zip(ARMS, expected)),
            "candidate_fraction": config.candidate_fraction, "test": "chi-square goodness of fit",
            "p_value": p_value, "alpha": config.srm_alpha,
            "alarm": p_value is not None and p_value < config.srm_alpha} | extra


def analyze(records: Sequence[ABRecord], config: ABConfig) -> ABReport:
    """Per-arm metrics with intervals, the candidate-minus-champion differences, the SRM check and the decision."""
    for r in records:
        if r.arm not in ARMS:
            raise ValueError(f"completion {r.completion_id}: arm {r.arm!r} is neither 'champion' nor 'candidate'")
    by_arm = {arm: [r for r in records if r.arm == arm] for arm in ARMS}
    arms = {}
    for arm, everything in by_arm.items():
        rs = [r for r in everything if r.delivered]
        kept, reverted, edits = sum(r.kept for r in rs), sum(r.reverted for r in rs), sum(r.edited for r in rs)
        arms[arm] = {"completions": len(rs), "units": len({r.unit for r in rs if r.unit is not None}),
                     "edits": edits, "resolved_edits": kept + reverted, "pending_edits": edits - kept - reverted,
                     "kept": kept, "reverted": reverted, "dissatisfied": sum(r.dissatisfied for r in rs),
                     "undelivered": len(everything) - len(rs)}
    # Cluster codes shared by both arms (a unit seen in both stays one cluster); a completion with neither
    # user nor session is a cluster of its own.
    codes: dict[Any, int] = {}
    groups = np.array([codes.setdefault(r.unit if r.unit is not None else (r.completion_id,), len(codes))
                       for r in records], dtype=np.int64)
    is_candidate = np.array([r.arm == "candidate" for r in records], dtype=bool)
    delivered = np.array([r.delivered for r in records], dtype=bool)
    resolved = np.array([r.kept or r.reverted for r in records], dtype=bool)  # delivered ones only
    kept = np.array([r.kept for r in records], dtype=float)
    unhappy = np.array([r.dissatisfied for r in records], dtype=float)
    edits_kept = rate("edits kept %", kept[resolved], is_candidate[resolved], groups[resolved], config)
    dissatisfied = rate("dissatisfied follow-ups %", unhappy[delivered], is_candidate[delivered], groups[delivered],
                        config)
    p50, mean = latency(np.array([r.latency_s for r in records], dtype=float), is_candidate, groups, config)
    metrics = {"edits_kept": edits_kept, "dissatisfied": dissatisfied, "latency_p50_s": p50,
               "latency_mean_s": mean}
    srm = _srm(records, config)

    decision, reasons = _decide(arms, edits_kept, dissatisfied, p50, srm, config)
    return ABReport(decision, reasons, metrics, arms, srm, config.confidence, config.model_dump())


def _decide(arms: dict[str, dict[str, int]], edits_kept: Comparison, dissatisfied: Comparison, p50: Comparison,
            srm: dict[str, Any], config: ABConfig) -> tuple[Decision, list[str]]:
    if srm["alarm"]:
        return "rollback", [f"sample-ratio mismatch: {srm['observed']} {srm['unit']} for a candidate share of "
                            f"{config.candidate_fraction} (chi-square p = {srm['p_value']:.2g} "
                            f"< {config.srm_alpha})"]
    short = [f"{arm} has {arms[arm][key]} {name} < {minimum}" for arm in ARMS
             for key, name, minimum in (("units", "users", config.min_users_per_arm),
                                        ("completions", "completions", config.min_completions_per_arm),
                                        ("resolved_edits", "resolved edits", config.min_edits_per_arm))
             if arms[arm][key] < minimum]
    if short:
        return "continue", ["insufficient data: " + "; ".join(short)]

    def shown(e: Estimate, scale: float, unit: str) -> str:
        if e.value is None or e.low is None or e.high is None:
            return "no interval"
        digits = 2 if scale == 100 else 3
        return (f"{scale * e.value:+.{digits}f}{unit} ({config.confidence:.0%} CI "
                f"[{scale * e.low:+.{digits}f}, {scale * e.high:+.{digits}f}])")

    regressions = []
    kept, unhappy, slow = edits_kept.difference, dissatisfied.difference, p50.difference
    if unhappy.low is not None and unhappy.low > config.dissatisfied_tolerance:
        regressions.append(f"dissatisfied follow-ups {shown(unhappy, 100, ' points')}, "
                           f"tolerance {100 * config.dissatisfied_tolerance:g} points")
    allowed = config.latency_tolerance_s + config.latency_tolerance_rel * (p50.champion.value or 0.0)
    if slow.low is not None and slow.low > allowed:
        regressions.append(f"latency p50 {shown(slow, 1, ' s')}, tolerance {allowed:.3g} s "
                           f"({config.latency_tolerance_s:g} s + {config.latency_tolerance_rel:.0%} of the champion's)")
    if kept.high is not None and kept.high < -config.primary_margin:
        regressions.append(f"edits kept {shown(kept, 100, ' points')}, "
                           f"margin {100 * config.primary_margin:g} points")
    if regressions:
        return "rollback", ["regression: " + r for r in regressions]
    if kept.low is not None and kept.low > -config.primary_margin:
        what = "win" if config.primary_margin == 0 else \
            f"non-inferior (margin {100 * config.primary_margin:g} points)"
        return "promote", [f"edits kept {what}: {shown(kept, 100, ' points')}; no guardrail regressed"]
    return "continue", [f"edits kept not shown {'better' if config.primary_margin == 0 else 'non-inferior'} yet: "
                        f"{shown(kept, 100, ' points')}; no guardrail regressed"]
