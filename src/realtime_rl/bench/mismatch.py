"""`rtrl bench mismatch`: the engine's logprobs against the trainer's recomputation, with and without R3.

A tiny Qwen3-MoE generates (engine: batched prefill, incremental decode, routing captured); the
trainer's view is one full-sequence forward over prompt + completion, once free (its own routing) and
once replaying the engine's routing. Metrics over every generated token, as verl / slime's rollout-
correction metrics define them, with log_ratio = logp_trainer - logp_engine:

    k3_kl                 mean(exp(log_ratio) - 1 - log_ratio)     (estimates KL(engine || trainer))
    routing_disagreement  fraction of (token, MoE layer) whose top-k expert set differs from the engine's
    max_abs_logprob_diff  max |log_ratio|

Runs on CPU in fp32 by default; `RTRL_BENCH_DEVICE=cuda RTRL_BENCH_DTYPE=bfloat16` runs it on a GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from realtime_rl.bench import device_and_dtype
from realtime_rl.config import ModelConfig
from realtime_rl.engine import Engine, SamplingParams
from realtime_rl.model import Qwen3ForCausalLM, sequence_logprobs


def _trainer_view(model: Qwen3ForCausalLM, prompt: list[int], tokens: list[int], routing: np.ndarray | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs of `tokens` from one full-sequence forward, and the routing that forward used."""
    replay = None if routing is None else torch.from_numpy(routing)
    lp, used = sequence_logprobs(model, torch.tensor(prompt + tokens), replay)
    return lp[len(prompt) - 1:].cpu(), None if used is None else used.cpu()


def _disagreement(used: torch.Tensor, engine: np.ndarray, prompt_len: int) -> float:
    """Fraction of (generated position, layer) where the expert *sets* differ."""
    a = used[prompt_len - 1:].sort(-1).values
    b = torch.from_numpy(engine[prompt_len - 1:]).sort(-1).values
    return (a != b).any(-1).float().mean().item()


def run(quick: bool = False) -> dict[str, Any]:
    device, dtype_name = device_and_dtype()
    dtype = getattr(torch, dtype_name)
    config = ModelConfig(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16,
                         num_experts_per_tok=4, moe_intermediate_size=64, tie_word_embeddings=False,
                         initializer_range=0.05)
    model = Qwen3ForCausalLM(config)
    model.reset_parameters(seed=0)
    model = model.to(device=device, dtype=dtype).eval()
    n_prompts, new_tokens = (8, 32) if quick else (32, 128)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(16, 64, (n_prompts,), generator=gen)]
    engine = Engine(model, max_batch=n_prompts, max_seq_len=64 + new_tokens + 1)
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=0, ignore_eos=True))

    ratios = {"replay": [], "no_replay": []}
    disagree = {"replay": [], "no_replay": []}
    for prompt, out in zip(prompts, outs):
        s = out.samples[0]
        engine_lp = torch.tensor(s.logprobs)
        for mode, routing in (("replay", s.routing), ("no_replay", None)):
            lp, used = _trainer_view(model, prompt, s.token_ids, routing)
            ratios[mode].append(lp - engine_lp)
            disagree[mode].append(_disagreement(used, s.routing, len(prompt)))
    metrics: dict[str, Any] = {"tokens": sum(len(o.samples[0].token_ids) for o in outs),
                               "device": str(device), "dtype": str(dtype).removeprefix("torch.")}
    for mode in ("replay", "no_replay"):
        lr = torch.cat(ratios[mode]).double()
        metrics[f"k3_kl_{mode}"] = (lr.exp() - 1 - lr).mean().item()
        metrics[f"routing_disagreement_{mode}"] = float(np.mean(disagree[mode]))
        metrics[f"max_abs_logprob_diff_{mode}"] = lr.abs().max().item()
    return metrics
