"""The demo's closing comparison of served traffic: per-version counts and the live version against the base."""

from __future__ import annotations

import random

from realtime_rl.collect import ChoiceRecord, CompletionRecord, FeedbackEvent, open_event_store
from realtime_rl.demo import traffic_by_version, traffic_progress


def completion(cid: str, user: str, version: int, at: float) -> CompletionRecord:
    choice = ChoiceRecord(index=0, token_ids=[1, 2], logprobs=[-0.1, -0.2], raw_logprobs=[-0.1, -0.2],
                          versions=[version] * 2, finish_reason="stop", text="ok", content="ok")
    return CompletionRecord(completion_id=cid, created_at=at, model_name="m", model_version=version,
                            prompt_token_ids=[0], choices=[choice], request_json="{}", user=user, latency_s=0.5)


def test_the_live_version_is_compared_with_the_base_on_what_each_served(tmp_path):
    rng = random.Random(0)
    events = []
    with open_event_store(tmp_path, "sqlite") as store:
        for i in range(400):  # v0 served first (keeps 30%), then v1 (pending, not counted), then v2 (keeps 60%)
            version = 0 if i < 200 else 1 if i < 220 else 2
            cid = f"c{i}"
            store.add_completion(completion(cid, f"user{i % 12}", version, 1000.0 + i))
            kept = rng.random() < (0.3 if version == 0 else 0.6)
            events.append(FeedbackEvent(event_id=f"a{i}", type="edit_accepted", completion_id=cid))
            if version != 1:
                events.append(FeedbackEvent(event_id=f"e{i}", completion_id=cid, **(
                    {"type": "edit_persisted", "window_s": 15.0} if kept else {"type": "edit_reverted"})))
        store.add_events(events)

    counts = traffic_by_version(tmp_path, 0.0, 2000.0)
    assert {v: c["completions"] for v, c in counts.items()} == {0: 200, 1: 20, 2: 180}
    assert counts[1]["kept"] == counts[1]["reverted"] == 0  # accepted, window still open: not resolved
    assert traffic_by_version(tmp_path, 1000.0, 1200.0).keys() == {0}

    report = traffic_progress(tmp_path, base=0, live=2, since=0.0, until=2000.0)
    kept = report.metrics["edits_kept"]
    assert report.arms["champion"]["completions"] == 200 and report.arms["candidate"]["completions"] == 180
    assert kept.method == "cluster-robust (users)"
    assert 0.2 < kept.champion.value < 0.4 and 0.5 < kept.candidate.value < 0.7
    assert kept.difference.low > 0 and kept.p_value < 0.01  # 12 users, a 30-point rise: shown
