"""`rtrl bench vs-trl`: our RL trainer against TRL's GRPOTrainer, minutes to the same pass@1.

Both start from the same base model (the demo's: first-turn coding replies; transformers loads it as
Qwen3-MoE), see the same stream of fresh synthetic tasks in the same order (train split, difficulty 1,
indices from TASK_START; the base never trained on them), sample 8 replies per task at T = 1 with up to
Setup.max_new_tokens tokens, and are paid by the same function: the reply runs through the agent loop's
first turn (its tool calls act on the task's files) and is graded with the visible and hidden tests in a
fresh bubblewrap sandbox (1 if they pass), as our rollout workers grade: the light runner (pytest where it
falls back), each distinct workspace once (`GradeCache`). The algorithm is the same on both sides:
GRPO advantages (group mean, std-normalised), token-level (DAPO) aggregation, PPO clip 0.2 / 0.28, no KL,
no MoE auxiliary loss, one pass per batch of 4 tasks x 8 replies, AdamW at LR. Each side gets the whole
machine (ours: the recipe's rollout workers, one thread each, sharing the 32 episodes in flight, and one
trainer thread, asynchronous with the recipe's staleness bound; TRL: two torch threads, its generate /
score / train loop) for BUDGET_MINUTES of training (model loading excluded on both sides). `--set` may
change how ours spreads over the machine (MACHINE_FIELDS, e.g. `--set rollout.workers=2`), nothing else.

Progress is measured the same way for both: the policy is snapshotted at SNAPSHOT_FRACTIONS of the budget
(vs_trl_curves.py, with the curve arithmetic; ours: the checkpoint of the last step before the mark, which our
trainer writes anyway; TRL: saved by a
callback, its saving time taken off TRL's clock), and every snapshot and the base are evaluated afterwards
by one harness (our engine, the first turn, T = 1) on the same EVAL_TASKS fresh tasks. The target is the
base's pass@1 + TARGET_GAIN; `*_minutes_to_target` interpolates linearly between the snapshots on either
side of it; `ratio` = TRL's / ours (a lower bound, flagged, when TRL does not reach it in the budget).
`*_monotone` are the same read off each curve's isotonic fit (`monotone`), so that one snapshot's noise at
the target does not decide the crossing. `ratio_ci95` and `ratio_monotone_ci95` bootstrap both over the
evaluation's tasks (`ratio_intervals`); `eval_passed` keeps every evaluation's per-task outcomes.
Each step's pass rate on its new tasks is reported too (an on-policy estimate, but 4 tasks per step make
it noisy).

`RTRL_BENCH_BASE=DIR` starts from another checkpoint; `RTRL_BENCH_MINUTES` and `RTRL_BENCH_GAIN` override
the budget and the gain. `--quick` runs both paths for two steps on a smoke-sized model (a test does).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from realtime_rl.bench.vs_trl_curves import crossings, marks, monotone, per_step, ratio_intervals, snapshot_steps
from realtime_rl.config import AgentConfig, SandboxConfig, TrainConfig, load_config
from realtime_rl.environments import Sandbox, Task, WarmPool, generate_task, load_task, run_episode
from realtime_rl.environments.grading import grade_settled
from realtime_rl.environments.agent_loop import PolicyOutput, first_turn_messages
from realtime_rl.environments.grading import GradeCache
from realtime_rl.environments.synthetic import split_size
from realtime_rl.environments.tools import TOOL_SCHEMAS
from realtime_rl.model import load_checkpoint
from realtime_rl.model.chat import render_messages
from realtime_rl.model.tokenizer import Tokenizer

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
TASK_START = 4000
"""Train-split difficulty-1 tasks 4000.. : past the demo base model's corpus (0..3999)."""
EVAL_START = 6400
"""The evaluation's tasks: the training stream of a budget up to 20 minutes (its step cap, budget /
MIN_STEP_S, times 4 tasks) ends before them; `check_task_ranges` refuses a longer `RTRL_BENCH_MINUTES`
before anything runs."""
EVAL_TASKS = 500
"""+-4.4 points at 95% per snapshot (200 gave +-7, and the crossing swung by minutes on one snapshot);
tasks 6400..6899 of the 6,912 distinct train-split difficulty-1 ones (`check_task_ranges`). The 19
evaluations take ~6 minutes per 200 tasks on 2 cores."""
LR = 1e-4
BUDGET_MINUTES = 20.0
"""12 until 2026-11-25: TRL had not reached the target in it on 2 cores (the ratio was a lower bound)."""
TARGET_GAIN = 0.10
MIN_STEP_S = 2.0
"""The step cap (tasks prepared) is budget / this, so that neither side runs out of tasks before the budget
ends while its steps take longer. The fresh tasks bound it: 600 steps of 4 are tasks 4000..6399, up to the
evaluation's. A side that reaches the cap stops there and its curve ends at its last step: ours, at 1.88 s a
step on 2 cores (commit 9933c7d, 2026-11-25), reached it at 18.8 of 20 minutes (TRL: 8.0 s a step). That
leaves its crossing (2-5 minutes) untouched; a longer budget needs a smaller TASK_START (a base trained on
fewer tasks) or more tasks per step, not a smaller MIN_STEP_S."""


@dataclass(frozen=True)
class Setup:
    """What both trainers are given; QUICK is the smoke-sized one a test runs."""

    group_size: int = 8
    tasks_per_step: int = 4
    max_new_tokens: int = 300

    @property
    def agent(self) -> AgentConfig:
        return AgentConfig(max_turns=1, max_new_tokens=self.max_new_tokens, summary_trigger_tokens=3072,
                           max_context_tokens=4096)


FULL, QUICK = Setup(), Setup(group_size=4, tasks_per_step=2, max_new_tokens=48)

# ----------------------------------------------------------------------------------- tasks and reward

def task_at(index: int, root: Path) -> Task:
    return load_task(generate_task(index, "train", 0, difficulty=1).write(root))


def first_turn_prompt(task: Task) -> str:
    """Exactly the context the agent loop gives the policy before its first reply."""
    return render_messages(first_turn_messages(task), TOOL_SCHEMAS, add_generation_prompt=True)


class _Replay:
    """A policy that 'generates' a reply sampled elsewhere (by TRL), so it runs through the same agent loop."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids

    def generate(self, context_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> PolicyOutput:
        ids = self.token_ids[:max_new_tokens]
        return PolicyOutput(ids, [0.0] * len(ids), [0] * len(ids))


class FirstTurnReward:
    """1.0 when the reply's tool calls leave files that pass the visible and hidden tests, else 0.0: the
    agent loop's first turn (as our rollout workers run it with max_turns 1) and the grader they use."""

    def __init__(self, tokenizer: Tokenizer, root: Path, agent: AgentConfig, workers: int = 16) -> None:
        self.tokenizer, self.root, self.agent = tokenizer, root, agent
        self.pool = WarmPool(SandboxConfig(pool_size=2))
        self.grader = GradeCache(Sandbox(SandboxConfig(test_runner="light")))  # as our rollout workers grade
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="trl-reward")
        self._tasks: dict[int, Task] = {}
        self._lock = threading.Lock()

    def task(self, index: int) -> Task:
        with self._lock:
            if index not in self._tasks:
                self._tasks[index] = task_at(index, self.root)
            return self._tasks[index]

    def one(self, index: int, completion_ids: list[int]) -> float:
        task = self.task(index)
        result = run_episode(_Replay(completion_ids), self.tokenizer, task, self.pool, self.agent)
        # graded as our rollout workers grade (a timed-out run once more): the same reward function on both sides
        return float(grade_settled(task, result.workspace.snapshot(), self.grader, include_hidden=True,
                                   timeout_s=self.agent.test_timeout_s).passed)

    def batch(self, indices: list[int], completion_ids: list[list[int]]) -> list[float]:
        return list(self.executor.map(self.one, indices, completion_ids))

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        self.pool.close()


# ------------------------------------------------------------------------------------------ ours

MACHINE_FIELDS = ("max_staleness", "threads", "rollout.workers", "rollout.threads_per_worker",
                  "rollout.backend", "rollout.queued_groups", "rollout.compile_decode", "rollout.cascade_decode",
                  "rollout.prefix_max_age")
"""The recipe fields `--set` may change on ours' side: how it spreads over the machine, not what it learns
from or how (the tasks, the sampling and the algorithm are the bench's, the same on both sides)."""


def ours_recipe(overrides: Sequence[str] = (), setup: Setup = FULL) -> TrainConfig:
    """The RL recipe (configs/train/default.toml) with `overrides` of MACHINE_FIELDS only, checked before
    anything runs: its workers must split the setup's episodes in flight evenly."""
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key not in MACHINE_FIELDS:
            raise ValueError(f"vs-trl --set {key}: only how ours uses the machine may change "
                             f"({', '.join(MACHINE_FIELDS)}); the tasks, sampling and algorithm are the "
                             "bench's")
    config = load_config(TrainConfig, CONFIGS / "train" / "default.toml", list(overrides))
    if (setup.group_size * setup.tasks_per_step) % config.rollout.workers:
        raise ValueError(f"vs-trl: {setup.group_size * setup.tasks_per_step} episodes in flight do not split "
                         f"over {config.rollout.workers} workers")
    return config


def run_ours(base: Path, run_dir: Path, setup: Setup, steps: int, budget: float,
             config: TrainConfig, eval_tasks: int) -> dict[str, Any]:
    """Ours' side on `config` (from ours_recipe), with the bench's tasks, sampling and algorithm."""
    from realtime_rl.rollout import train

    in_flight = setup.group_size * setup.tasks_per_step
    config = config.model_copy(update={
        "base_checkpoint": base, "run_dir": run_dir, "steps": steps, "max_minutes": budget,
        "checkpoint_keep": steps + 1,
        "rl": config.rl.model_copy(update={"lr": LR, "lr_decay_steps": None, "group_size": setup.group_size,
                                           "groups_per_step": setup.tasks_per_step,
                                           "clip_low": 0.2, "clip_high": 0.28, "kl_coef": 0.0, "ppo_epochs": 1,
                                           "minibatches": 1, "negative_weight": 1.0, "std_normalize": True,
                                           "leave_one_out": False, "loss_aggregation": "token",
                                           "malformed_penalty": 0.0}),  # TRL's side: token-mean, pass/fail
        "rollout": config.rollout.model_copy(update={"max_difficulty": 1, "first_task": TASK_START,
                                                     "episodes_in_flight": in_flight // config.rollout.workers,
                                                     "temperature": 1.0, "agent": setup.agent}),
    })
    summary = train(config, show_progress=False)
    handed_out = check_trained_tasks(config, eval_tasks)
    history = summary["history"]
    minutes = [m["train/minutes"] for m in history]
    first = summary["version"] - len(history)
    snapshots = [(minutes[i], str(run_dir / "checkpoints" / f"v-{first + i + 1:07d}"))
                 for i in snapshot_steps(minutes, budget)]  # checkpoint_keep keeps them all
    return {"snapshots": snapshots, "steps": summary["steps_this_run"], "minutes": summary["minutes"],
            "step_minutes": minutes, "pass_rates": [m["train/pass_rate"] for m in history],
            "trainer_idle_fraction": summary["trainer_idle_fraction"],
            "rollout_tokens_per_s": summary["rollout_tokens_per_s"], "max_staleness": config.max_staleness,
            "rollout_workers": config.rollout.workers, "dropped_stale_groups": summary["dropped_stale_groups"],
            "tasks_handed_out": handed_out}


# ------------------------------------------------------------------------------------------- TRL

def run_trl(base: Path, out_dir: Path, setup: Setup, steps: int, budget: float, threads: int) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    ours = load_checkpoint(base, dtype=torch.float32).tokenizer
    if ours is None:
        raise ValueError(f"{base}: the checkpoint has no tokenizer.json")
    hf_tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.generation_config.eos_token_id = list(ours.stop_token_ids)
    model.generation_config.pad_token_id = hf_tokenizer.pad_token_id
    reward = FirstTurnReward(ours, out_dir / "tasks", setup.agent)
    indices = [TASK_START + i for i in range(steps * setup.tasks_per_step)]
    prompts = [first_turn_prompt(reward.task(i)) for i in indices]
    for prompt in prompts[:setup.tasks_per_step]:  # TRL tokenizes the text itself: it must see our token ids
        if hf_tokenizer(text=prompt)["input_ids"] != ours.encode(prompt):
            raise RuntimeError("transformers' tokenizer and ours disagree on the prompt tokens")
    step_pass: list[float] = []
    step_minutes: list[float] = []

    def pass_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                    task_index: list[int], **_: Any) -> list[float]:
        rewards = reward.batch(task_index, completion_ids)
        step_pass.append(float(np.mean(rewards)))
        return rewards

    snapshots: list[tuple[float, str]] = []
    pending = marks(budget)

    class Clock(TrainerCallback):
        """Training minutes (snapshot saving excluded); snapshots at the marks; stops at the budget."""

        t0 = paused = 0.0

        def minutes(self) -> float:
            return (time.perf_counter() - self.t0 - self.paused) / 60

        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):  # noqa: ANN001, ANN003
            step_minutes.append(self.minutes())
            last = step_minutes[-1] >= budget or state.global_step >= steps
            if pending and (step_minutes[-1] >= pending[0] or last):
                while pending and step_minutes[-1] >= pending[0]:
                    pending.pop(0)
                t = time.perf_counter()
                path = out_dir / f"snapshot-{state.global_step:05d}"
                model.save_pretrained(path)
                for name in ("tokenizer.json", "tokenizer_config.json"):
                    shutil.copy(base / name, path / name)
                snapshots.append((step_minutes[-1], str(path)))
                self.paused += time.perf_counter() - t
            if last:
                control.should_training_stop = True

    args = GRPOConfig(
        output_dir=str(out_dir / "trl"), learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0,
        per_device_train_batch_size=setup.group_size * setup.tasks_per_step, gradient_accumulation_steps=1,
        num_generations=setup.group_size, max_completion_length=setup.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, router_aux_loss_coef=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group",
        num_iterations=1,
        max_steps=steps, shuffle_dataset=False, use_cpu=True, bf16=False, fp16=False, seed=0, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
        gradient_checkpointing=False,  # TRL's default recomputes activations; a 3M model needs no memory saving
    )
    trainer = GRPOTrainer(model=model, reward_funcs=pass_reward, args=args, processing_class=hf_tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": prompts, "task_index": indices}),
                          callbacks=[Clock()])
    try:
        trainer.train()
    finally:
        reward.close()
    n = min(len(step_minutes), len(step_pass))
    return {"snapshots": snapshots, "steps": n, "minutes": step_minutes[-1] if step_minutes else 0.0,
            "step_minutes": step_minutes[:n], "pass_rates": step_pass[:n]}


# ------------------------------------------------------------------------------------------- run

def pass_at_1(checkpoint: str | Path, num_tasks: int, agent: AgentConfig) -> dict[str, Any]:
    from realtime_rl.bench.learn import passed_bits
    from realtime_rl.train.base_eval import heldout_pass_at_1

    r = heldout_pass_at_1(checkpoint, num_tasks=num_tasks, max_difficulty=1, split="train", start=EVAL_START,
                          agent=agent)
    return {"pass_at_1": r["pass_at_1"], "ci95": list(r["ci95"]), "malformed": r["malformed_tool_calls"],
            "passed": passed_bits(r)}


def check_task_ranges(steps: int, tasks_per_step: int, eval_tasks: int) -> None:
    """Before anything runs: the training stream (TASK_START..) and the evaluation's tasks (EVAL_START..) must
    exist and must not meet, or a run would fail (or evaluate on trained tasks) after its training."""
    available = split_size("train", 1)
    last_trained = TASK_START + steps * tasks_per_step
    if last_trained > EVAL_START or EVAL_START + eval_tasks > available:
        raise ValueError(f"vs-trl: training tasks {TASK_START}..{last_trained - 1} and evaluation tasks "
                         f"{EVAL_START}..{EVAL_START + eval_tasks - 1} must not overlap and must lie within the "
                         f"{available} distinct train tasks of difficulty 1")


def check_trained_tasks(config: TrainConfig, eval_tasks: int) -> int:
    """After ours' run: the tasks it handed out (trajectories/tasks_handed_out) are none of the evaluation's.
    check_task_ranges counts steps x tasks_per_step, but a group dropped as stale, refused or failed moves the
    stream on by one task, which could reach EVAL_START; the evaluation would then measure trained tasks. The
    number handed out."""
    from realtime_rl.rollout import TrajectoryLog
    from realtime_rl.rollout.orchestrator import task_difficulty, task_index

    handed_out = TrajectoryLog(Path(config.run_dir) / "trajectories").tasks_handed_out() or 0
    trained = {task_index(k, config.rollout) for k in range(handed_out)
               if task_difficulty(k, config.rollout) == 1}
    shared = sorted(trained & set(range(EVAL_START, EVAL_START + eval_tasks)))
    if shared:  # handed out: trained, or in flight when the run ended; no run is trusted that may have trained one
        raise ValueError(f"vs-trl: ours' run handed out {handed_out} tasks (groups dropped, refused or failed move "
                         f"the stream on), {len(shared)} of them the evaluation's, from {shared[0]}: "
                         "shorten RTRL_BENCH_MINUTES or lower max_staleness")
    return handed_out


def demo_base() -> Path:
    from realtime_rl.config.demo import DemoConfig
    from realtime_rl.train import ensure_base_model

    pretrain = DemoConfig().pretrain
    return ensure_base_model(pretrain.model_copy(update={"run_dir": Path("runs/demo/pretrain")}))


def run(quick: bool = False, overrides: Sequence[str] = ()) -> dict[str, Any]:
    setup = QUICK if quick else FULL
    recipe = ours_recipe(overrides, setup)
    budget = float(os.environ.get("RTRL_BENCH_MINUTES", 1.0 if quick else BUDGET_MINUTES))
    gain = float(os.environ.get("RTRL_BENCH_GAIN", 0.0 if quick else TARGET_GAIN))
    steps = 2 if quick else int(budget * 60 / MIN_STEP_S)
    eval_tasks = 4 if quick else EVAL_TASKS
    check_task_ranges(steps, setup.tasks_per_step, eval_tasks)
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-vs-trl-") as tmp_name:
        tmp = Path(tmp_name)
        if os.environ.get("RTRL_BENCH_BASE"):
            base = Path(os.environ["RTRL_BENCH_BASE"])
        elif quick:
            from realtime_rl.bench.learn import smoke_base
            base = smoke_base(tmp / "base")
        else:
            base = demo_base()
        threads = torch.get_num_threads()
        ours = run_ours(base, tmp / "ours", setup, steps, budget, recipe, eval_tasks)
        trl = run_trl(base, tmp / "trl", setup, steps, budget, threads=max(2, threads))
        torch.set_num_threads(threads)
        base_eval = pass_at_1(base, eval_tasks, setup.agent)
        evals = {side: [(m, pass_at_1(path, eval_tasks, setup.agent)) for m, path in run["snapshots"]]
                 for side, run in (("ours", ours), ("trl", trl))}
    target = base_eval["pass_at_1"] + gain
    curves = {side: [(0.0, base_eval["pass_at_1"])] + [(m, e["pass_at_1"]) for m, e in evals[side]]
              for side in evals}
    fits = {side: monotone(curve) for side, curve in curves.items()}
    outcomes = {side: [[m, e["passed"]] for m, e in evals[side]] for side in evals}

    def passed(bits: str) -> np.ndarray:
        return np.frombuffer(bits.encode(), dtype=np.uint8) == ord("1")

    return {
        **crossings(curves, target, trl["minutes"]),
        **crossings(fits, target, trl["minutes"], "_monotone"),
        **ratio_intervals(passed(base_eval["passed"]),
                          {side: [(m, passed(bits)) for m, bits in runs] for side, runs in outcomes.items()},
                          gain, trl["minutes"]),
        "eval_passed": {"base": base_eval["passed"], **outcomes},
        "target_pass_at_1": target,
        "base_pass_at_1": base_eval["pass_at_1"],
        "budget_minutes": budget,
        "eval_tasks": eval_tasks,
        "ours_curve": curves["ours"],
        "trl_curve": curves["trl"],
        "ours_final_pass_at_1": curves["ours"][-1][1],
        "trl_final_pass_at_1": curves["trl"][-1][1],
        "ci95": {"base": base_eval["ci95"], "ours": evals["ours"][-1][1]["ci95"], "trl": evals["trl"][-1][1]["ci95"]},
        "malformed": {"base": base_eval["malformed"], "ours": evals["ours"][-1][1]["malformed"],
                      "trl": evals["trl"][-1][1]["malformed"]},
        "ours_steps": ours["steps"],
        "trl_steps": trl["steps"],
        "ours_minutes_per_step": ours["minutes"] / max(ours["steps"], 1),
        "trl_minutes_per_step": trl["minutes"] / max(trl["steps"], 1),
        "step_rate_ratio": (ours["steps"] / ours["minutes"]) / (trl["steps"] / trl["minutes"]),
        "per_step_pass_rate_diff": per_step(ours["pass_rates"], trl["pass_rates"]),
        "ours_step_pass_rates": ours["pass_rates"],
        "trl_step_pass_rates": trl["pass_rates"],
        "ours_step_minutes": ours["step_minutes"],
        "trl_step_minutes": trl["step_minutes"],
        "ours_trainer_idle_fraction": ours["trainer_idle_fraction"],
        "ours_max_staleness": ours["max_staleness"],
        "ours_dropped_stale_groups": ours["dropped_stale_groups"],
        "ours_tasks_handed_out": ours["tasks_handed_out"],
        "ours_rollout_workers": ours["rollout_workers"],
    }
