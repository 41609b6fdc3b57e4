"""Single-sequence sampling through the KV cache: the reference decoder for tests, the demo and tools.

    gen = generate(model, prompt_ids, max_new_tokens=64, stop_ids=tok.stop_token_ids, temperature=1.0, seed=0)
    gen.token_ids, gen.logprobs, gen.routing_TLK   # routing covers prompt + generated tokens but the last

Logprobs are of the distribution actually sampled from (after temperature and top-p). The batched,
continuously-batched engine with hot weight swaps is `realtime_rl.engine`; this is its plain twin
and deliberately has no batching, no streaming and no version tracking beyond the one it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from realtime_rl.model.kv_cache import KVCache
from realtime_rl.model.qwen3 import Qwen3ForCausalLM
from realtime_rl.model.sampling import sample_rows, sampling_logprobs


@dataclass
class Generated:
    token_ids: list[int]
    """Sampled tokens, the stop token included when one was sampled."""
    logprobs: list[float]
    """logprob of each sampled token under the sampling distribution (0.0 when greedy); same length as token_ids."""
    raw_logprobs: list[float]
    """logprob of each sampled token under the untempered model distribution."""
    routing_TLK: torch.Tensor | None
    """Routing of every input position (prompt + token_ids[:-1]), [T, moe layers, k]; None for dense."""
    stopped: bool
    """True when a stop token ended generation (False: max_new_tokens ran out)."""


def sample_token(logits_V: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None
                 ) -> tuple[int, float, float]:
    """Sample one token; temperature 0 is greedy.

    Returns (token, logprob under the sampling distribution, logprob under the untempered distribution).
    """
    lp_1V, raw_1V = sampling_logprobs(logits_V[None], torch.tensor([float(temperature)]), torch.tensor([0]),
                                      torch.tensor([float(top_p)]))
    token = sample_rows(lp_1V, [temperature == 0], [gen])[0]
    return token, 0.0 if temperature == 0 else float(lp_1V[0, token]), float(raw_1V[0, token])


@torch.no_grad()
def generate(
    model: Qwen3ForCausalLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: list[int] | tuple[int, ...] = (),
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int | None = None,
) -> Generated:
    if not prompt_ids:
        raise ValueError("generate needs a non-empty prompt")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    gen = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
    cache = KVCache(model.config, num_slots=1, max_seq_len=len(prompt_ids) + max_new_tokens, dtype=dtype,
                    device=device)
    slots = torch.zeros(1, dtype=torch.long, device=device)
    ids = torch.tensor([prompt_ids], device=device)
    out = model(ids, torch.arange(len(prompt_ids), device=device)[None], kv_cache=cache, cache_slots=slots,
                capture_routing=True)
    routing = [out.routing_BTLK[0].cpu()] if out.routing_BTLK is not None else []
    tokens: list[int] = []
    logprobs: list[float] = []
    raw_logprobs: list[float] = []
    logits_V = out.logits_BTV[0, -1].cpu()
    stopped = False
    for step in range(max_new_tokens):
        token, lp, raw_lp = sample_token(logits_V, temperature, top_p, gen)
        tokens.append(token)
        logprobs.append(lp)
        raw_logprobs.append(raw_lp)
        if token in stop_ids:
            stopped = True
            break
        if step == max_new_tokens - 1:
            break
        pos = torch.tensor([[len(prompt_ids) + step]], device=device)
        out = model(torch.tensor([[token]], device=device), pos, kv_cache=cache, cache_slots=slots,
                    capture_routing=True)
        if out.routing_BTLK is not None:
            routing.append(out.routing_BTLK[0].cpu())
        logits_V = out.logits_BTV[0, -1].cpu()
    return Generated(tokens, logprobs, raw_logprobs, torch.cat(routing) if routing else None, stopped)
