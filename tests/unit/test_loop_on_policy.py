"""What the real-time loop may train on: only choices whose every token an allowed version generated."""

from __future__ import annotations

from realtime_rl.collect import ChoiceRecord, CompletionRecord
from realtime_rl.loop.training_data import on_policy_rewards
from realtime_rl.rewards import SettledReward


def completion(cid: str, versions: list[int], request_json: str = "{}") -> CompletionRecord:
    n = len(versions)
    choice = ChoiceRecord(index=0, token_ids=[1] * n, logprobs=[-0.1] * n, raw_logprobs=[-0.1] * n,
                          versions=versions, finish_reason="stop", text="ok", content="ok")
    return CompletionRecord(completion_id=cid, created_at=0.0, model_name="m", model_version=min(versions),
                            prompt_token_ids=[0], choices=[choice], request_json=request_json)


def settled(cid: str, model_version: int, seq: int) -> SettledReward:
    return SettledReward(completion_id=cid, choice_index=0, created_at=0.0, model_version=model_version,
                         kind="edit", malformed_calls=0, response_tokens=3, user="u", session_id=None,
                         difficulty=None, task_id=None, status="final", reward=1.0, components=[], trainable=True,
                         closed_at=0.0, rules_version="r", rules_digest="d", settled_at=0.0, settle_seq=seq)


def test_a_reply_that_spans_a_rollback_does_not_train_the_restored_version():
    # v1 was live, rolled back to v0: a reply in flight got v1's tokens then v0's, and is recorded as v0.
    records = {"plain": completion("plain", [0, 0, 0]), "spanning": completion("spanning", [1, 1, 0]),
               "old": completion("old", [1, 1, 1]), "gone": None}
    items = [settled("plain", 0, 1), settled("spanning", 0, 2), settled("old", 1, 3), settled("gone", 0, 4)]
    assert [s.completion_id for s in on_policy_rewards(items, records, allowed=[0])] == ["plain"]
    # Under a staleness bound that admits both versions, both replies train.
    assert [s.completion_id for s in on_policy_rewards(items, records, allowed=[1, 0])] == ["plain", "spanning", "old"]


def test_greedy_and_nucleus_replies_do_not_train_and_sampled_ones_carry_their_temperature():
    from realtime_rl.train.traffic import traffic_segment

    records = {"greedy": completion("greedy", [0, 0], '{"temperature": 0.0}'),
               "warm": completion("warm", [0, 0], '{"temperature": 0.7}'), "default": completion("default", [0, 0]),
               "nucleus": completion("nucleus", [0, 0], '{"top_p": 0.9}'),
               "whole": completion("whole", [0, 0], '{"top_p": 1.0, "temperature": null}')}
    items = [settled(cid, 0, seq) for seq, cid in enumerate(records)]
    assert [s.completion_id for s in on_policy_rewards(items, records, allowed=[0])] == ["warm", "default", "whole"]
    assert traffic_segment(records["warm"]).temperature == 0.7  # the trainer recomputes at it
    assert traffic_segment(records["default"]).temperature == 1.0  # the gateway's default
    # A nucleus's logprobs are of a truncation whose tail was never sampled: recorded, so the trainer refuses it.
    assert traffic_segment(records["nucleus"]).top_p == 0.9 and traffic_segment(records["whole"]).top_p == 1.0
