"""`rtrl bench trainer`: one RL step of our trainer against the step TRL's GRPOTrainer takes, on one batch.

The batch is shaped like a step of the default recipe (configs/train/default.toml): 4 groups of 8
episodes; every episode starts with one system prompt (591 tokens, the corpus's system prompt and tool
schemas) and its group's task prompt (90), then 1-4 turns, each a reply (trained, 30-120 tokens) and a
tool result (context, 20-80). Token ids are random (a forward costs the same for any ids). The
behaviour logprobs and the routing are the base model's own, recorded ahead of the timing by one no-grad
forward per episode, the prompts' routing shared as the engine's prefix cache shares it; half of each
group passes. Each step trains the same batch again: the first at ratio 1, later ones against the drift of
the steps before (on random tokens IcePop masks about a third of them), which changes no step's cost.

Ours: `RLTrainer.step` with the recipe's loss (decoupled PPO clip, TIS, IcePop, k3 KL to the base, router
replay), its micro-batches and shared prefixes. TRL: `GRPOTrainer.compute_loss` on the same episodes as
TRL lays them out (the prompt, whose rows here are all one length, then the turns right-padded as one
completion, the tool results masked by `tool_mask`), with the reference model's logprobs it computes before
the loss (`beta` = the recipe's kl_coef), then its loss (TRL's default, token-level "dapo"; ours aggregates
by episode: the same cost), backward, gradient clipping and its AdamW step; its forward takes the batch's rows
at once (per_device_train_batch_size = the batch, as `rtrl bench vs-trl` runs it). Steps alternate (ours,
TRL) and the first of each is a warm-up; `ours_step_s` / `trl_step_s` are the medians of the rest and
`speedup_vs_trl_min` the ratio of the fastest (TRL's steps speed up over the first few). Both run on the
recipe's `rl.device` (`RTRL_BENCH_DEVICE` wins; default cpu), in fp32 or, with `rl.dtype` (or
`RTRL_BENCH_DTYPE`) bfloat16, under bf16 autocast over fp32 weights (TRL's bf16 mixed precision). `--set
rl.KEY=VALUE` changes our side's recipe (micro-batch size, shared runs). The base: `RTRL_BENCH_BASE`, else the
default base model (built once and cached); `--quick`: a seconds-sized base and a small batch.
`RTRL_BENCH_PROFILE=1`: one more step of each under torch.profiler (`ours_profile`, `trl_profile`: aten ops,
kernel launches, device syncs, reads of a device value, the ops with the most self time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from realtime_rl.bench import device_and_dtype
from realtime_rl.bench.learn import base_and_recipe
from realtime_rl.model import load_checkpoint, sequence_logprobs
from realtime_rl.train import RLTrainer
from realtime_rl.types import Episode, Segment


@dataclasses.dataclass(frozen=True)
class Shape:
    """The batch: groups x group_size episodes, their prompts' and turns' lengths (ranges inclusive)."""

    groups: int = 4
    group_size: int = 8
    system: int = 591
    task: int = 90
    turns: tuple[int, int] = (1, 4)
    reply: tuple[int, int] = (30, 120)
    tool: tuple[int, int] = (20, 80)


FULL = Shape()
QUICK = Shape(groups=2, group_size=2, system=40, task=8, turns=(1, 2), reply=(4, 8), tool=(3, 6))


def grpo_batch(base: Path, shape: Shape, seed: int = 0) -> list[Episode]:
    """The episodes of one step (versions 0), with the base model's behaviour logprobs and routing."""
    model = load_checkpoint(base, dtype=torch.float32).model.eval()
    vocab = model.config.vocab_size
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, shape.system)
    episodes = []
    shared_routing: dict[int, np.ndarray] = {}  # group -> its prompt's routing (the first episode's)
    for g in range(shape.groups):
        prompt = np.concatenate([system, rng.integers(0, vocab, shape.task)])
        for i in range(shape.group_size):
            parts, trained = [prompt], [np.zeros(len(prompt), dtype=bool)]
            for _ in range(int(rng.integers(shape.turns[0], shape.turns[1] + 1))):
                for span, is_reply in ((shape.reply, True), (shape.tool, False)):
                    n = int(rng.integers(span[0], span[1] + 1))
                    parts.append(rng.integers(0, vocab, n))
                    trained.append(np.full(n, is_reply))
            ids, mask = np.concatenate(parts).astype(np.int32), np.concatenate(trained)
            with torch.no_grad():
                lp, routing = sequence_logprobs(model, torch.from_numpy(ids.astype(np.int64)))
            logprobs = np.concatenate([[0.0], lp.numpy()]).astype(np.float32) * mask
            route = None
            if routing is not None:
                route = np.concatenate([routing.numpy(), np.zeros_like(routing[:1].numpy())])
                first = shared_routing.setdefault(g, route[:len(prompt)].copy())
                if g:  # the system prompt as the first group computed it, the task prompt as this group's first
                    first[:shape.system] = shared_routing[0][:shape.system]
                route[:len(prompt)] = first
            versions = np.where(mask, 0, -1).astype(np.int32)
            segment = Segment(ids, mask, logprobs, versions, route, temperature=1.0)
            episodes.append(Episode(f"g{g}-e{i}", f"task-{g}", [segment], "submit", 1, 1, 0, 0,
                                    group_id=f"g{g}", passed=i % 2 == 0))
    return episodes


def fresh(episodes: list[Episode], step: int, version: int) -> list[Episode]:
    """The batch again under new episode ids, its tokens generated by `version` (the trainer refuses an
    episode twice and measures staleness from the versions)."""
    out = []
    for e in episodes:
        segments = [dataclasses.replace(s, versions=np.where(s.loss_mask, version, -1).astype(np.int32))
                    for s in e.segments]
        out.append(dataclasses.replace(e, episode_id=f"{e.episode_id}-s{step}", group_id=f"{e.group_id}-s{step}",
                                       segments=segments))
    return out


def trl_inputs(episodes: list[Episode], group_size: int, prompt_len: int, pad_id: int, device: torch.device
               ) -> dict[str, torch.Tensor]:
    """GRPOTrainer's inputs to compute_loss for `episodes`: prompt ids left-padded, completion right-padded,
    tool results masked out (tool_mask 0), group-normalised advantages (scale_rewards="group")."""
    seqs = [e.segments[0] for e in episodes]
    B, C = len(seqs), max(len(s.token_ids) for s in seqs) - prompt_len
    prompt_ids = torch.tensor(np.stack([s.token_ids[:prompt_len] for s in seqs]), dtype=torch.long)
    completion = torch.full((B, C), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((B, C), dtype=torch.long)
    tool_mask = torch.zeros((B, C), dtype=torch.long)
    for b, s in enumerate(seqs):
        n = len(s.token_ids) - prompt_len
        completion[b, :n] = torch.from_numpy(s.token_ids[prompt_len:].astype(np.int64))
        completion_mask[b, :n] = 1
        tool_mask[b, :n] = torch.from_numpy(s.loss_mask[prompt_len:].astype(np.int64))
    rewards = torch.tensor([float(e.passed) for e in episodes])
    groups = rewards.view(-1, group_size)  # the episodes in group order, as grpo_batch makes them
    advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).flatten()
    return {k: v.to(device) for k, v in {
        "prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion,
        "completion_mask": completion_mask, "tool_mask": tool_mask, "advantages": advantages,
        "num_items_in_batch": (completion_mask * tool_mask).sum()}.items()}


class TRLStep:
    """GRPOTrainer's optimisation of one generation batch, without its generation: the reference logprobs,
    compute_loss, backward, gradient clipping, AdamW."""

    def __init__(self, base: Path, beta: float, device: torch.device, dtype: torch.dtype, out_dir: Path,
                 rows: int, group_size: int) -> None:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer

        tokenizer = AutoTokenizer.from_pretrained(base)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        args = GRPOConfig(
            output_dir=str(out_dir), learning_rate=1e-4, lr_scheduler_type="constant", weight_decay=0.0,
            max_grad_norm=1.0, per_device_train_batch_size=rows, num_generations=group_size, beta=beta,
            router_aux_loss_coef=0.0, epsilon=0.2, epsilon_high=0.28, use_cpu=device.type == "cpu",
            bf16=dtype == torch.bfloat16, report_to="none", disable_tqdm=True, gradient_checkpointing=False,
            save_strategy="no", logging_steps=1)
        self.trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                                   args=args, processing_class=tokenizer,
                                   train_dataset=Dataset.from_dict({"prompt": ["unused"] * rows}))
        self.trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which we do not run
        self.model = self.trainer.model.to(device).train()
        self.optimizer = self.trainer.create_optimizer()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.device, self.dtype, self.group_size = device, dtype, group_size

    def step(self, episodes: list[Episode], prompt_len: int) -> float:
        """One optimizer step on `episodes` (whole groups, in order); returns the loss."""
        inputs = trl_inputs(episodes, self.group_size, prompt_len, self.pad_id, self.device)
        autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if self.dtype == torch.bfloat16
                    else contextlib.nullcontext())
        trainer = self.trainer
        if trainer.beta != 0.0:
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            with torch.no_grad(), autocast:
                inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
                    trainer.ref_model, ids, mask, inputs["completion_ids"].size(1))[0]
        self.optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = trainer.compute_loss(self.model, inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), trainer.args.max_grad_norm)
        self.optimizer.step()
        return float(loss.detach())


def _timed(fn: Any, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _profile(fn: Any, device: torch.device, top: int = 15) -> dict[str, Any]:
    """One more step under torch.profiler: aten ops (nested calls counted), kernel launches, waits on the
    device, reads of a device value, and the ops that took the most self time (device time on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        _timed(fn, device)
    events = prof.key_averages()

    def self_ms(e: Any) -> float:
        if device.type == "cuda":
            return getattr(e, "self_device_time_total", 0.0) / 1e3
        return e.self_cpu_time_total / 1e3

    return {
        "aten_ops": sum(e.count for e in events if e.key.startswith("aten::")),
        "kernel_launches": sum(e.count for e in events if e.key in _LAUNCHES),
        "device_syncs": sum(e.count for e in events if e.key in _SYNCS),
        "value_reads": sum(e.count for e in events if e.key == "aten::_local_scalar_dense"),
        "top_self_ms": [[e.key, e.count, round(self_ms(e), 3)]
                        for e in sorted(events, key=self_ms, reverse=True)[:top]],
    }


def run(quick: bool = False, overrides: Sequence[str] = ()) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-trainer-") as tmp:
        base, recipe = base_and_recipe(quick, Path(tmp), overrides)  # the step reads only the recipe's rl section
        device, dtype_name = device_and_dtype(recipe.rl.device, recipe.rl.dtype)
        rl = recipe.rl.model_copy(update={"device": str(device), "dtype": dtype_name})
        shape, repeats = (QUICK, 1) if quick else (FULL, 5)
        batch = grpo_batch(base, shape)
        ours = RLTrainer.open(Path(tmp) / "ours", base, rl)
        trl = TRLStep(base, rl.kl_coef, device, getattr(torch, dtype_name), Path(tmp) / "trl", len(batch),
                      shape.group_size)
        prompt_len = shape.system + shape.task
        times: dict[str, list[float]] = {"ours": [], "trl": []}
        metrics: dict[str, float] = {}
        for r in range(repeats + 1):  # the first of each: a warm-up
            episodes = fresh(batch, r, ours.version)
            times["ours"].append(_timed(lambda: metrics.update(ours.step(episodes)), device))
            times["trl"].append(_timed(lambda: trl.step(episodes, prompt_len), device))
        profiles: dict[str, Any] = {}
        if os.environ.get("RTRL_BENCH_PROFILE", "0") not in ("", "0"):
            episodes = fresh(batch, repeats + 1, ours.version)
            try:
                profiles = {"ours_profile": _profile(lambda: ours.step(episodes), device),
                            "trl_profile": _profile(lambda: trl.step(episodes, prompt_len), device)}
            except RuntimeError as e:  # e.g. no CUPTI for the device's profiler: the timings above stand
                profiles = {"profile_error": f"{type(e).__name__}: {e}"[:500]}
    ours_s, trl_s = (statistics.median(times[k][1:]) for k in ("ours", "trl"))
    trained = sum(e.num_generated for e in batch)
    tokens = sum(e.num_tokens for e in batch)
    return {
        "ours_step_s": ours_s,
        "trl_step_s": trl_s,
        "speedup_vs_trl": trl_s / ours_s,
        "speedup_vs_trl_min": min(times["trl"][1:]) / min(times["ours"][1:]),
        "ours_trained_tokens_per_s": trained / ours_s,
        "trl_trained_tokens_per_s": trained / trl_s,
        "ours_forward_token_fraction": metrics.get("train/forward_token_fraction"),
        "ours_micro_batches": metrics.get("train/micro_batches"),
        "ours_micro_batch_tokens": ours.micro_batch_tokens,  # rl's, or the device's default
        "ours_shared_run_min_tokens": ours.shared_run_min_tokens,
        "ours_call_overhead_tokens": ours.call_overhead_tokens,
        "episodes": len(batch),
        "trained_tokens": trained,
        "tokens": tokens,
        "padded_tokens_trl": len(batch) * max(e.num_tokens for e in batch),
        "repeats": repeats,
        "ours_step_s_all": times["ours"],
        "trl_step_s_all": times["trl"],
        "device": str(device),
        "dtype": dtype_name,
        **profiles,
    }
