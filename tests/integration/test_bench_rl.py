"""`rtrl bench learn` and `rtrl bench async` run end to end in their --quick form (smoke-sized base
model, a few RL steps); the figures of the real runs live in benchmarks/BENCHMARKS.md."""

from __future__ import annotations

import pytest
import torch

from realtime_rl.bench import run_benchmark


@pytest.mark.slow
def test_bench_learn_quick():
    threads = torch.get_num_threads()
    result = run_benchmark("learn", quick=True, overrides=["rl.lr_decay_steps=1"])
    assert result["overrides"] == ["rl.lr_decay_steps=1"] and result["quick"] is True
    # the run's threads, not those the recipe's train() left behind (1); evaluations after it run with them too
    assert result["env"]["torch_threads"] == threads == torch.get_num_threads()
    m = result["metrics"]
    assert m["rl_steps"] == 2 and m["eval_tasks"] == m["eval_tasks_train_structures"] == 4
    assert 0.0 <= m["base_pass_at_1"] <= 1.0 and 0.0 <= m["rl_pass_at_1"] <= 1.0
    # the smoke base records how it was built, so fresh tasks of the trained structures are evaluated too
    assert 0.0 <= m["base_pass_at_1_train_structures"] <= 1.0 and 0.0 <= m["rl_pass_at_1_train_structures"] <= 1.0
    assert set(m["rl_behaviour"]) == {"failed_submits", "out_of_turns", "malformed_tool_calls", "mean_turns",
                                      "repairs"}
    assert m["base_behaviour"]["failed_submits"] + m["base_behaviour"]["out_of_turns"] <= 4
    gained, lost = m["lift_gained_lost"]
    assert m["lift"] == pytest.approx((gained - lost) / m["eval_tasks"])
    before, after = m["base_passed_bits"], m["rl_passed_bits"]
    assert len(before) == len(after) == 4 and before.count("1") == round(4 * m["base_pass_at_1"])
    assert sum(a > b for a, b in zip(after, before)) == gained and sum(a < b for a, b in zip(after, before)) == lost
    assert m["minutes"] > 0
    assert 0.0 <= m["base_greedy_pass_at_1"] <= 1.0
    for side in ("base", "rl"):
        assert sum(m[f"{side}_first_write"].values()) == 4
        assert sum(m[f"{side}_first_write_failed"].values()) == 4 - round(4 * m[f"{side}_pass_at_1"])
        assert 0.0 <= m[f"{side}_structure_mean_pass_at_1"] <= 1.0
        comments = m[f"{side}_stage_comments"]
        assert comments["right"] + comments["none"] + sum(comments["wrong_at_stage"].values()) == 4
    assert 1 <= m["heldout_structures"] <= 4
    assert m["eval_attempts"] == 4
    for side in ("base", "rl"):  # every episode made 1..4 attempts; a pass is counted at the attempt that passed
        assert sum(m[f"{side}_attempts"].values()) == 4 and set(m[f"{side}_attempts"]) <= {1, 2, 3, 4}
        assert sum(m[f"{side}_passed_by_attempt"].values()) == round(4 * m[f"{side}_pass_at_1"])
        assert m[f"{side}_first_attempt_pass_at_1"] == m[f"{side}_passed_by_attempt"].get(1, 0) / 4
    assert {k: len(v) for k, v in m["train_curve_10_steps"].items()} == {
        "pass_rate": 1, "reward_mean": 1, "malformed_tool_calls": 1, "entropy": 1, "kl_ref": 1}


def test_unseen_train_tasks_start_past_what_pretraining_generated(tmp_path):
    from realtime_rl.bench.learn import unseen_train_tasks
    from realtime_rl.environments import generate_task
    from realtime_rl.train.corpus import synthetic_tasks

    assert unseen_train_tasks(tmp_path, 10, 2) is None  # no pretrain.json: unknown, so not evaluated
    (tmp_path / "pretrain.json").write_text('{"config": {"num_tasks": 9, "max_difficulty": 2, "seed": 3}}')
    args = unseen_train_tasks(tmp_path, 10, 2)
    assert args == {"split": "train", "start": {1: 5, 2: 4}, "seed": 3}
    seen = {t.task_id for t in synthetic_tasks(9, 2, seed=3)}
    fresh = {generate_task(i, "train", 3, difficulty=d).slug
             for d in (1, 2) for i in range(args["start"][d], 10)}
    assert not seen & fresh and len(seen) + len(fresh) == 20  # every index below the starts was seen
    (tmp_path / "pretrain.json").write_text(
        '{"config": {"num_tasks": 9, "max_difficulty": 2, "seed": 3, "difficulty_weights": [1, 3]}}')
    assert unseen_train_tasks(tmp_path, 10, 2)["start"] == {1: 3, 2: 6}
    seen = {t.task_id for t in synthetic_tasks(9, 2, seed=3, difficulty_weights=(1, 3))}
    assert seen == {generate_task(i, "train", 3, difficulty=d).slug for d, n in ((1, 3), (2, 6))
                    for i in range(n)}
    (tmp_path / "pretrain.json").write_text('{"config": {"num_tasks": 9, "max_difficulty": 2, "seed": 3}}')
    assert unseen_train_tasks(tmp_path, 10**6, 2) is None  # past the end of the split
    (tmp_path / "pretrain.json").write_text(
        '{"config": {"num_tasks": 9, "max_difficulty": 2, "seed": 3, "reserve_structures": true}}')
    assert unseen_train_tasks(tmp_path, 10, 2) == {"split": "reserved", "start": 0, "seed": 3}
    assert unseen_train_tasks(tmp_path, 10, 2, "reserved") == {"split": "reserved", "start": 0, "seed": 3}
    (tmp_path / "pretrain.json").write_text('{"config": {"num_tasks": 9, "max_difficulty": 2, "seed": 3}}')
    assert unseen_train_tasks(tmp_path, 10, 2, "reserved") is None  # which reserved tasks it saw is unknown


def test_recipe_overrides_come_after_the_quick_sizes(tmp_path, monkeypatch):
    from realtime_rl.bench.learn import CONFIGS, base_and_recipe
    from realtime_rl.config import TrainConfig, load_config

    monkeypatch.setenv("RTRL_BENCH_BASE", str(tmp_path / "base"))  # named, not built: nothing loads it here
    base, config = base_and_recipe(True, tmp_path, ["steps=3", "rl.lr_decay_steps=40"])
    assert base == tmp_path / "base" and config.base_checkpoint == base and config.run_dir == tmp_path / "train"
    assert config.steps == 3 and config.rl.lr_decay_steps == 40 and config.rl.group_size == 2  # quick size kept
    _, recipe = base_and_recipe(False, tmp_path)  # the recipe itself, unchanged
    assert recipe.rl == load_config(TrainConfig, CONFIGS / "train" / "default.toml").rl and recipe.steps > 3


@pytest.mark.slow
def test_bench_async_quick():
    m = run_benchmark("async", quick=True)["metrics"]
    assert m["steps"] == 2 and m["sync_minutes"] > 0 and m["async_minutes"] > 0
    assert m["episodes_in_flight_total"] == m["episodes_in_flight"] * m["rollout_workers"]
    assert m["async_groups_in_flight_max"] == (m["max_staleness_async"] + 1) * m["sync_groups_in_flight_max"]
    assert m["speedup"] == pytest.approx(m["sync_minutes"] / m["async_minutes"])
    assert m["sync_trainer_step_s"] > 0 and m["async_trainer_step_s"] > 0
    assert m["trainer_device"] == m["rollout_device"] == "cpu float32" and m["rollout_workers"] == 1
    assert 0.0 <= m["trainer_idle_fraction_sync"] <= 1.0
    for mode in ("sync", "async"):  # the first batch's wait is (nearly) all idle: without it the fraction drops
        assert 0.0 < m[f"{mode}_fill_s"] < m[f"{mode}_minutes"] * 60
        assert 0.0 <= m[f"trainer_idle_fraction_{mode}_after_fill"] <= m[f"trainer_idle_fraction_{mode}"]
        assert 0.0 < m[f"{mode}_engine_busy"] <= 1.0 and m[f"{mode}_decode_rows"] >= 1
        assert m[f"{mode}_decode_ms"] > 0 and m[f"{mode}_prefill_ms"] > 0 and 0 < m[f"{mode}_policy_share"] < 1


@pytest.mark.slow
def test_bench_vs_trl_quick():
    m = run_benchmark("vs-trl", quick=True)["metrics"]
    assert m["ours_steps"] == 2 and m["trl_steps"] == 2
    assert len(m["ours_step_pass_rates"]) == 2 and len(m["trl_step_pass_rates"]) == 2
    # both curves start at the base and have at least one snapshot after it, in time order
    for side in ("ours", "trl"):
        curve = m[f"{side}_curve"]
        assert tuple(curve[0]) == (0.0, m["base_pass_at_1"])
        assert len(curve) >= 2 and all(a[0] < b[0] for a, b in zip(curve, curve[1:]))
    # quick: the target is the base itself, so both reach it at once
    assert m["target_pass_at_1"] == m["base_pass_at_1"]
    assert m["ours_minutes_to_target"] == m["trl_minutes_to_target"] == 0.0
    assert {"ratio_monotone", "ours_minutes_to_target_monotone", "trl_minutes_to_target_monotone"} <= m.keys()


def test_first_attempts_and_the_attempts_setting(monkeypatch):
    from realtime_rl.bench.learn import EVAL_ATTEMPTS, eval_attempts, first_attempts, paired_lift

    rows = [(True, 1), (True, 3), (False, 4), (True, 1), (False, 1)]
    report = {"per_task": [{"task_id": f"t{i}", "passed": p, "attempts": a} for i, (p, a) in enumerate(rows)]}
    assert [r["passed"] for r in first_attempts(report)["per_task"]] == [True, False, False, True, False]
    lift = paired_lift(first_attempts(report), report)  # the later attempts gained one task, lost none
    assert (lift["gained"], lift["lost"]) == (1, 0)
    monkeypatch.delenv("RTRL_BENCH_ATTEMPTS", raising=False)
    assert eval_attempts() == EVAL_ATTEMPTS
    monkeypatch.setenv("RTRL_BENCH_ATTEMPTS", "1")
    assert eval_attempts() == 1
    for bad in ("0", "two", "-1", "101"):
        monkeypatch.setenv("RTRL_BENCH_ATTEMPTS", bad)
        with pytest.raises(ValueError, match="RTRL_BENCH_ATTEMPTS"):
            eval_attempts()


def test_paired_lift_counts_tasks_that_changed_outcome():
    from realtime_rl.bench.learn import paired_lift

    def report(passed):
        return {"per_task": [{"task_id": f"t{i}", "passed": p} for i, p in enumerate(passed)]}

    before = report([1] * 10 + [0] * 30 + [1] * 2)
    after = report([1] * 10 + [1] * 14 + [0] * 16 + [0] * 2)
    lift = paired_lift(before, after)
    assert (lift["gained"], lift["lost"]) == (14, 2)
    assert lift["lift"] == pytest.approx(12 / 42)
    assert 0 < lift["ci95"][0] < lift["lift"] < lift["ci95"][1] and lift["mcnemar_p"] < 0.01
    assert paired_lift(before, before) | {"ci95": None} == {"lift": 0.0, "ci95": None, "mcnemar_p": 1.0,
                                                           "gained": 0, "lost": 0}
    with pytest.raises(ValueError, match="same tasks"):
        paired_lift(before, report([1]))
