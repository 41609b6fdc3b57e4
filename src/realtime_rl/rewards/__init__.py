"""Rewards from user signals: reward rules, the delayed-reward ledger, replay, and reward-hacking monitors.

    rules = load_config(RewardRules, "configs/rewards/default.toml")      # realtime_rl.config.rewards
    ledger = RewardLedger(run_dir / "rewards.sqlite")
    ledger.update(store, rules)                     # settle what closed; late and early events handled
    ledger.settled(after_seq=cursor)                # settled rewards for the trainer
    replay(store, rules, since, until)              # what these rules would have paid, writing nothing
    compare(champion, candidate).blocking           # hacking monitors (edit, question, malformed rates, ...)

actions.py classifies a completion choice (edit, question, malformed, other); rules.py turns a choice
and its events into a settlement; ledger.py settles each reward once; replay.py recomputes over stored
traffic; monitors.py compares a candidate's behaviour with the champion's.
"""

from realtime_rl.rewards.actions import ACTIONS, EDIT_TOOLS, QUESTION_TOOL, Action, classify, classify_reply
from realtime_rl.rewards.ledger import LedgerStats, LedgerUpdate, RewardLedger, SettledReward
from realtime_rl.rewards.monitors import (
    Interaction, MonitorReport, MonitorResult, compare, interaction_from_episode, interactions_from_completion,
    traffic_interactions,
)
from realtime_rl.rewards.replay import ReplayReport, Summary, Traffic, read_traffic, replay
from realtime_rl.rewards.rules import Component, Item, Settlement, items_from_completion, request_metadata, settle

__all__ = [
    "ACTIONS", "EDIT_TOOLS", "QUESTION_TOOL", "Action", "Component", "Interaction", "Item", "LedgerStats",
    "LedgerUpdate", "MonitorReport", "MonitorResult", "ReplayReport", "RewardLedger", "Settlement", "SettledReward",
    "Summary", "Traffic", "classify", "classify_reply", "compare", "interaction_from_episode",
    "interactions_from_completion", "items_from_completion", "read_traffic", "replay", "request_metadata", "settle",
    "traffic_interactions",
]
