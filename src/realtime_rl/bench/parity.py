"""`rtrl bench parity`: our Qwen3 / Qwen3-MoE against transformers' implementation, in both directions.

For each case a random tiny model is built with transformers, saved, loaded with ours, and the logits
on random tokens compared (fp32); then ours is saved and transformers loads it, and the logits are
compared again. Needs transformers (the `dev` extra); it is never imported by the runtime package.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from realtime_rl.model import Qwen3ForCausalLM, config_from_hf, load_checkpoint, save_checkpoint

_BASE: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=1_000_000.0,
    initializer_range=0.2, tie_word_embeddings=False,
)


@dataclass
class ParityCase:
    name: str
    moe: bool
    overrides: dict[str, Any] = field(default_factory=dict)


CASES = [
    ParityCase("dense_gqa2_tied", False, dict(tie_word_embeddings=True)),
    ParityCase("dense_gqa4_untied_bias", False, dict(num_key_value_heads=1, attention_bias=True)),
    ParityCase("dense_mha", False, dict(num_key_value_heads=4)),
    ParityCase("moe_top1", True, dict(num_experts=4, num_experts_per_tok=1, norm_topk_prob=False)),
    ParityCase("moe_top2_norm", True, dict(num_experts=6, num_experts_per_tok=2, norm_topk_prob=True)),
    ParityCase("moe_top3_sparse_step", True, dict(num_experts=8, num_experts_per_tok=3, decoder_sparse_step=2,
                                                  mlp_only_layers=[2], tie_word_embeddings=True)),
]


def _hf_model(case: ParityCase, seed: int) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM as HFQwen3, Qwen3MoeConfig, Qwen3MoeForCausalLM

    kwargs = {**_BASE, **case.overrides}
    if case.moe:
        kwargs.setdefault("moe_intermediate_size", 32)
        config = Qwen3MoeConfig(**kwargs)
        cls = Qwen3MoeForCausalLM
    else:
        config = Qwen3Config(**kwargs)
        cls = HFQwen3
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # norms at 1.0 would hide a misplaced norm weight
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def run_case(case: ParityCase, seed: int = 0, batch: int = 2, seq_len: int = 24) -> dict[str, float | bool]:
    """Max |logit diff| for transformers->ours and ours->transformers on one configuration."""
    from transformers import AutoModelForCausalLM

    hf = _hf_model(case, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, hf.config.vocab_size, (batch, seq_len), generator=gen)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, our_dir = Path(tmp, "hf"), Path(tmp, "ours")
        hf.save_pretrained(hf_dir)
        ours = load_checkpoint(hf_dir, dtype=torch.float32)
        with torch.no_grad():
            ref = hf(ids).logits
            got = ours.model(ids).logits_BTV
        we_load_hf = ours.tokenizer is None and isinstance(ours.model, Qwen3ForCausalLM)
        hf_to_ours = (ref - got).abs().max().item()

        # The other direction: a model of ours, re-initialised, saved, loaded by transformers.
        ours.model.reset_parameters(seed=seed + 2)
        with torch.no_grad():
            for name, p in ours.model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5, generator=gen)
        save_checkpoint(our_dir, ours.model)
        hf2 = AutoModelForCausalLM.from_pretrained(our_dir, dtype=torch.float32).eval()
        same_config = config_from_hf(hf2.config.to_dict()).model_dump() == ours.config.model_dump()
        with torch.no_grad():
            ours_to_hf = (hf2(ids).logits - ours.model(ids).logits_BTV).abs().max().item()
    return {
        "hf_to_ours_max_abs_diff": hf_to_ours,
        "ours_to_hf_max_abs_diff": ours_to_hf,
        "we_load_hf": we_load_hf,
        "hf_loads_ours": same_config,
    }


def run(quick: bool = False) -> dict[str, Any]:
    results = {case.name: run_case(case) for case in CASES}
    dense = [r for c, r in zip(CASES, results.values()) if not c.moe]
    moe = [r for c, r in zip(CASES, results.values()) if c.moe]

    def worst(rows: list[dict[str, Any]]) -> float:
        return max(max(r["hf_to_ours_max_abs_diff"], r["ours_to_hf_max_abs_diff"]) for r in rows)

    metrics: dict[str, Any] = {
        "dense_max_abs_diff": worst(dense),
        "moe_max_abs_diff": worst(moe),
        "hf_loads_ours": all(r["hf_loads_ours"] and r["ours_to_hf_max_abs_diff"] <= 1e-4 for r in results.values()),
        "we_load_hf": all(r["we_load_hf"] and r["hf_to_ours_max_abs_diff"] <= 1e-4 for r in results.values()),
    }
    for name, r in results.items():
        metrics[f"{name}/hf_to_ours_max_abs_diff"] = r["hf_to_ours_max_abs_diff"]
        metrics[f"{name}/ours_to_hf_max_abs_diff"] = r["ours_to_hf_max_abs_diff"]
    return metrics
