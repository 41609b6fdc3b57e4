"""`rtrl bench learn`: does RL make the base model better on tasks it never trained on?

    base = the default base model (configs/pretrain/default.toml; built once, then reused)
    base_pass_at_1 = held-out pass@1 of base       (train/base_eval.py: held-out structures, T = 1.0)
    rtrl train with configs/train/default.toml      (asynchronous GRPO, router replay, real sandboxes)
    rl_pass_at_1 = held-out pass@1 of the result on the same tasks, same sampling

`RTRL_BENCH_BASE=DIR` starts from that checkpoint instead of the default base model.
`minutes` is the RL run's wall time (worker start-up excluded; base-model building and the two
evaluations are reported separately). `--quick` runs the same path on a smoke-sized base model and a
few steps (a test runs it; its pass@1 figures mean nothing).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from realtime_rl.config import ModelConfig, PretrainConfig, TokenizerTrainConfig, TrainConfig, load_config
from realtime_rl.rollout import train
from realtime_rl.train import ensure_base_model, pretrain
from realtime_rl.train.base_eval import heldout_pass_at_1

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
EVAL_TASKS = 200


def smoke_base(run_dir: Path) -> Path:
    """A seconds-sized base model (for --quick runs and tests only)."""
    model = ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, tie_word_embeddings=False)
    result = pretrain(PretrainConfig(run_dir=run_dir, num_tasks=40, steps=20, batch_size=4, warmup_steps=2,
                                     checkpoint_every=20, model=model, tokenizer=TokenizerTrainConfig(vocab_size=1024)),
                      show_progress=False)
    return Path(result["checkpoint"])


def base_and_recipe(quick: bool, tmp: Path) -> tuple[Path, TrainConfig]:
    overrides = []
    if quick:
        overrides += ["steps=2", "rl.group_size=2", "rl.groups_per_step=2", "rollout.episodes_in_flight=4",
                      "rollout.agent.max_turns=2", "rollout.agent.max_new_tokens=32"]
    if os.environ.get("RTRL_BENCH_BASE"):
        base = Path(os.environ["RTRL_BENCH_BASE"])
    elif quick:
        base = smoke_base(tmp / "base")
    else:
        base = ensure_base_model(load_config(PretrainConfig, CONFIGS / "pretrain" / "default.toml"))
    config = load_config(TrainConfig, CONFIGS / "train" / "default.toml", overrides)
    return base, config.model_copy(update={"base_checkpoint": base, "run_dir": tmp / "train"})


def run(quick: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-learn-") as tmp:
        t0 = time.perf_counter()
        base, config = base_and_recipe(quick, Path(tmp))
        base_build_minutes = (time.perf_counter() - t0) / 60
        num_tasks = 4 if quick else EVAL_TASKS
        before = heldout_pass_at_1(base, num_tasks=num_tasks, max_difficulty=config.rollout.max_difficulty)
        summary = train(config, show_progress=not quick)
        after = heldout_pass_at_1(summary["checkpoint"], num_tasks=num_tasks,
                                  max_difficulty=config.rollout.max_difficulty)
    return {
        "base_pass_at_1": before["pass_at_1"],
        "rl_pass_at_1": after["pass_at_1"],
        "minutes": summary["minutes"],
        "base_ci95": list(before["ci95"]),
        "rl_ci95": list(after["ci95"]),
        "base_by_difficulty": before["by_difficulty"],
        "rl_by_difficulty": after["by_difficulty"],
        "eval_tasks": before["tasks"],
        "rl_steps": summary["steps_this_run"],
        "train_reward_first": summary["reward_first"],
        "train_reward_last3": summary["reward_last_mean"],
        "trainer_idle_fraction": summary["trainer_idle_fraction"],
        "rollout_tokens_per_s": summary["rollout_tokens_per_s"],
        "base_build_minutes": base_build_minutes,
        "eval_minutes": before["minutes"] + after["minutes"],
    }
