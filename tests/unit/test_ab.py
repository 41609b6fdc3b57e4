"""The A/B analysis on seeded synthetic traffic: a win is promoted, a guardrail regression and a sample-ratio
mismatch roll back, too little data continues; with users who differ, intervals clustered by user keep an
A/A test honest where per-completion intervals do not, and an arm without variance falls back to the binomial
intervals rather than a zero-width one; records are built from a real event store, and count an edit kept exactly
when the reward rules pay it as persisted."""

from __future__ import annotations

import hashlib
import json
import time

import numpy as np
import pytest
from rich.console import Console

from realtime_rl.collect import ChoiceRecord, CompletionRecord, FeedbackEvent, SqliteEventStore
from realtime_rl.config.loop import ABConfig
from realtime_rl.config.rewards import RewardRules
from realtime_rl.evaluate.ab import ABRecord, Estimate, ab_records, analyze
from realtime_rl.rewards import Item, settle


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


@pytest.mark.parametrize(("cluster", "method"),
                         [("users", "cluster-robust (users)"), ("none", "Wilson; Newcombe")])
def test_a_win_on_edits_kept_is_promoted_and_reported_in_cursors_terms(cluster, method):
    report = analyze(traffic(0, kept=(0.60, 0.70)), ABConfig(cluster=cluster))
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
    assert data["metrics"]["edits_kept"]["method"] == method and data["config"]["cluster"] == cluster

    console = Console(record=True, width=160)
    console.print(report.table())
    text = console.export_text()
    for row in ("edits kept %", "dissatisfied follow-ups %", "latency p50 (s)", "difference [95% CI]",
                "relative", method):
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
    # So does a relative one (60% of the champion's 1 s), and with neither any measurable slowdown rolls back.
    report = analyze(traffic(2, latency=(1.0, 1.3)), ABConfig(latency_tolerance_rel=0.6))
    assert report.decision == "continue"
    report = analyze(traffic(2, latency=(1.0, 1.06)), ABConfig(latency_tolerance_rel=0.0))
    assert report.decision == "rollback" and report.reasons[0].startswith("regression: latency p50 +0.0")
    assert analyze(traffic(2, latency=(1.0, 1.06)), ABConfig()).decision == "continue"  # its interval reaches below 5%


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


def users_who_differ(seed: int, users: int, per_user: int, effect: float = 0.0) -> list[ABRecord]:
    """Users whose own kept rate is drawn from Beta(0.5, 0.5) (some keep nearly every edit, some revert nearly
    every one, as style preferences make them), split between the arms by a hash of the user as the router
    does; the candidate adds `effect` to each of its users' rates. Every completion is a resolved edit."""
    rng = np.random.default_rng(seed)
    records = []
    for u, rate in enumerate(rng.beta(0.5, 0.5, users)):
        arm = "candidate" if hashlib.sha256(f"{seed}/user-{u}".encode()).digest()[0] < 128 else "champion"
        rate = min(1.0, rate + effect) if arm == "candidate" else rate
        for j, kept in enumerate(rng.random(per_user) < rate):
            records.append(ABRecord(f"c{u}-{j}", arm, f"user-{u}", True, bool(kept), not kept, False,
                                    1.0 + 0.01 * u))
    return records


def test_clustered_intervals_keep_an_aa_test_honest_where_per_completion_intervals_do_not():
    # 20 users, 20 completions each, identical arms: the unit of randomisation is the user, so the
    # effective sample is closer to 20 than to 400. Per-completion intervals are about 4x too narrow here.
    experiments = [users_who_differ(seed, users=20, per_user=20) for seed in range(250)]

    def coverage(cluster: str, runs: list[list[ABRecord]]) -> float:
        config = ABConfig(cluster=cluster, bootstrap_resamples=100)
        differences = [analyze(records, config).metrics["edits_kept"].difference for records in runs]
        assert all(d.low is not None for d in differences)
        return float(np.mean([d.low <= 0.0 <= d.high for d in differences]))

    # Seeded: 93.6% (nominal 95%; CR1 with ~10 users per arm is a little short) against 38%.
    assert coverage("users", experiments) >= 0.90
    assert coverage("none", experiments[:60]) <= 0.60


def test_a_real_effect_across_many_users_is_promoted_under_clustering():
    records = users_who_differ(1, users=400, per_user=5, effect=0.15)
    report = analyze(records, ABConfig())
    assert report.decision == "promote", report.reasons
    kept = report.metrics["edits_kept"]
    assert kept.method == "cluster-robust (users)" and kept.difference.low > 0 and kept.p_value < 0.01
    # The clustered interval is wider than the per-completion one: users differ more than completions.
    independent = analyze(records, ABConfig(cluster="none")).metrics["edits_kept"].difference
    assert kept.difference.high - kept.difference.low > 1.2 * (independent.high - independent.low)


def test_one_user_per_arm_continues_without_intervals():
    records = [ABRecord(f"c{i}", arm, f"user-{arm}", True, i % 3 > 0, i % 3 == 0, False, 1.0 + i % 5)
               for i in range(200) for arm in ("champion", "candidate")]
    report = analyze(records, ABConfig())
    assert report.decision == "continue"
    assert report.reasons == ["insufficient data: champion has 1 users < 4; candidate has 1 users < 4"]
    for m in report.metrics.values():  # the cluster variance of one user is undefined: values, no intervals
        assert m.champion.value is not None and m.champion.low is None and m.difference.low is None
    json.dumps(report.to_dict(), allow_nan=False)
    # The floor is a config choice; below two users there is still nothing to decide on.
    report = analyze(records, ABConfig(min_users_per_arm=1))
    assert report.decision == "continue" and "no interval" in report.reasons[0]


@pytest.mark.filterwarnings("ignore:Precision loss:RuntimeWarning")  # cluster="none": Student t of equal values
def test_identical_outcomes_take_the_binomial_intervals_and_a_constant_mean_has_none():
    # Every edit kept, every latency 1 s, in both arms: no variance for the cluster fit to estimate.
    records = [ABRecord(f"c{i}", ("champion", "candidate")[i % 2], f"user-{i % 20}", True, True, False, False,
                        1.0) for i in range(400)]
    report = analyze(records, ABConfig())
    kept = report.metrics["edits_kept"]
    independent = analyze(records, ABConfig(cluster="none")).metrics["edits_kept"]
    assert kept.champion == kept.candidate == independent.champion  # Wilson, 200 of 200: not a rate of 1 for sure
    assert kept.champion.low < 0.99 and kept.difference == independent.difference and kept.difference.low < 0
    assert kept.method == "cluster-robust (users); Wilson, Newcombe hull (no variance: champion, candidate)"
    mean = report.metrics["latency_mean_s"]
    assert mean.difference == Estimate(0.0) and mean.champion == Estimate(1.0) and mean.p_value is None
    assert report.metrics["latency_p50_s"].difference == Estimate(0.0, 0.0, 0.0)
    assert report.decision == "continue", report.reasons


def few_users_who_keep_everything(candidate_reverts: int = 0) -> list[ABRecord]:
    """4 users per arm, 13 resolved edits each, all kept but the first `candidate_reverts` of one candidate user."""
    records = []
    for arm in ("champion", "candidate"):
        for u in range(4):
            for j in range(13):
                reverted = arm == "candidate" and u == 0 and j < candidate_reverts
                records.append(ABRecord(f"c-{arm}-{u}-{j}", arm, f"{arm}-{u}", True, not reverted, reverted, False,
                                        1.0 + 0.01 * j))
    return records


def test_every_edit_kept_in_both_arms_is_not_shown_non_inferior_by_a_zero_width_interval():
    # 52 of 52 kept in each arm: Wilson's interval for each is [93.1%, 100%], Newcombe's difference about +-6.9
    # points. A cluster fit has no variance to estimate and once gave [+0.00, +0.00], which "promoted".
    report = analyze(few_users_who_keep_everything(), ABConfig(primary_margin=0.05, bootstrap_resamples=200))
    assert report.decision == "continue", report.reasons
    assert report.reasons[0].startswith("edits kept not shown non-inferior yet: +0.00 points (95% CI [-6.88, +6.88])")
    kept = report.metrics["edits_kept"]
    assert kept.champion.low == pytest.approx(0.9312, abs=1e-4) and kept.champion.high == 1.0
    assert "no variance: champion, candidate" in kept.method
    assert report.to_dict()["metrics"]["edits_kept"]["method"] == kept.method


def test_an_arm_without_variance_widens_the_clustered_difference_by_its_binomial_uncertainty():
    # The champion keeps 52 of 52; one candidate user reverts one edit. The clustered difference takes the
    # champion's rate as exactly 1 ([-6.2, +2.3] points) and would show non-inferiority at 7 points; the hull
    # with Newcombe's interval keeps the champion's uncertainty.
    records = few_users_who_keep_everything(candidate_reverts=1)
    config = ABConfig(primary_margin=0.07, bootstrap_resamples=200)
    report = analyze(records, config)
    assert report.decision == "continue", report.reasons
    kept = report.metrics["edits_kept"]
    independent = analyze(records, config.model_copy(update={"cluster": "none"})).metrics["edits_kept"]
    assert kept.difference.low == independent.difference.low < -0.07 and kept.p_value is not None
    assert kept.champion == independent.champion and kept.candidate != independent.candidate  # the candidate varies
    assert kept.method.endswith("(no variance: champion)")


def completion(cid: str, user: str | None, arm: str, latency_s: float,
               session: str | None = None, created_at: float = 1000.0) -> CompletionRecord:
    choice = ChoiceRecord(index=0, token_ids=[1, 2], logprobs=[-0.1, -0.2], raw_logprobs=[-0.1, -0.2],
                          versions=[1, 1], finish_reason="stop", text="ok", content="ok")
    record = CompletionRecord(completion_id=cid, created_at=created_at, model_name="m", model_version=1,
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
    store.add_completion(completion("x", "u3", "candidate", 0.6))
    store.add_completion(completion("anon", None, "champion", 0.3))  # no user, no session: never randomised
    store.add_events([
        FeedbackEvent("e1", "edit_accepted", completion_id="a"),
        FeedbackEvent("e2", "edit_persisted", completion_id="a", window_s=600.0),
        FeedbackEvent("e3", "edit_accepted", completion_id="b"),
        FeedbackEvent("e4", "edit_reverted", completion_id="b"),          # the first decision wins
        FeedbackEvent("e5", "edit_persisted", completion_id="b", window_s=300.0),
        FeedbackEvent("e6", "followup_dissatisfied", completion_id="b"),
        FeedbackEvent("e7", "edit_accepted", completion_id="c"),          # still inside its window: pending
        FeedbackEvent("e8", "followup_dissatisfied", session_id="s9"),    # session-only: not attributed
        FeedbackEvent("e9", "edit_rejected", completion_id="d"),          # rejected: no edit was made
        FeedbackEvent("e10", "undelivered", completion_id="x"),           # nobody saw it: no outcome
        FeedbackEvent("e11", "followup_dissatisfied", completion_id="x"),
    ])
    records = {r.completion_id: r for r in ab_records(store.list_completions(), store.list_events())}
    assert records["a"] == ABRecord("a", "champion", "u1", True, True, False, False, 0.5)
    assert records["b"] == ABRecord("b", "candidate", "u2", True, False, True, True, 0.7)
    assert records["c"] == ABRecord("c", "candidate", "s9", True, False, False, False, 0.9)
    assert records["d"] == ABRecord("d", "champion", "u1", False, False, False, False, 0.4)
    assert "anon" not in records
    # undelivered: its latency counts (a slow arm's abandoned replies), no outcome does
    assert records["x"] == ABRecord("x", "candidate", "u3", False, False, False, False, 0.6, delivered=False)
    report = analyze(list(records.values()), ABConfig())
    assert report.arms["candidate"] == {"completions": 2, "units": 2, "edits": 2, "resolved_edits": 1,
                                        "pending_edits": 1, "kept": 0, "reverted": 1, "dissatisfied": 1,
                                        "undelivered": 1}
    assert report.metrics["latency_mean_s"].n_candidate == 3 and report.metrics["dissatisfied"].n_candidate == 2
    assert report.arms["champion"]["units"] == 1 and report.metrics["edits_kept"].champion.value == 1.0
    assert report.decision == "continue"
    store.close()


def test_a_persist_shorter_than_the_reward_rules_window_does_not_count_as_kept(tmp_path):
    # The reward rules settle an edit as kept only once its window_s and the store's clock (recorded_at -
    # created_at) both reach persist_window_s; the A/B counts the same.
    store = SqliteEventStore(tmp_path / "events.sqlite")
    now = time.time()
    store.add_completion(completion("short", "u1", "champion", 0.5, created_at=now - 20.0))
    store.add_completion(completion("early", "u3", "champion", 0.5, created_at=now))
    store.add_completion(completion("long", "u2", "candidate", 0.5, created_at=now - 20.0))
    store.add_events([
        FeedbackEvent("e1", "edit_accepted", completion_id="short"),
        FeedbackEvent("e2", "edit_persisted", completion_id="short", window_s=5.0),
        FeedbackEvent("e3", "edit_persisted", completion_id="long", window_s=15.0),
        FeedbackEvent("e4", "edit_persisted", completion_id="early", window_s=15.0),  # claimed, not yet 15 s
    ])
    records = {r.completion_id: r for r in ab_records(store.list_completions(), store.list_events(),
                                                      persist_window_s=15.0)}
    assert records["short"] == ABRecord("short", "champion", "u1", True, False, False, False, 0.5)  # pending
    assert records["early"] == ABRecord("early", "champion", "u3", True, False, False, False, 0.5)  # pending
    assert records["long"] == ABRecord("long", "candidate", "u2", True, True, False, False, 0.5)
    report = analyze(list(records.values()), ABConfig())
    assert report.arms["champion"]["pending_edits"] == 2 and report.arms["champion"]["kept"] == 0
    # Without a window (the default) any edit_persisted is kept.
    assert all(r.kept for r in ab_records(store.list_completions(), store.list_events()))
    store.close()


def test_a_revert_of_a_completion_too_young_to_have_been_kept_waits_as_a_keep_would():
    """Read at `as_of`, a completion younger than persist_window_s can only have been reverted, never kept:
    counting its reverts made the last window's traffic all reverts, and the kept rate hang on when the A/B
    ran. Such a revert is pending; one old enough decides, as does a keep."""
    def stored(cid: str, kind: str, at: float, window_s: float | None = None) -> FeedbackEvent:
        return FeedbackEvent(f"{cid}-{kind}", kind, completion_id=cid, window_s=window_s, recorded_at=at, seq=1)

    completions = [completion(cid, f"u{k}", "champion", 0.5, created_at=at)
                   for k, (cid, at) in enumerate([("young", 1900.0), ("old", 1000.0), ("kept", 1000.0)])]
    events = [stored("young", "edit_reverted", 1950.0), stored("old", "edit_reverted", 1100.0),
              stored("kept", "edit_persisted", 1700.0, 600.0)]
    records = {r.completion_id: (r.edited, r.kept, r.reverted)
               for r in ab_records(completions, events, persist_window_s=600.0, as_of=2000.0)}
    assert records == {"young": (True, False, False), "old": (True, False, True), "kept": (True, True, False)}
    later = {r.completion_id: r.reverted for r in ab_records(completions, events, 600.0, as_of=2500.0)}
    assert later["young"]  # once it is old enough, its revert decides


def test_the_ab_counts_an_edit_kept_exactly_when_the_rewards_pay_it_as_persisted():
    # The first decision on the store's clock within the horizon wins, in both (RewardRules: persist 600 s,
    # horizon 3600 s). Completions are created at 1000.
    rules = RewardRules()

    def stored(cid: str, *events: tuple[str, float, float | None]) -> list[FeedbackEvent]:
        return [FeedbackEvent(f"{cid}-{k}", kind, completion_id=cid, window_s=window_s, recorded_at=at, seq=k)
                for k, (kind, at, window_s) in enumerate(events)]

    events = {
        # Persisted past its window, then reverted: the rewards pay the persist (and the revert comes late).
        "persisted_then_reverted": stored("persisted_then_reverted", ("edit_accepted", 1001, None),
                                          ("edit_persisted", 1601, 600.0), ("edit_reverted", 1700, None)),
        "reverted_then_persisted": stored("reverted_then_persisted", ("edit_accepted", 1001, None),
                                          ("edit_reverted", 1100, None), ("edit_persisted", 1700, 600.0)),
        # A 600 s window claimed 5 s after the completion decides nothing; the revert does.
        "claimed_early": stored("claimed_early", ("edit_accepted", 1002, None), ("edit_persisted", 1005, 600.0),
                                ("edit_reverted", 1100, None)),
        # Nothing decided by the horizon (4600): censored, pending in the A/B.
        "after_horizon": stored("after_horizon", ("edit_accepted", 1001, None), ("edit_persisted", 4700, 600.0)),
        "rejected": stored("rejected", ("edit_rejected", 1001, None), ("edit_persisted", 1700, 600.0)),
    }
    completions = [completion(cid, f"u{k}", "champion", 0.5) for k, cid in enumerate(events)]
    records = {r.completion_id: r for r in ab_records(completions, [e for evs in events.values() for e in evs],
                                                      rules.persist_window_s, rules.horizon_s)}
    assert [(cid, r.edited, r.kept, r.reverted) for cid, r in records.items()] == [
        ("persisted_then_reverted", True, True, False), ("reverted_then_persisted", True, False, True),
        ("claimed_early", True, False, True), ("after_horizon", True, False, False), ("rejected", False, False, False)]
    for cid, evs in events.items():
        item = Item(cid, 0, created_at=1000.0, model_version=1, kind="edit", malformed_calls=0, response_tokens=2)
        paid = {c.source for c in settle(item, evs, rules, now=1e9).components if c.amount != 0}
        assert (records[cid].kept, records[cid].reverted) == ("event:edit_persisted" in paid,
                                                              "event:edit_reverted" in paid), cid
