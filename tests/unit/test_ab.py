"""The A/B analysis on seeded synthetic traffic: a win is promoted, a guardrail regression and a sample-ratio
mismatch roll back, too little data continues; records are built from a real event store."""

from __future__ import annotations

import json

import numpy as np
import pytest
from rich.console import Console

from realtime_rl.collect import ChoiceRecord, CompletionRecord, FeedbackEvent, SqliteEventStore
from realtime_rl.config.loop import ABConfig
from realtime_rl.evaluate.ab import ABRecord, ab_records, analyze


def traffic(seed: int, users: int = 800, per_user: int = 5, fraction: float = 0.5, kept: tuple = (0.6, 0.6),
            edit: float = 0.5, dissatisfied: tuple = (0.08, 0.08), latency: tuple = (1.0, 1.0),
            champion_users_kept: float = 1.0) -> list[ABRecord]:
    """Users assigned to an arm with probability `fraction`; per arm (champion, candidate) the kept rate of an
    edit, the dissatisfied rate and the median latency (lognormal). champion_users_kept < 1 drops that share of
    the champion's users from the log (a logging bug: the cause of a sample-ratio mismatch)."""
    rng = np.random.default_rng(seed)
    records = []
    for u in range(users):
        arm = int(rng.random() < fraction)
        if arm == 0 and rng.random() > champion_users_kept:
            continue
        for j in range(per_user):
            edited = bool(rng.random() < edit)
            resolved = edited and rng.random() < 0.9  # a tenth of edits still inside their window
            kept_edit = resolved and bool(rng.random() < kept[arm])
            records.append(ABRecord(
                completion_id=f"c{u}-{j}", arm=("champion", "candidate")[arm], unit=f"user-{u}", edited=edited,
                kept=kept_edit, reverted=resolved and not kept_edit,
                dissatisfied=bool(rng.random() < dissatisfied[arm]),
                latency_s=float(latency[arm] * rng.lognormal(0.0, 0.3))))
    return records


def test_a_win_on_edits_kept_is_promoted_and_reported_in_cursors_terms():
    report = analyze(traffic(0, kept=(0.60, 0.70)), ABConfig())
    assert report.decision == "promote", report.reasons
    assert report.reasons[0].startswith("edits kept win: +")
    kept = report.metrics["edits_kept"]
    assert kept.candidate.value > kept.champion.value and kept.difference.low > 0
    assert kept.relative == pytest.approx((kept.candidate.value - kept.champion.value) / kept.champion.value)
    for m in report.metrics.values():  # every interval holds its estimate
        for e in (m.champion, m.candidate, m.difference):
            assert e.low <= e.value <= e.high
    assert report.arms["candidate"]["pending_edits"] > 0  # unresolved edits are counted, not scored
    assert report.srm["alarm"] is False and report.srm["p_value"] > 0.001
    data = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert data["decision"] == "promote" and data["metrics"]["edits_kept"]["difference"]["low"] > 0

    console = Console(record=True, width=160)
    console.print(report.table())
    text = console.export_text()
    for row in ("edits kept %", "dissatisfied follow-ups %", "latency p50 (s)", "difference [95% CI]", "relative"):
        assert row in text
    shown = f"{100 * kept.relative:+.2f}%"
    assert shown in text and f"{100 * kept.champion.value:.1f} [" in text


def test_a_guardrail_regression_rolls_back_even_when_edits_kept_wins():
    report = analyze(traffic(1, kept=(0.60, 0.70), dissatisfied=(0.05, 0.12)), ABConfig())
    assert report.decision == "rollback"
    assert report.reasons == [r for r in report.reasons if r.startswith("regression: dissatisfied follow-ups +")]
    report = analyze(traffic(2, latency=(1.0, 1.3)), ABConfig())
    assert report.decision == "rollback" and report.reasons[0].startswith("regression: latency p50 +0.")
    assert report.metrics["latency_p50_s"].difference.low > 0
    # A tolerance above the regression lets it through (then edits kept decides: no win here).
    report = analyze(traffic(2, latency=(1.0, 1.3)), ABConfig(latency_tolerance_s=0.6))
    assert report.decision == "continue" and "no guardrail regressed" in report.reasons[0]


def test_significantly_fewer_edits_kept_rolls_back():
    report = analyze(traffic(3, kept=(0.70, 0.55)), ABConfig())
    assert report.decision == "rollback" and report.reasons[0].startswith("regression: edits kept -")


def test_sample_ratio_mismatch_rolls_back_whatever_the_metrics_say():
    records = traffic(4, kept=(0.60, 0.75), champion_users_kept=0.7)
    report = analyze(records, ABConfig())
    assert report.decision == "rollback" and report.reasons[0].startswith("sample-ratio mismatch")
    assert report.srm["alarm"] and report.srm["p_value"] < 1e-6
    assert report.srm["observed"]["candidate"] > report.srm["observed"]["champion"]
    # The same traffic is consistent with a 60/40 split the other way round, by completions too.
    assert not analyze(records, ABConfig(candidate_fraction=0.588, srm_unit="completions")).srm["alarm"]


def test_too_little_data_continues_and_no_difference_continues():
    report = analyze(traffic(5, users=10, kept=(0.2, 0.9)), ABConfig())
    assert report.decision == "continue" and report.reasons[0].startswith("insufficient data: champion has")
    report = analyze(traffic(6), ABConfig())
    assert report.decision == "continue" and report.reasons[0].startswith("edits kept not shown better yet")
    # The same equal arms pass a non-inferiority margin of 5 points.
    report = analyze(traffic(6), ABConfig(primary_margin=0.05))
    assert report.decision == "promote"
    assert report.reasons[0].startswith("edits kept non-inferior (margin 5 points)")


def test_empty_arm_and_unknown_arm():
    report = analyze([r for r in traffic(7, users=4) if r.arm == "champion"], ABConfig())  # too few for SRM
    assert report.decision == "continue" and report.metrics["edits_kept"].candidate.value is None
    json.dumps(report.to_dict(), allow_nan=False)
    Console(record=True).print(report.table())
    with pytest.raises(ValueError, match="arm 'treatment' is neither 'champion' nor 'candidate'"):
        analyze([ABRecord("c1", "treatment", "u", False, False, False, False, 1.0)], ABConfig())


def completion(cid: str, user: str | None, arm: str, latency_s: float,
               session: str | None = None) -> CompletionRecord:
    choice = ChoiceRecord(index=0, token_ids=[1, 2], logprobs=[-0.1, -0.2], raw_logprobs=[-0.1, -0.2],
                          versions=[1, 1], finish_reason="stop", text="ok", content="ok")
    record = CompletionRecord(completion_id=cid, created_at=1000.0, model_name="m", model_version=1,
                              prompt_token_ids=[0], choices=[choice], request_json="{}", user=user,
                              session_id=session, latency_s=latency_s)
    record.arm = arm  # the gateway sets it from deploy.canary.assign_arm
    return record


def test_records_join_completions_and_feedback_from_the_event_store(tmp_path):
    store = SqliteEventStore(tmp_path / "events.sqlite")
    store.add_completion(completion("a", "u1", "champion", 0.5))
    store.add_completion(completion("b", "u2", "candidate", 0.7))
    store.add_completion(completion("c", None, "candidate", 0.9, session="s9"))
    store.add_completion(completion("d", "u1", "champion", 0.4))
    store.add_events([
        FeedbackEvent("e1", "edit_accepted", completion_id="a"),
        FeedbackEvent("e2", "edit_persisted", completion_id="a", window_s=600.0),
        FeedbackEvent("e3", "edit_accepted", completion_id="b"),
        FeedbackEvent("e4", "edit_persisted", completion_id="b", window_s=300.0),
        FeedbackEvent("e5", "edit_reverted", completion_id="b"),          # a revert after a persist wins
        FeedbackEvent("e6", "followup_dissatisfied", completion_id="b"),
        FeedbackEvent("e7", "edit_accepted", completion_id="c"),          # still inside its window: pending
        FeedbackEvent("e8", "followup_dissatisfied", session_id="s9"),    # session-only: not attributed
        FeedbackEvent("e9", "edit_rejected", completion_id="d"),          # rejected: no edit was made
    ])
    records = {r.completion_id: r for r in ab_records(store.list_completions(), store.list_events())}
    assert records["a"] == ABRecord("a", "champion", "u1", True, True, False, False, 0.5)
    assert records["b"] == ABRecord("b", "candidate", "u2", True, False, True, True, 0.7)
    assert records["c"] == ABRecord("c", "candidate", "s9", True, False, False, False, 0.9)
    assert records["d"] == ABRecord("d", "champion", "u1", False, False, False, False, 0.4)
    report = analyze(list(records.values()), ABConfig())
    assert report.arms["candidate"] == {"completions": 2, "units": 2, "edits": 2, "resolved_edits": 1,
                                        "pending_edits": 1, "kept": 0, "reverted": 1, "dissatisfied": 1}
    assert report.arms["champion"]["units"] == 1 and report.metrics["edits_kept"].champion.value == 1.0
    assert report.decision == "continue"
    store.close()
