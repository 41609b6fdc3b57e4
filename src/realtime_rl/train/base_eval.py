"""How good a base model is: pass@1 on held-out synthetic tasks through the real agent loop.

    report = heldout_pass_at_1("runs/pretrain/checkpoints/step-0001250", num_tasks=120, max_difficulty=2)
    report["pass_at_1"], report["ci95"], report["by_difficulty"]

The tasks are `generate_task(i, "heldout", seed, difficulty=d)` for d in 1..max_difficulty (the same
number of each): program structures never generated for training. Each task is one episode driven by
the engine (continuous batching over many concurrent episodes) sampling at the temperature RL samples
at (1.0, top_p 1.0 by default), and is graded in a fresh sandbox with the pristine visible and the
hidden tests. The 95% interval is Wilson's, over tasks.

Not here: pass@k for k > 1, real (Exercism) tasks; `rtrl eval` runs those.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from realtime_rl.config import AgentConfig, SandboxConfig
from realtime_rl.engine import AsyncEngine, Engine, EnginePolicy
from realtime_rl.environments import Sandbox, Task, WarmPool, generate_task, load_task
from realtime_rl.evaluate import evaluate_policy
from realtime_rl.model import load_checkpoint

EVAL_AGENT = AgentConfig(max_turns=8, max_new_tokens=384, summary_trigger_tokens=3072, max_context_tokens=4096,
                         max_summaries=0)
"""Enough turns for write, test, fix, test, submit (and one more try); a runaway turn is cut at 384 tokens."""


def heldout_tasks(root: Path, num_tasks: int, max_difficulty: int, seed: int, split: str = "heldout",
                  start: int = 0) -> list[Task]:
    """num_tasks tasks of `split` written under root: indices start, start + 1, ... of each difficulty
    1..max_difficulty, as evenly as num_tasks allows (lower difficulties take the remainder)."""
    tasks = []
    for d in range(1, max_difficulty + 1):
        count = num_tasks // max_difficulty + (d <= num_tasks % max_difficulty)
        tasks += [load_task(generate_task(i, split, seed, difficulty=d).write(root))
                  for i in range(start, start + count)]
    return tasks


def wilson_interval(passed: int, total: int, z: float = 1.96) -> tuple[float, float]:
    if total == 0:
        return 0.0, 1.0
    p = passed / total
    center = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return max(0.0, center - half), min(1.0, center + half)


def heldout_pass_at_1(checkpoint: str | Path, num_tasks: int = 120, max_difficulty: int = 2, seed: int = 0,
                      temperature: float = 1.0, top_p: float = 1.0, agent: AgentConfig = EVAL_AGENT,
                      concurrency: int = 16, threads: int | None = None, split: str = "heldout",
                      start: int = 0) -> dict[str, Any]:
    """Run one episode per held-out task with the checkpoint's model and grade it (visible + hidden tests).
    `split` and `start` pick other tasks (fresh train-split ones for a model trained on first turns only).

    Returns pass_at_1, passed, tasks, ci95 (Wilson), by_difficulty {d: pass_at_1}, ended_by counts, mean
    turns, malformed tool calls, failed submits (submitted and failed the tests) and the wall time.
    """
    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    ckpt = load_checkpoint(checkpoint, dtype=torch.float32)
    if ckpt.tokenizer is None:
        raise ValueError(f"{checkpoint}: the checkpoint has no tokenizer.json; the agent needs one")
    engine = Engine(ckpt.model, ckpt.tokenizer, max_batch=concurrency, max_seq_len=agent.max_context_tokens,
                    seed=seed)
    with tempfile.TemporaryDirectory() as tmp, AsyncEngine(engine, max_pending=4 * concurrency) as aengine, \
            WarmPool(SandboxConfig(pool_size=2)) as pool:
        tasks = heldout_tasks(Path(tmp), num_tasks, max_difficulty, seed, split, start)

        def make_policy(i: int) -> EnginePolicy:
            return EnginePolicy(aengine, temperature=temperature, top_p=top_p, seed=None)

        report = evaluate_policy(tasks, make_policy, ckpt.tokenizer, pool, Sandbox(SandboxConfig()), agent,
                                 samples=1, workers=concurrency, include_hidden=True).to_json()
    per_task = report["per_task"]
    difficulty = {t.task_id: t.metadata["difficulty"] for t in tasks}
    by_difficulty: dict[int, list[int]] = {}
    for r in per_task:
        by_difficulty.setdefault(difficulty[r["task_id"]], []).append(r["passed"])
    episodes = [e for r in per_task for e in r["episodes"]]
    passed = sum(r["passed"] for r in per_task)
    return {
        "pass_at_1": passed / len(per_task),
        "passed": passed,
        "tasks": len(per_task),
        "ci95": wilson_interval(passed, len(per_task)),
        "by_difficulty": {d: sum(v) / len(v) for d, v in sorted(by_difficulty.items())},
        "ended_by": dict(Counter(e["ended_by"] for e in episodes)),
        "mean_turns": sum(e["turns"] for e in episodes) / len(episodes),
        "malformed_tool_calls": sum(e["malformed_tool_calls"] for e in episodes),
        "failed_submits": sum(e["ended_by"] == "submit" and not e["passed"] for e in episodes),
        "minutes": (time.perf_counter() - t0) / 60,
        "per_task": per_task,
    }
