"""`rtrl demo`: the most complete end-to-end job the code can run today, on a laptop-sized budget.

What it runs, in order, and says so:
1. generates synthetic coding tasks (train split for the corpus, held-out split to attempt);
2. continued pre-training, smoke-sized: a tokenizer and a corpus of real scripted agent episodes run
   through the sandbox, then masked next-token training of a tiny Qwen3-MoE, checkpointed in the
   Hugging Face layout;
3. serves that checkpoint with the continuous-batching engine, hot-swaps its weights once (as the
   trainer will), and lets it attempt the held-out tasks through the multi-turn agent loop, its
   `run_tests` calls in the warm sandbox pool, graded with pristine tests in fresh sandboxes;
4. replays one episode through the trainer's full-sequence forward with the engine's recorded MoE
   routing and reports the logprob mismatch (what RL with router replay relies on);
5. asynchronous RL, smoke-sized (`rtrl train`'s loop): a rollout worker process samples groups of
   episodes on synthetic train tasks, the trainer takes GRPO steps with router replay within a
   staleness bound, checkpoints, and publishes each version to the worker as a lossless weight delta.

A few minutes of CPU do not make a coding agent: pass@1 here is expected to be 0. The real base model
comes from `rtrl pretrain`, real RL from `rtrl train`; the real-time loop is issue 7.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from realtime_rl.config import AgentConfig, DemoConfig, PretrainConfig, RLConfig, RolloutConfig, SandboxConfig, TrainConfig
from realtime_rl.engine import AsyncEngine, Engine, EnginePolicy
from realtime_rl.environments import Sandbox, WarmPool, generate_tasks, grade, load_tasks, run_episode
from realtime_rl.model import load_checkpoint, sequence_logprobs
from realtime_rl.monitor import JsonlSink
from realtime_rl.rollout import train
from realtime_rl.train import pretrain


def _replay_mismatch(model: torch.nn.Module, segment: Any) -> float | None:
    """Max |trainer logprob - behaviour logprob| over the policy's tokens, replaying recorded routing."""
    mask = segment.loss_mask[1:]
    if segment.routing is None or mask.sum() == 0:
        return None
    lp, _ = sequence_logprobs(model, torch.from_numpy(segment.token_ids), torch.from_numpy(segment.routing))
    return float(np.abs(lp.cpu().numpy()[mask] - segment.logprobs[1:][mask]).max())


def run_demo(config: DemoConfig, console: Console | None = None) -> dict[str, Any]:
    console = console or Console()
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {}
    t0 = time.perf_counter()

    console.rule("1. synthetic tasks")
    heldout_dir = run_dir / "tasks-heldout"
    if not heldout_dir.exists():
        for d in (1, 2):
            generate_tasks(heldout_dir, -(-config.eval_tasks // 2), split="heldout", seed=config.seed, difficulty=d)
    tasks = load_tasks(heldout_dir)[: config.eval_tasks]
    report["tasks/heldout"] = len(tasks)

    console.rule("2. continued pre-training (smoke-sized)")
    pre = PretrainConfig(run_dir=run_dir / "pretrain", seed=config.seed, model=config.model,
                         tokenizer=config.tokenizer, num_tasks=config.train_tasks, steps=config.pretrain_steps,
                         batch_size=8, warmup_steps=min(10, config.pretrain_steps // 5), lr=5e-3,
                         checkpoint_every=config.pretrain_steps, log_every=max(1, config.pretrain_steps // 6))
    result = pretrain(pre)
    report.update({"pretrain/documents": result["documents"], "pretrain/loss": result.get("pretrain/loss", 0.0),
                   "pretrain/tokens_per_s": result.get("pretrain/tokens_per_s", 0.0)})
    ckpt = load_checkpoint(result["checkpoint"])
    assert ckpt.tokenizer is not None
    report["model/parameters"] = ckpt.model.num_parameters()

    console.rule("3. serve it, hot-swap once, attempt held-out tasks through the agent loop")
    engine = Engine(ckpt.model, ckpt.tokenizer, max_batch=4, max_seq_len=4096, seed=config.seed)
    agent = AgentConfig(max_turns=config.max_turns, max_new_tokens=config.max_new_tokens,
                        summary_trigger_tokens=3000, max_context_tokens=4096)
    sandbox = Sandbox(SandboxConfig())
    episodes = []
    with AsyncEngine(engine) as aengine, WarmPool(SandboxConfig(pool_size=1)) as pool:
        aengine.update_weights({k: v.clone() for k, v in ckpt.model.named_parameters()}, version=1)
        for i, task in enumerate(tasks):
            policy = EnginePolicy(aengine, temperature=1.0, seed=config.seed + i)
            ep = run_episode(policy, ckpt.tokenizer, task, pool, agent)
            ep.episode.passed = grade(task, ep.workspace.snapshot(), sandbox).passed
            episodes.append(ep.episode)
    report["serve/swap_pause_ms"] = engine.last_swap_pause_ms or 0.0
    report["agent/pass_at_1"] = sum(bool(e.passed) for e in episodes) / len(episodes)
    report["agent/mean_turns"] = sum(e.num_turns for e in episodes) / len(episodes)
    report["agent/tool_calls"] = sum(e.num_tool_calls for e in episodes)
    report["agent/malformed_tool_calls"] = sum(e.malformed_tool_calls for e in episodes)
    report["agent/tokens"] = sum(e.num_tokens for e in episodes)
    report["sandbox/isolation"] = sandbox.isolation_level.value

    console.rule("4. the trainer's view of an episode, with router replay")
    versions = {int(v) for e in episodes for s in e.segments for v in s.versions[s.loss_mask]}
    report["rl/token_versions"] = ",".join(map(str, sorted(versions)))
    mismatch = _replay_mismatch(ckpt.model, episodes[0].segments[0])
    if mismatch is not None:
        report["rl/max_abs_logprob_diff_replay"] = mismatch

    console.rule("5. asynchronous RL (smoke-sized): rollout worker, GRPO with router replay, delta weight sync")
    rl = train(TrainConfig(
        run_dir=run_dir / "rl", base_checkpoint=Path(result["checkpoint"]), seed=config.seed, steps=config.rl_steps,
        max_staleness=1, rl=RLConfig(group_size=4, groups_per_step=2, lr=1e-4, malformed_penalty=0.5),
        rollout=RolloutConfig(episodes_in_flight=8, max_difficulty=1, agent=agent)), show_progress=False)
    last = rl["history"][-1] if rl["history"] else {}
    report["rl/versions"] = rl["version"]
    report["rl/reward_first_last"] = f"{rl['reward_first']:.2f} -> {last.get('train/reward_mean', 0.0):.2f}"
    report["rl/staleness_max"] = max((h["train/staleness_max"] for h in rl["history"]), default=0.0)
    report["rl/trainer_idle_fraction"] = rl["trainer_idle_fraction"]
    report["rl/weight_delta_ratio"] = last.get("sync/delta_ratio", 0.0)
    mismatches = [h["train/mismatch_k3"] for h in rl["history"] if "train/mismatch_k3" in h]
    if mismatches:
        report["rl/engine_trainer_k3"] = max(mismatches)
    report["demo/minutes"] = (time.perf_counter() - t0) / 60

    sink = JsonlSink(run_dir / "metrics.jsonl")
    sink.log({k: v for k, v in report.items() if isinstance(v, (int, float))}, step=0)
    sink.close()
    table = Table(title="rtrl demo: what ran")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in report.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(table)
    console.print(f"checkpoint: {result['checkpoint']} (Hugging Face layout)")
    console.print("Ran: synthetic tasks; a tokenizer and a corpus of real sandboxed episodes; pre-training with "
                  "checkpoints; the engine (continuous batching, a hot weight swap, per-token versions and routing); "
                  "the multi-turn agent loop with tools; grading with pristine tests in fresh bubblewrap sandboxes; "
                  "router replay; asynchronous GRPO steps with a rollout worker, checkpoints and lossless weight "
                  "deltas.")
    console.print("A smoke-sized model does not solve tasks (pass@1 ~ 0); `rtrl pretrain` builds the real base "
                  "model and `rtrl train` runs real RL. Not yet: the real-time loop (issue 7).")
    report["checkpoint_dir"] = result["checkpoint"]
    return report
