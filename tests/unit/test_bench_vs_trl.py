"""`rtrl bench vs-trl`'s shared pieces: TRL's side sees our prompt and is paid by our agent loop and grader."""

from __future__ import annotations

import json

import numpy as np
import pytest

from realtime_rl.bench.vs_trl import FULL, FirstTurnReward, first_turn_prompt, task_at
from realtime_rl.bench.vs_trl_curves import (
    crossings, minutes_to_target, monotone, per_step, ratio_intervals, ratio_of, snapshot_steps,
)
from realtime_rl.environments import WarmPool, run_episode
from realtime_rl.environments.policies import ScriptedPolicy
from realtime_rl.config import SandboxConfig


def _write(task, content: str) -> str:
    call = {"name": "write_file", "arguments": {"path": task.solution_files[0], "content": content}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def test_first_turn_prompt_is_the_agent_loops_context(tokenizer, tmp_path):
    task = task_at(4000, tmp_path)
    policy = ScriptedPolicy(tokenizer, ["done"])
    with WarmPool(SandboxConfig(pool_size=1)) as pool:
        run_episode(policy, tokenizer, task, pool, FULL.agent)
    assert policy.contexts[0] == tokenizer.encode(first_turn_prompt(task))


@pytest.mark.slow
def test_reward_runs_the_reply_through_the_first_turn_and_grades_it(tokenizer, tmp_path):
    reward = FirstTurnReward(tokenizer, tmp_path, FULL.agent, workers=2)
    try:
        task = reward.task(4000)
        reference = task.reference_solution()[task.solution_files[0]]
        novice = task.read(task.novice_files[0])
        replies = [_write(task, reference), _write(task, novice), "<tool_call>\n{not json\n</tool_call>", "Sure."]
        ids = [tokenizer.encode(r) + [tokenizer.im_end_id] for r in replies]
        assert reward.batch([4000] * 4, ids) == [1.0, 0.0, 0.0, 0.0]
    finally:
        reward.close()


def test_minutes_to_target_interpolates_between_the_snapshots_around_it():
    curve = [(0.0, 0.30), (3.0, 0.36), (6.0, 0.44), (9.0, 0.41), (12.0, 0.50)]
    assert minutes_to_target(curve, 0.40) == pytest.approx(4.5)  # a quarter of the way from 0.36 to 0.44
    assert minutes_to_target(curve, 0.44) == pytest.approx(6.0)
    assert minutes_to_target(curve, 0.30) == 0.0                  # the base already is there
    assert minutes_to_target(curve, 0.50) == pytest.approx(12.0)  # first reached at the last snapshot
    assert minutes_to_target(curve, 0.51) is None
    # a target met exactly counts, whatever the floating-point sum of base and gain rounds to
    assert minutes_to_target([(0.0, 0.34), (3.0, 0.40), (6.0, 88 / 200)], 0.34 + 0.10) == pytest.approx(6.0)


def test_the_monotone_fit_needs_the_curves_level_not_one_snapshot_to_reach_the_target():
    # the shape of 2026-11-24's run: one snapshot touches the target, the curve then sits below it
    curve = [(0.0, 0.38), (1.0, 0.435), (1.5, 0.48), (2.0, 0.465), (3.0, 0.45), (6.0, 0.465), (12.0, 0.49)]
    fit = monotone(curve)
    assert [m for m, _ in fit] == [m for m, _ in curve]
    assert all(a[1] <= b[1] for a, b in zip(fit, fit[1:]))
    assert fit[2][1] == pytest.approx((0.48 + 0.465 + 0.45 + 0.465) / 4)  # the dip pooled with the touch
    assert minutes_to_target(curve, 0.48) == pytest.approx(1.5)
    assert minutes_to_target(fit, 0.48) == pytest.approx(6.0 + (0.48 - 0.465) / (0.49 - 0.465) * 6.0)
    rising = [(0.0, 0.30), (3.0, 0.36), (6.0, 0.44)]
    assert monotone(rising) == rising  # a curve that never falls is its own fit


def test_ratio_is_trls_minutes_over_ours_and_a_lower_bound_when_trl_never_gets_there():
    assert ratio_of(2.0, 8.0, 12.0) == (4.0, False)
    assert ratio_of(2.0, None, 12.0) == (6.0, True)  # TRL's whole budget stands in
    assert ratio_of(None, 8.0, 12.0) == (None, False)
    assert ratio_of(0.0, 0.0, 12.0) == (None, False)  # the base already is at the target


def _outcomes(rate: float, n: int, rng: np.random.Generator) -> np.ndarray:
    passed = np.zeros(n, dtype=bool)
    passed[rng.choice(n, round(rate * n), replace=False)] = True
    return passed


def test_ratio_intervals_bootstrap_the_evaluation_tasks_around_the_crossings():
    rng = np.random.default_rng(1)
    base = _outcomes(0.40, 500, rng)
    ours = [(m, _outcomes(r, 500, rng)) for m, r in ((1.0, 0.44), (2.0, 0.47), (4.0, 0.52), (8.0, 0.56))]
    trl = [(m, _outcomes(r, 500, rng)) for m, r in ((2.0, 0.42), (4.0, 0.44), (8.0, 0.47), (16.0, 0.53))]
    point = crossings({side: [(0.0, 0.40)] + [(m, p.mean()) for m, p in snaps]
                       for side, snaps in (("ours", ours), ("trl", trl))}, 0.50, 20.0)
    assert point["ratio"] == pytest.approx(12.0 / 3.2)
    ci = ratio_intervals(base, {"ours": ours, "trl": trl}, 0.10, 20.0, resamples=400)
    low, high = ci["ratio_ci95"]
    assert low < point["ratio"] < high and high - low > 0.5  # 500 tasks: minutes of slack at either crossing
    assert ci["ratio_monotone_ci95"][0] <= ci["ratio_monotone_ci95"][1]
    assert ratio_intervals(base, {"ours": ours, "trl": trl}, 0.10, 20.0, resamples=400) == ci  # seeded
    # where ours never gets there in a resample the ratio counts as 0; TRL's budget stands in for TRL
    flat = [(m, base.copy()) for m, _ in ours]
    assert ratio_intervals(base, {"ours": flat, "trl": trl}, 0.10, 20.0, resamples=50)["ratio_ci95"] == [0, 0]
    never = ratio_intervals(base, {"ours": ours, "trl": [(m, base.copy()) for m, _ in trl]}, 0.10, 20.0,
                            resamples=200)["ratio_ci95"]
    assert 20.0 / 8.0 <= never[0] < never[1] <= 20.0 / 1.0  # TRL's budget over ours' crossing, within 1-8 min


def test_task_ranges_are_checked_before_anything_runs():
    from realtime_rl.bench.vs_trl import EVAL_TASKS, MIN_STEP_S, BUDGET_MINUTES, check_task_ranges

    check_task_ranges(int(BUDGET_MINUTES * 60 / MIN_STEP_S), FULL.tasks_per_step, EVAL_TASKS)  # the bench's own
    with pytest.raises(ValueError, match="6912 distinct train tasks"):
        check_task_ranges(10, 4, 600)  # past the last task of the split
    with pytest.raises(ValueError, match="must not overlap"):
        check_task_ranges(1000, 4, 200)  # the training stream would run into the evaluation's tasks


def test_tasks_ours_handed_out_past_its_steps_are_checked_against_the_evaluations(tmp_path):
    """A group dropped as stale, refused or failed moves ours' task stream on by one: steps x tasks_per_step
    (check_task_ranges) is not where the stream ended."""
    from realtime_rl.bench.vs_trl import EVAL_START, EVAL_TASKS, TASK_START, check_trained_tasks, ours_recipe
    from realtime_rl.rollout import TrajectoryLog

    config = ours_recipe(setup=FULL)
    config = config.model_copy(update={"run_dir": tmp_path, "rollout": config.rollout.model_copy(
        update={"max_difficulty": 1, "first_task": TASK_START})})
    log = TrajectoryLog(tmp_path / "trajectories")
    log.hand_out(EVAL_START - TASK_START)  # up to the task before the evaluation's: fine
    assert check_trained_tasks(config, EVAL_TASKS) == EVAL_START - TASK_START
    log.hand_out(EVAL_START - TASK_START + 3)  # three more groups than the steps took
    with pytest.raises(ValueError, match=f"3 of them the evaluation's, from {EVAL_START}"):
        check_trained_tasks(config, EVAL_TASKS)


def test_set_may_change_only_how_ours_uses_the_machine():
    from realtime_rl.bench import run_benchmark
    from realtime_rl.bench.vs_trl import ours_recipe

    assert ours_recipe(["rollout.workers=2"]).rollout.workers == 2
    with pytest.raises(ValueError, match="only how ours uses the machine"):
        ours_recipe(["rl.lr=1e-3"])
    with pytest.raises(ValueError, match="rollout.temperature"):
        run_benchmark("vs-trl", quick=True, overrides=["rollout.temperature=0.5"])
    with pytest.raises(ValueError, match="do not split over 3 workers"):  # before any model is built
        run_benchmark("vs-trl", quick=True, overrides=["rollout.workers=3"])


def test_ours_snapshots_go_forward_in_time_and_a_mark_before_the_first_step_is_the_bases():
    # budget 1 minute: marks at 1/24, 2/24, 3/24, 4/24, 6/24, ... of a minute
    assert snapshot_steps([0.067, 0.093], 1.0) == [0, 1]  # no step by the first mark: skipped, not the last step
    assert snapshot_steps([0.01, 0.02, 0.5, 0.9, 1.2], 1.0) == [1, 2, 3]  # a step past the budget is not one
    assert snapshot_steps([1.5], 1.0) == [0]  # not one step within the budget: the first


def test_per_step_compares_the_steps_both_sides_took():
    same = per_step([0.5, 0.25, 0.75, 0.5], [0.5, 0.25, 0.75])
    assert same == {"steps": 3, "mean": 0.0, "ci95": [0.0, 0.0]}
    ahead = per_step([0.6, 0.4, 0.7, 0.5], [0.5, 0.25, 0.5, 0.5])
    assert ahead["mean"] == pytest.approx(0.1125) and ahead["ci95"][0] < 0.1125 < ahead["ci95"][1]
    assert per_step([0.5], [0.5, 0.25]) == {"steps": 1, "mean": None, "ci95": None}
