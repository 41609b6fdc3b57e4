"""How RewardRules turn one completion choice and its feedback events into a settled reward.

    item = items_from_completion(record)[0]
    settlement = settle(item, events, rules, now)     # None while the reward is still pending

One pure function, shared by the ledger (which settles each reward once, as events arrive) and by
replay (which recomputes over stored traffic), so both pay by the same rule:

* Windows are measured on the store's clock: an event's `recorded_at` against the completion's
  `created_at`. The client's `occurred_at` is not trusted for money.
* An item awaits an edit outcome if it is an edit (actions.classify) or the user accepted an edit of
  it within the follow-up window. The outcome is decided by the first edit_reverted, edit_rejected or
  edit_persisted recorded before the horizon; an edit_persisted decides only when its window_s and the
  store's own clock (recorded_at - created_at) both reach persist_window_s: a client cannot settle an
  edit as kept early by claiming a long window.
* The item closes at: max(decision, follow-up window end) when decided; the follow-up window's end
  (created_at + followup_window_s, or the end of its session if earlier: the first session_end recorded
  at or after created_at, so a conversation reopened after an end is not closed by it) when no edit is
  awaited;
  created_at + horizon_s otherwise, and then it is censored. It settles at the first `now` >= close.
* Paid: the action's own reward, the malformed-call penalty per malformed call, and every event
  recorded at or before the close: follow-ups and tool_call_error each time; edit events at most once
  per type, and once decided, a contrary decision event pays nothing; custom events weight x value.
  Events recorded after the close are late: listed, never paid.
* Censored: under "credit", an accepted edit that nobody confirmed nor undid is paid
  censored_credit x weights.edit_persisted more (the rest of what was known is paid as usual); under
  "exclude", the settlement is kept for the record but marked untrainable.
* The sum is clipped to [clip_min, clip_max]; a "clip" component shows by how much.
* Undelivered: an `undelivered` event recorded by the close (the gateway's, when the client went away after
  the completion was recorded, or the client's own) pays nothing and makes the settlement untrainable: a reply
  nobody saw drew no feedback, so its reward says nothing about it.

Session-level events (no completion id) pay nothing: a reward belongs to a completion. A session_end
closes the follow-up windows of its session's completions.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Literal

from realtime_rl.collect import CompletionRecord, FeedbackEvent
from realtime_rl.config.rewards import RewardRules
from realtime_rl.rewards.actions import Action, classify

Status = Literal["final", "censored"]
DECISIONS = ("edit_reverted", "edit_rejected", "edit_persisted")


@dataclass(frozen=True)
class Item:
    """One completion choice: what its reward depends on besides the events."""

    completion_id: str
    choice_index: int
    created_at: float
    model_version: int
    kind: Action
    malformed_calls: int
    response_tokens: int
    user: str | None = None
    session_id: str | None = None
    difficulty: str | None = None
    """From the request's metadata (simulated users send task_id, difficulty and session_id there)."""
    task_id: str | None = None


@dataclass
class Component:
    """One part of a reward: what paid, how much, and why."""

    source: str
    """"action:<kind>", "malformed_calls", "event:<type>", "custom:<name>", "censored_credit" or "clip"."""
    amount: float
    event_id: str | None = None
    note: str = ""


@dataclass
class Settlement:
    status: Status
    reward: float
    """The clipped sum of the components."""
    components: list[Component]
    trainable: bool
    """False for censored rewards under censored_policy "exclude", and for undelivered completions."""
    closed_at: float
    """Events recorded after this are late."""
    late_event_ids: list[str] = field(default_factory=list)
    """Events given to `settle` that were recorded after closed_at (not paid)."""

    def components_json(self) -> str:
        return json.dumps([asdict(c) for c in self.components])


def request_metadata(record: CompletionRecord) -> dict[str, str]:
    """The request's `metadata` object ({} when absent). Stored requests are JSON the gateway validated;
    a record that is not (hand-written, corrupted) is treated as having no metadata rather than stopping
    the ledger for everyone."""
    try:
        request = json.loads(record.request_json)
    except ValueError:
        return {}
    metadata = request.get("metadata") if isinstance(request, dict) else None
    return {str(k): str(v) for k, v in metadata.items()} if isinstance(metadata, dict) else {}


def items_from_completion(record: CompletionRecord) -> list[Item]:
    """One Item per choice of the record."""
    metadata = request_metadata(record)
    return [Item(completion_id=record.completion_id, choice_index=c.index, created_at=record.created_at,
                 model_version=record.model_version, kind=classify(c), malformed_calls=c.malformed_tool_calls,
                 response_tokens=len(c.token_ids), user=record.user, session_id=record.session_id,
                 difficulty=metadata.get("difficulty"), task_id=metadata.get("task_id"))
            for c in record.choices]


def decides(event: FeedbackEvent, persist_window_s: float, created_at: float) -> bool:
    """Whether the stored event settles the outcome of an edit in a completion created at `created_at`
    (the A/B's kept and reverted use it too: evaluate/ab.py)."""
    if event.type == "edit_persisted":
        return (event.window_s is not None and event.window_s >= persist_window_s
                and event.recorded_at is not None and event.recorded_at - created_at >= persist_window_s)
    return event.type in ("edit_reverted", "edit_rejected")


def _not_deciding(event: FeedbackEvent, rules: RewardRules, created_at: float) -> str:
    if event.window_s is None or event.window_s < rules.persist_window_s:
        return f"window {event.window_s or 0:g} s < persist_window_s {rules.persist_window_s:g} s"
    return (f"recorded {event.recorded_at - created_at:g} s after the completion < persist_window_s "
            f"{rules.persist_window_s:g} s")


def settle(item: Item, events: list[FeedbackEvent], rules: RewardRules, now: float,
           session_ends: Iterable[float] = ()) -> Settlement | None:
    """The item's settlement at `now`, or None while it is pending. `events` are the stored events about
    this choice (each with its recorded_at), in any order; `session_ends`, the recorded_at of each session_end
    of the item's session."""
    assert all(e.recorded_at is not None for e in events), "settle needs stored events (recorded_at set)"
    events = sorted(events, key=lambda e: (e.recorded_at, e.seq or 0))
    horizon_at = item.created_at + rules.horizon_s
    followups_at = item.created_at + rules.followup_window_s
    session_ended_at = min((t for t in session_ends if t >= item.created_at), default=None)
    if session_ended_at is not None:
        followups_at = min(followups_at, session_ended_at)
    awaits_edit = item.kind == "edit" or any(e.type == "edit_accepted" and e.recorded_at <= followups_at
                                             for e in events)
    decided_at = next((e.recorded_at for e in events
                       if e.recorded_at <= horizon_at and decides(e, rules.persist_window_s, item.created_at)), None)
    if not awaits_edit:
        status: Status = "final"
        closed_at = followups_at
    elif decided_at is not None:
        status, closed_at = "final", max(decided_at, followups_at)
    else:
        status, closed_at = "censored", horizon_at
    if now < closed_at:
        return None

    components = []
    if item.kind != "malformed":
        components.append(Component(f"action:{item.kind}", getattr(rules.actions, item.kind)))
    if item.malformed_calls:
        components.append(Component("malformed_calls", item.malformed_calls * rules.actions.malformed_call,
                                    note=f"{item.malformed_calls} x {rules.actions.malformed_call}"))
    paid_edits: set[str] = set()
    decided = undelivered = False
    for e in (e for e in events if e.recorded_at <= closed_at):
        note = ""
        if e.type == "undelivered":
            undelivered = True
            components.append(Component("event:undelivered", 0.0, e.event_id, "never reached the user: not trained"))
            continue
        if e.type == "custom":
            weight = rules.custom.get(e.name)
            amount = 0.0 if weight is None else weight * e.value
            note = "no weight for this name" if weight is None else f"{weight} x {e.value}"
            components.append(Component(f"custom:{e.name}", amount, e.event_id, note))
            continue
        amount = getattr(rules.weights, e.type)
        if e.type.startswith("edit_"):
            if e.type in paid_edits:
                amount, note = 0.0, "repeated"
            elif e.type == "edit_persisted" and not decides(e, rules.persist_window_s, item.created_at):
                amount, note = 0.0, _not_deciding(e, rules, item.created_at)
            elif e.type in DECISIONS and decided:
                amount, note = 0.0, "after the edit's outcome was decided"
            else:
                paid_edits.add(e.type)
                decided = decided or e.type in DECISIONS
        components.append(Component(f"event:{e.type}", amount, e.event_id, note))
    if not undelivered and any(e.type == "undelivered" for e in events):  # marked after the close: the amount
        undelivered = True  # is closed, but a reply the user never received must not train either way
        components.append(Component("event:undelivered", 0.0, next(e.event_id for e in events if e.type ==
                                                                     "undelivered"), "recorded after the close"))
    if status == "censored" and rules.censored_policy == "credit" and "edit_accepted" in paid_edits:
        components.append(Component("censored_credit", rules.censored_credit * rules.weights.edit_persisted,
                                    note="accepted, neither confirmed nor undone before the horizon"))
    total = sum(c.amount for c in components)
    reward = min(max(total, rules.clip_min), rules.clip_max)
    if reward != total:
        components.append(Component("clip", reward - total, note=f"to [{rules.clip_min:g}, {rules.clip_max:g}]"))
    return Settlement(status=status, reward=reward, components=components,
                      trainable=not (undelivered or (status == "censored" and rules.censored_policy == "exclude")),
                      closed_at=closed_at, late_event_ids=[e.event_id for e in events if e.recorded_at > closed_at])
