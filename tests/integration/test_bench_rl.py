"""`rtrl bench learn` and `rtrl bench async` run end to end in their --quick form (smoke-sized base
model, a few RL steps); the figures of the real runs live in benchmarks/BENCHMARKS.md."""

from __future__ import annotations

import pytest

from realtime_rl.bench import run_benchmark


@pytest.mark.slow
def test_bench_learn_quick():
    m = run_benchmark("learn", quick=True)["metrics"]
    assert m["rl_steps"] == 2 and m["eval_tasks"] == 4
    assert 0.0 <= m["base_pass_at_1"] <= 1.0 and 0.0 <= m["rl_pass_at_1"] <= 1.0
    assert m["minutes"] > 0


@pytest.mark.slow
def test_bench_async_quick():
    m = run_benchmark("async", quick=True)["metrics"]
    assert m["steps"] == 2 and m["sync_minutes"] > 0 and m["async_minutes"] > 0
    assert m["speedup"] == pytest.approx(m["sync_minutes"] / m["async_minutes"])
    assert 0.0 <= m["trainer_idle_fraction_sync"] <= 1.0


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
