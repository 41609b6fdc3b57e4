"""Replay: what a reward version would have paid over stored traffic, before any training uses it.

    report = replay(store, load_config(RewardRules, "configs/rewards/default.toml"), since=t0, until=t1)
    report.mean_reward, report.by_kind["malformed"].mean, report.censored_fraction, report.to_dict()

Every completion created in [since, until) is settled with rules.settle as of `now`, against all its
events stored by now (a replay sees events the ledger may have counted late; the ledger's own
settlements are untouched: replay writes nothing). Means and totals are over trainable settlements;
pending and untrainable ones are counted apart.

`read_traffic` is the one read of a window (completions, their events, session ends) that replay and
the monitors share.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from realtime_rl.collect import CompletionRecord, EventStore, FeedbackEvent
from realtime_rl.config.rewards import RewardRules
from realtime_rl.rewards.rules import items_from_completion, settle


@dataclass
class Traffic:
    """Completions of a window with the events about them."""

    completions: list[CompletionRecord]
    events: dict[tuple[str, int], list[FeedbackEvent]]
    """By (completion id, choice index); an event without a choice index is about choice 0."""
    session_ends: dict[str, list[float]]
    """Every session_end's recorded_at, per session (rules.settle takes the first after a completion)."""

    def events_for(self, completion_id: str, choice_index: int = 0) -> list[FeedbackEvent]:
        return self.events.get((completion_id, choice_index), [])


def read_traffic(store: EventStore, since: float | None = None, until: float | None = None,
                 page_size: int = 1000) -> Traffic:
    """Completions created in [since, until), with every stored event about them recorded since `since`
    (an event cannot be recorded before the request it is about arrived)."""
    completions: list[CompletionRecord] = []
    seq = 0
    while page := store.list_completions(since=since, until=until, after_seq=seq, limit=page_size):
        completions += page
        seq = page[-1].seq
    wanted = {c.completion_id for c in completions}
    events: dict[tuple[str, int], list[FeedbackEvent]] = defaultdict(list)
    session_ends: dict[str, list[float]] = defaultdict(list)
    seq = 0
    while page := store.list_events(since=since, after_seq=seq, limit=page_size):
        for e in page:
            if e.type == "session_end":
                session_ends[e.session_id].append(e.recorded_at)
            if e.completion_id in wanted:
                events[(e.completion_id, e.choice_index or 0)].append(e)
        seq = page[-1].seq
    return Traffic(completions, dict(events), dict(session_ends))


@dataclass
class Summary:
    count: int = 0
    total: float = 0.0

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def add(self, reward: float) -> None:
        self.count += 1
        self.total += reward


@dataclass
class ReplayReport:
    rules_version: str
    rules_digest: str
    now: float
    """Settlements are as of this time."""
    completions: int = 0
    items: int = 0
    """Completion choices: each is one reward."""
    pending: int = 0
    """Still open at `now`: not paid yet."""
    settled: int = 0
    censored: int = 0
    untrainable: int = 0
    """Censored under censored_policy "exclude": settled, not trained on, not in the means."""
    late_events: int = 0
    """Events recorded after their choice closed (not paid)."""
    overall: Summary = field(default_factory=Summary)
    by_kind: dict[str, Summary] = field(default_factory=dict)
    by_model_version: dict[int, Summary] = field(default_factory=dict)
    by_difficulty: dict[str, Summary] = field(default_factory=dict)
    """Difficulty from the request metadata; "unknown" when absent."""

    @property
    def mean_reward(self) -> float | None:
        return self.overall.mean

    @property
    def total_reward(self) -> float:
        return self.overall.total

    @property
    def censored_fraction(self) -> float | None:
        return self.censored / self.settled if self.settled else None

    def to_dict(self) -> dict[str, Any]:
        def summaries(d: dict[Any, Summary]) -> dict[str, dict[str, Any]]:
            return {str(k): {"count": s.count, "total": s.total, "mean": s.mean} for k, s in sorted(d.items())}

        scalars = {k: v for k, v in asdict(self).items() if not isinstance(v, dict)}  # the summaries follow
        return {**scalars, "mean_reward": self.mean_reward, "total_reward": self.total_reward,
                "censored_fraction": self.censored_fraction, "by_kind": summaries(self.by_kind),
                "by_model_version": summaries(self.by_model_version), "by_difficulty": summaries(self.by_difficulty)}


def replay(store: EventStore, rules: RewardRules, since: float | None = None, until: float | None = None,
           now: float | None = None) -> ReplayReport:
    # The store's horizon, not the wall clock: an event stamped before it is committed by then, so replay sees
    # at least what the ledger counted (the wall clock missed events still committing, on the store's clock).
    now = store.event_horizon() if now is None else now
    traffic = read_traffic(store, since, until)
    report = ReplayReport(rules.version, rules.digest(), now, completions=len(traffic.completions))
    for record in traffic.completions:
        for item in items_from_completion(record):
            report.items += 1
            s = settle(item, traffic.events_for(item.completion_id, item.choice_index), rules, now,
                       traffic.session_ends.get(item.session_id, ()) if item.session_id is not None else ())
            if s is None:
                report.pending += 1
                continue
            report.settled += 1
            report.censored += s.status == "censored"
            report.late_events += len(s.late_event_ids)
            if not s.trainable:
                report.untrainable += 1
                continue
            report.overall.add(s.reward)
            report.by_kind.setdefault(item.kind, Summary()).add(s.reward)
            report.by_model_version.setdefault(item.model_version, Summary()).add(s.reward)
            report.by_difficulty.setdefault(item.difficulty or "unknown", Summary()).add(s.reward)
    return report
