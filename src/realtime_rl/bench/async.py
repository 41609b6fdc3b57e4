"""`rtrl bench async`: synchronous against asynchronous RL, same model, tasks, steps and machine.

Both runs train the default base model with configs/train/default.toml for the same number of
steps (so the same number of trajectories) from the same start; only `max_staleness` differs:
0 (synchronous on-policy: sample a batch, train, publish, sample the next) against the recipe's bound
(workers keep sampling from the newest weights while the trainer trains; staleness corrected by
decoupled PPO with TIS/IcePop). Environment latency is that of real sandboxed test runs and grading;
`RTRL_BENCH_TOOL_LATENCY` (seconds per tool turn) adds simulated latency to study overlap;
`RTRL_BENCH_STEPS` and `RTRL_BENCH_EVAL_TASKS` shorten a run; `RTRL_BENCH_BASE=DIR` picks the base model;
`--set KEY=VALUE` changes the recipe for both runs.

Both runs get room for (max_staleness + 1) batches of episodes in flight: the synchronous run can use
one batch of it (the next is admitted only after the step that needs it), the asynchronous run all of it.
That concurrency, with training overlapped, is what asynchrony buys when environments are slow.

"The same pass@1": both runs end with a held-out pass@1 on the same tasks (reported, with the
training reward of their last steps); the speedup is the ratio of wall times for the same steps. Each
mode also reports where its workers' engines and episodes spent the run (`<mode>_engine_busy`, `_decode_ms`,
`_decode_rows`, `_prefill_ms`, `_prefills_per_step`, `_policy_share`, `_grade_share`; docs/rl.md, Metrics).
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from realtime_rl.bench.learn import base_and_recipe
from realtime_rl.rollout import train
from realtime_rl.rollout.orchestrator import shards_per_group
from realtime_rl.train.base_eval import heldout_pass_at_1

EVAL_TASKS = 100
STEPS = 20


def run(quick: bool = False, overrides: Sequence[str] = ()) -> dict[str, Any]:
    latency = float(os.environ.get("RTRL_BENCH_TOOL_LATENCY", "0"))
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-async-") as tmp:
        base, config = base_and_recipe(quick, Path(tmp), overrides)
        steps = config.steps if quick else int(os.environ.get("RTRL_BENCH_STEPS", STEPS))
        eval_tasks = 4 if quick else int(os.environ.get("RTRL_BENCH_EVAL_TASKS", EVAL_TASKS))
        bound = max(1, config.max_staleness)
        in_flight = (bound + 1) * config.rl.groups_per_step * config.rl.group_size
        for mode, staleness in (("sync", 0), ("async", bound)):
            cfg = config.model_copy(update={
                "run_dir": Path(tmp) / mode, "steps": steps, "max_staleness": staleness, "max_minutes": None,
                "rollout": config.rollout.model_copy(update={"tool_latency_s": latency,
                                                             "episodes_in_flight": in_flight})})
            threads = torch.get_num_threads()
            summary = train(cfg, show_progress=not quick)
            torch.set_num_threads(threads)  # train() sets the recipe's: both evaluations run alike
            evaluation = heldout_pass_at_1(summary["checkpoint"], num_tasks=eval_tasks,
                                           max_difficulty=config.rollout.max_difficulty)
            results[mode] = {**summary, "pass_at_1": evaluation["pass_at_1"]}
    sync, asyn = results["sync"], results["async"]
    return {
        "sync_minutes": sync["minutes"],
        "async_minutes": asyn["minutes"],
        "speedup": sync["minutes"] / asyn["minutes"],
        "trainer_idle_fraction_sync": sync["trainer_idle_fraction"],
        "trainer_idle_fraction_async": asyn["trainer_idle_fraction"],
        # Without each run's wait for its first batch (a fixed cost a short bench does not amortise).
        "trainer_idle_fraction_sync_after_fill": sync["trainer_idle_fraction_after_fill"],
        "trainer_idle_fraction_async_after_fill": asyn["trainer_idle_fraction_after_fill"],
        "sync_fill_s": sync["fill_s"],
        "async_fill_s": asyn["fill_s"],
        "sync_pass_at_1": sync["pass_at_1"],
        "async_pass_at_1": asyn["pass_at_1"],
        "sync_train_reward_last3": sync["reward_last_mean"],
        "async_train_reward_last3": asyn["reward_last_mean"],
        "steps": steps,
        "max_staleness_async": bound,
        "async_dropped_stale_groups": asyn["dropped_stale_groups"],
        "sync_rollout_tokens_per_s": sync["rollout_tokens_per_s"],
        "async_rollout_tokens_per_s": asyn["rollout_tokens_per_s"],
        "sync_trainer_step_s": _median_step_s(sync),
        "async_trainer_step_s": _median_step_s(asyn),
        # Where the workers' engines and episodes spent the run (RolloutBackend.engine_metrics: engine_busy,
        # decode_ms, decode_rows, prefill_ms, prefills_per_step, policy_share, grade_share): which of decoding,
        # prefilling, tools or grading bounds sampling.
        **{f"{mode}_{k}": v for mode, r in (("sync", sync), ("async", asyn)) for k, v in r["rollout"].items()},
        "tool_latency_s": latency,
        "episodes_in_flight": in_flight,  # per rollout worker (rollout.episodes_in_flight)
        "episodes_in_flight_total": in_flight * config.rollout.workers,
        # Staleness 0 admits one step's groups at a time: with more workers than groups_per_step each group is
        # spread over shards_per_group workers (before 2026-12-03 a group ran on one worker, and the synchronous
        # run left the rest idle: part of those speedups was idle workers).
        "sync_groups_in_flight_max": config.rl.groups_per_step,
        "async_groups_in_flight_max": (bound + 1) * config.rl.groups_per_step,
        "sync_shards_per_group": shards_per_group(config.model_copy(update={"max_staleness": 0})),
        "async_shards_per_group": shards_per_group(config.model_copy(update={"max_staleness": bound})),
        "eval_tasks": eval_tasks,
        "rollout_workers": config.rollout.workers,
        "trainer_device": f"{config.rl.device} {config.rl.dtype}",
        "rollout_device": f"{config.rollout.device} {config.rollout.dtype}",
    }


def _median_step_s(summary: dict[str, Any]) -> float | None:
    """The median seconds of a run's trainer steps (train/step_s: the step, its checkpoint and its publish)."""
    steps = [m["train/step_s"] for m in summary["history"]]
    return statistics.median(steps) if steps else None
