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
