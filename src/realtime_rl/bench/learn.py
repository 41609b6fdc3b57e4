"""`rtrl bench learn`: does RL make the base model better on tasks it never trained on?

    base = the default base model (configs/pretrain/default.toml; built once, then reused)
    base_pass_at_1 = held-out pass@1 of base       (train/base_eval.py: 600 held-out tasks, T = 1.0,
                                                     up to EVAL_ATTEMPTS fresh attempts per episode)
    rtrl train with configs/train/default.toml      (asynchronous GRPO, router replay, real sandboxes)
    rl_pass_at_1 = held-out pass@1 of the result on the same tasks, same sampling

Each held-out episode is one graded submission through the agent loop with `AgentConfig.attempts` =
EVAL_ATTEMPTS: a failing run of the visible tests starts the task afresh (environments/agent_loop.py), as an
agent that retries from a clean slate does; RL trains one-attempt episodes, which is what each attempt
samples.
`*_first_attempt_pass_at_1` (and `lift_first_attempt`) count the episodes that passed in their first attempt:
within the in-context repairs (~1.5% of tasks for the default base) of pass@1 with one attempt, the measure of
the runs before 2026-11-27. `RTRL_BENCH_ATTEMPTS=N` evaluates with N attempts (1: that measure exactly).
`lift` is rl - base on the same tasks, with the paired 95% interval (Tango's score interval, the
promotion gate's statistic), McNemar's exact p-value and the tasks gained and lost: a lift "as measured"
is one whose interval excludes 0. Held-out tasks are of program structures no training ever generated:
they measure what transfers.
`*_pass_at_1_train_structures` measure the same before and after on 200 fresh tasks of the structures RL
trains on (train split, indices the base's pre-training never generated; `None` when the checkpoint has
no pretrain.json to say which): whether RL learned at all, apart from whether that transfers. For a base
built with `reserve_structures` they are reserved tasks (`train_structures_split`), structures the base never
saw, which `--set rollout.split=reserved` trains on (and the recipe does not).
`*_behaviour` counts, on the held-out tasks, failed submits, episodes out of turns, malformed tool calls
and mean turns: what RL changed in how episodes end, which pass@1 alone hides.
`base_greedy_pass_at_1` is the base on the same tasks at temperature 0 with one attempt (greedy attempts
would repeat themselves): roughly what sharpening the base's own choices, without teaching it anything new,
can reach in a first attempt. `*_first_write` counts what each held-out episode's first reply wrote (the
reference, a novice variant, other code, nothing; `*_failed` over failed episodes): failures of the novice
kind are what RL toward the expert removes, "other" ones are programs the model cannot write.
`*_stage_comments` counts the episodes whose first write's stage comments are the instructions' steps
(`right`, `right_passed`) and those whose first wrong one is at stage k: on held-out structures the default
base mostly writes another stage's comment, and the code follows it. `*_by_input_type` counts [passed, tasks]
per difficulty and input type (integer lists, naturals, text). `*_structure_mean_pass_at_1` averages pass@1
over the `heldout_structures` program structures the tasks belong to, each weighing the same (two structures fill
most difficulty-1 tasks).
`RTRL_BENCH_BASE=DIR` starts from that checkpoint instead of the default base model; `--set KEY=VALUE`
changes the recipe (`rtrl bench learn --set rl.kl_coef=0`; the result records it).
`base_passed_bits` / `rl_passed_bits` say which held-out tasks passed, in task order.
`train_curve_10_steps` has the run's pass rate, reward, malformed calls per episode, entropy and KL to the
reference, averaged over each 10 steps.
`minutes` is the RL run's wall time (worker start-up excluded; base-model building and the two
evaluations are reported separately). `--quick` runs the same path on a smoke-sized base model and a
few steps (a test runs it; its pass@1 figures mean nothing).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from statsmodels.stats.contingency_tables import mcnemar

from realtime_rl.config import ModelConfig, PretrainConfig, TokenizerTrainConfig, TrainConfig, load_config
from realtime_rl.environments.synthetic import split_size
from realtime_rl.evaluate.gate import tango_interval
from realtime_rl.rollout import train
from realtime_rl.train import ensure_base_model, pretrain
from realtime_rl.train.base_eval import EVAL_AGENT, heldout_pass_at_1
from realtime_rl.train.corpus import tasks_per_difficulty

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
EVAL_TASKS = 600
"""Held-out tasks, evaluated before and after. Seeded per task, 15% of them changed outcome one way or the
other in a 30-minute run (92 of 600; 29% unseeded); at that rate a paired lift of about 3.1 points is
significant at 600 tasks, one of 5.4 at 200."""
TRAIN_STRUCTURE_TASKS = 200
EVAL_ATTEMPTS = 4
"""Fresh attempts per held-out episode. On the round-robin base's first 200 seeded held-out tasks (the default
base until 45d2da1; 2026-11-27): pass@1 0.345 with 1 attempt, 0.625 with 4, 0.675 with 8 (evaluation 1.5, 1.9 and
2.6 minutes)."""


def smoke_base(run_dir: Path) -> Path:
    """A seconds-sized base model (for --quick runs and tests only)."""
    model = ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, tie_word_embeddings=False)
    result = pretrain(PretrainConfig(run_dir=run_dir, num_tasks=40, steps=20, batch_size=4, warmup_steps=2,
                                     checkpoint_every=20, model=model, tokenizer=TokenizerTrainConfig(vocab_size=1024),
                                     processes=1),  # starting a second process would take longer than the run
                      show_progress=False)
    return Path(result["checkpoint"])


def unseen_train_tasks(base: Path, num_tasks: int, max_difficulty: int, rollout_split: str = "train"
                       ) -> dict[str, Any] | None:
    """Arguments of heldout_pass_at_1 for num_tasks train-split tasks that pre-training of `base` never
    generated (it wrote tasks 0 .. n_d - 1 of each difficulty d, corpus.tasks_per_difficulty),
    or None when base has no pretrain.json or the split has too few tasks past those. A base built with
    `reserve_structures` never saw the reserved structures: its second evaluation is of their tasks 0, 1, ...
    of each difficulty, whichever split RL draws (with "train", pre-training cycled through every other
    difficulty-1 task, none of them fresh). RL on reserved structures from a base that saw them: None, as which
    of their tasks pre-training wrote is not recorded."""
    record = base / "pretrain.json"
    if not record.is_file():
        return None
    built = json.loads(record.read_text())["config"]
    if built.get("reserve_structures"):
        if num_tasks > min(split_size("reserved", d) for d in range(1, max_difficulty + 1)):
            return None
        return {"split": "reserved", "start": 0, "seed": built["seed"]}
    if rollout_split != "train":
        return None
    seen = tasks_per_difficulty(built["num_tasks"], built["max_difficulty"], built.get("difficulty_weights"))
    start = {d: seen.get(d, 0) for d in range(1, max_difficulty + 1)}
    if any(start[d] + num_tasks > split_size("train", d) for d in start):
        return None
    return {"split": "train", "start": start, "seed": built["seed"]}


def paired_lift(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """after - before on the same tasks (heldout_pass_at_1 reports): the difference, its paired 95%
    interval and McNemar's exact p-value (1.0 when no task changed outcome)."""
    was = {r["task_id"]: bool(r["passed"]) for r in before["per_task"]}
    now = {r["task_id"]: bool(r["passed"]) for r in after["per_task"]}
    if was.keys() != now.keys():
        raise ValueError("before and after must evaluate the same tasks")
    gained = sum(now[t] and not was[t] for t in was)
    lost = sum(was[t] and not now[t] for t in was)
    both = sum(now[t] and was[t] for t in was)
    table = [[both, lost], [gained, len(was) - both - lost - gained]]
    return {"lift": (gained - lost) / len(was), "ci95": list(tango_interval(gained, lost, len(was), 0.95)),
            "mcnemar_p": float(mcnemar(table, exact=True).pvalue) if gained + lost else 1.0,
            "gained": gained, "lost": lost}


def behaviour(report: dict[str, Any]) -> dict[str, Any]:
    """How the episodes of a heldout_pass_at_1 report ended, beyond pass/fail."""
    return {"failed_submits": report["failed_submits"], "out_of_turns": report["ended_by"].get("max_turns", 0),
            "malformed_tool_calls": report["malformed_tool_calls"], "mean_turns": report["mean_turns"],
            "repairs": report["repairs"]}


def base_and_recipe(quick: bool, tmp: Path, overrides: Sequence[str] = ()) -> tuple[Path, TrainConfig]:
    """The base model and the RL recipe (configs/train/default.toml, then the quick sizes, then `overrides`).
    The recipe is read first, so a bad override fails before a base model is built."""
    sizes = ["steps=2", "rl.group_size=2", "rl.groups_per_step=2", "rollout.episodes_in_flight=4",
             "rollout.agent.max_turns=2", "rollout.agent.max_new_tokens=32"] if quick else []
    config = load_config(TrainConfig, CONFIGS / "train" / "default.toml", [*sizes, *overrides])
    if os.environ.get("RTRL_BENCH_BASE"):
        base = Path(os.environ["RTRL_BENCH_BASE"])
    elif quick:
        base = smoke_base(tmp / "base")
    else:
        base = ensure_base_model(load_config(PretrainConfig, CONFIGS / "pretrain" / "default.toml"))
    return base, config.model_copy(update={"base_checkpoint": base, "run_dir": tmp / "train"})


CURVE = ("train/pass_rate", "train/reward_mean", "train/malformed_tool_calls", "train/entropy", "train/kl_ref")


def train_curve(history: list[dict[str, float]], window: int = 10) -> dict[str, list[float | None]]:
    """The RL run's metrics as means over consecutive windows of `window` steps: how pass rate, reward,
    malformed calls per episode, entropy and KL to the reference moved over the run. A step with no
    learning signal has no entropy or KL: those means are over the steps that have them (None if none)."""
    chunks = [history[i:i + window] for i in range(0, len(history), window)]
    curve: dict[str, list[float | None]] = {}
    for key in CURVE:
        values = [[m[key] for m in chunk if key in m] for chunk in chunks]
        curve[key.split("/")[1]] = [round(float(sum(v) / len(v)), 4) if v else None for v in values]
    return curve


def passed_bits(report: dict[str, Any]) -> str:
    """Which held-out tasks passed, one character per task in task order ("1" passed): two runs' base
    evaluations compare task by task (seeded, they must agree)."""
    return "".join("1" if r["passed"] else "0" for r in report["per_task"])


def first_attempts(report: dict[str, Any]) -> dict[str, Any]:
    """`report` as if only first attempts could pass: its per_task rows, passed where the first attempt
    passed."""
    return {"per_task": [{**r, "passed": r["passed"] and r["attempts"] == 1} for r in report["per_task"]]}


def eval_attempts() -> int:
    value = os.environ.get("RTRL_BENCH_ATTEMPTS", str(EVAL_ATTEMPTS))
    try:
        attempts = int(value)
    except ValueError:
        attempts = 0
    if not 1 <= attempts <= 100:
        raise ValueError(f"RTRL_BENCH_ATTEMPTS must be an integer from 1 to 100, got {value!r}")
    return attempts


def run(quick: bool = False, overrides: Sequence[str] = ()) -> dict[str, Any]:
    attempts = eval_attempts()
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-learn-") as tmp:
        t0 = time.perf_counter()
        base, config = base_and_recipe(quick, Path(tmp), overrides)
        base_build_minutes = (time.perf_counter() - t0) / 60
        difficulty = config.rollout.max_difficulty
        num_tasks, num_train = (4, 4) if quick else (EVAL_TASKS, TRAIN_STRUCTURE_TASKS)
        unseen = unseen_train_tasks(base, num_train, difficulty, config.rollout.split)
        agent = EVAL_AGENT.model_copy(update={"attempts": attempts})
        before = heldout_pass_at_1(base, num_tasks=num_tasks, max_difficulty=difficulty, agent=agent)
        greedy = heldout_pass_at_1(base, num_tasks=num_tasks, max_difficulty=difficulty,
                                   agent=EVAL_AGENT.model_copy(update={"temperature": 0.0}))
        before_train = (heldout_pass_at_1(base, num_train, difficulty, agent=agent, **unseen)
                        if unseen else None)
        threads = torch.get_num_threads()
        summary = train(config, show_progress=not quick)
        torch.set_num_threads(threads)  # train() sets the recipe's: the evaluations after run as those before
        after = heldout_pass_at_1(summary["checkpoint"], num_tasks=num_tasks, max_difficulty=difficulty,
                                  agent=agent)
        after_train = (heldout_pass_at_1(summary["checkpoint"], num_train, difficulty, agent=agent, **unseen)
                       if unseen else None)
    evals = [r for r in (before, greedy, after, before_train, after_train) if r]
    lift = paired_lift(before, after)
    first = paired_lift(first_attempts(before), first_attempts(after))
    return {
        "base_pass_at_1": before["pass_at_1"],
        "rl_pass_at_1": after["pass_at_1"],
        "lift": lift["lift"],
        "lift_ci95": lift["ci95"],
        "lift_mcnemar_p": lift["mcnemar_p"],
        "lift_gained_lost": [lift["gained"], lift["lost"]],
        "minutes": summary["minutes"],
        "eval_attempts": attempts,
        "base_first_attempt_pass_at_1": before["passed_by_attempt"].get(1, 0) / before["tasks"],
        "rl_first_attempt_pass_at_1": after["passed_by_attempt"].get(1, 0) / after["tasks"],
        "lift_first_attempt": {"lift": first["lift"], "ci95": first["ci95"], "mcnemar_p": first["mcnemar_p"],
                               "gained_lost": [first["gained"], first["lost"]]},
        "base_attempts": before["attempts"],
        "rl_attempts": after["attempts"],
        "base_passed_by_attempt": before["passed_by_attempt"],
        "rl_passed_by_attempt": after["passed_by_attempt"],
        "base_ci95": list(before["ci95"]),
        "rl_ci95": list(after["ci95"]),
        "base_by_difficulty": before["by_difficulty"],
        "rl_by_difficulty": after["by_difficulty"],
        "base_by_input_type": before["by_input_type"],
        "rl_by_input_type": after["by_input_type"],
        "base_behaviour": behaviour(before),
        "rl_behaviour": behaviour(after),
        "base_greedy_pass_at_1": greedy["pass_at_1"],
        "base_first_write": before["first_write"],
        "rl_first_write": after["first_write"],
        "base_first_write_failed": before["first_write_failed"],
        "rl_first_write_failed": after["first_write_failed"],
        "base_stage_comments": before["stage_comments"],
        "rl_stage_comments": after["stage_comments"],
        "heldout_structures": before["structures"],
        "base_structure_mean_pass_at_1": before["structure_mean_pass_at_1"],
        "rl_structure_mean_pass_at_1": after["structure_mean_pass_at_1"],
        "base_pass_at_1_train_structures": before_train["pass_at_1"] if before_train else None,
        "rl_pass_at_1_train_structures": after_train["pass_at_1"] if after_train else None,
        "lift_train_structures_ci95": paired_lift(before_train, after_train)["ci95"] if after_train else None,
        "base_by_difficulty_train_structures": before_train["by_difficulty"] if before_train else None,
        "rl_by_difficulty_train_structures": after_train["by_difficulty"] if after_train else None,
        "eval_tasks": before["tasks"],
        "base_passed_bits": passed_bits(before),
        "rl_passed_bits": passed_bits(after),
        "eval_tasks_train_structures": before_train["tasks"] if before_train else None,
        "train_structures_split": unseen["split"] if unseen else None,
        "rl_steps": summary["steps_this_run"],
        "train_reward_first": summary["reward_first"],
        "train_reward_last3": summary["reward_last_mean"],
        "train_curve_10_steps": train_curve(summary["history"]),
        "trainer_idle_fraction": summary["trainer_idle_fraction"],
        "rollout_tokens_per_s": summary["rollout_tokens_per_s"],
        "base_build_minutes": base_build_minutes,
        "eval_minutes": sum(r["minutes"] for r in evals),
    }
