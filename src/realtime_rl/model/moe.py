"""Qwen3-MoE sparse block with routing capture and replay (R3, "rollout routing replay").

Routing: router logits -> softmax in fp32 -> top-k -> (optionally) renormalize the k probabilities.
Every forward returns the chosen expert indices, ordered as top-k ordered them. Under replay the
indices come from a record instead of top-k, and the mixing weights are the router's own softmax
probabilities gathered at those indices (renormalized the same way), so the output is a function of
the current router weights and gradients still reach the router, while the discrete choice is exactly
the one inference made.

Expert weights are stored fused, as in transformers >= 5: `gate_up_proj` [E, 2I, H] (gate rows
first) and `down_proj` [E, H, I]; checkpoints hold the per-expert tensors the Hub format uses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from realtime_rl.config import ModelConfig
from realtime_rl.model.layers import compute_dtype

# torch >= 2.10 has a grouped matmul (`F.grouped_mm`) with CPU and CUDA kernels and their backward: the
# experts' SwiGLU runs as two of them, with no Python loop over experts and no read of the per-expert counts
# (a device sync on a GPU). CUDA's kernels here take bf16 (fp32 on a GPU keeps the per-expert loop), CPU's
# fp32, bf16 and fp16 (float64 keeps it too).
# Inference runs them as one custom op whose output shape is declared here, so that torch.compile (the
# engine's compiled decode) keeps it as one opaque kernel per layer: grouped_mm's own meta function rejects
# fp32. Training calls the same two matmuls directly (autograd differentiates them; the op has no backward).
_HAS_GROUPED_MM = hasattr(F, "grouped_mm")
_GROUPED_DTYPES_CPU = (torch.float32, torch.bfloat16, torch.float16)


def grouped_experts(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the experts run as grouped matmuls on this device in this compute dtype (else a per-expert loop,
    which reads the per-expert counts back to the host)."""
    return _HAS_GROUPED_MM and dtype in (_GROUPED_DTYPES_CPU if device.type == "cpu" else (torch.bfloat16,))


def _grouped_swiglu(x_MC: torch.Tensor, gate_up_EFC: torch.Tensor, down_ECI: torch.Tensor,
                    offs_E: torch.Tensor) -> torch.Tensor:
    gate, up = F.grouped_mm(x_MC, gate_up_EFC.transpose(-2, -1), offs=offs_E).chunk(2, dim=-1)
    return F.grouped_mm((F.silu(gate) * up).contiguous(), down_ECI.transpose(-2, -1), offs=offs_E)


@torch.library.custom_op("rtrl::expert_swiglu", mutates_args=())
def expert_swiglu(x_MC: torch.Tensor, gate_up_EFC: torch.Tensor, down_ECI: torch.Tensor,
                  offs_E: torch.Tensor) -> torch.Tensor:
    """Rows of x grouped by expert (offs_E: cumulative row counts, int32) through each expert's SwiGLU."""
    return _grouped_swiglu(x_MC, gate_up_EFC, down_ECI, offs_E)


@expert_swiglu.register_fake
def _(x_MC: torch.Tensor, gate_up_EFC: torch.Tensor, down_ECI: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    return x_MC.new_empty(x_MC.shape[0], down_ECI.shape[1])


class Router(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))

    def forward(
        self, x_NC: torch.Tensor, replay_NK: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (mixing weights [N, k] in x's dtype, expert indices [N, k] int64)."""
        probs_NE = F.softmax(F.linear(x_NC, self.weight), dim=-1, dtype=torch.float32)
        if replay_NK is None:
            weights_NK, indices_NK = torch.topk(probs_NE, self.top_k, dim=-1)
        else:
            indices_NK = replay_NK.long()
            if indices_NK.shape != (x_NC.shape[0], self.top_k):
                raise ValueError(
                    f"replayed routing has shape {tuple(indices_NK.shape)}, expected ({x_NC.shape[0]}, {self.top_k})"
                )
            weights_NK = probs_NE.gather(1, indices_NK)
        if self.norm_topk_prob:
            weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
        return weights_NK.to(x_NC.dtype), indices_NK


class Experts(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def forward(self, x_NC: torch.Tensor, indices_NK: torch.Tensor, weights_NK: torch.Tensor,
                grouped: bool | None = None) -> torch.Tensor:
        """Each token through its k experts, mixed by weights_NK. grouped: the grouped matmuls (default:
        wherever their kernels take the compute dtype) or the per-expert loop, which gives the same sums (tests
        compare the two)."""
        # Group the (token, slot) pairs by expert: one sort, then one matmul per expert (or one grouped matmul).
        flat_expert_M = indices_NK.reshape(-1)
        order_M = torch.argsort(flat_expert_M, stable=True)
        token_M = order_M // indices_NK.shape[1]
        x_MC = x_NC[token_M]
        w_M = weights_NK.reshape(-1)[order_M]
        # A count of static shape (bincount's depends on the data, which torch.compile cannot trace).
        counts_E = torch.zeros(self.num_experts, dtype=torch.long, device=x_NC.device).scatter_add_(
            0, flat_expert_M, torch.ones_like(flat_expert_M))
        dtype = compute_dtype(x_NC)
        if grouped is None:
            grouped = grouped_experts(x_NC.device, dtype)
        if grouped:
            # Autocast does not cover grouped_mm: cast to its dtype here (the casts are differentiable).
            args = (x_MC.to(dtype), self.gate_up_proj.to(dtype), self.down_proj.to(dtype),
                    counts_E.cumsum(0).to(torch.int32))
            y_MC = _grouped_swiglu(*args) if torch.is_grad_enabled() else expert_swiglu(*args)
        else:
            parts = []
            start = 0
            for expert, count in enumerate(counts_E.tolist()):
                if count:
                    gate, up = F.linear(x_MC[start:start + count], self.gate_up_proj[expert]).chunk(2, dim=-1)
                    parts.append(F.linear(F.silu(gate) * up, self.down_proj[expert]))
                    start += count
            y_MC = torch.cat(parts) if parts else x_MC[:0]
        return torch.zeros_like(x_NC).index_add_(0, token_M, (y_MC * w_M[:, None]).to(x_NC.dtype))


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config)

    def forward(
        self, x_BTC: torch.Tensor, replay_BTK: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (output [B, T, C], chosen experts [B, T, k] int64)."""
        B, T, C = x_BTC.shape
        x_NC = x_BTC.reshape(B * T, C)
        replay_NK = None if replay_BTK is None else replay_BTK.reshape(B * T, -1)
        weights_NK, indices_NK = self.gate(x_NC, replay_NK)
        out_NC = self.experts(x_NC, indices_NK, weights_NK)
        return out_NC.view(B, T, C), indices_NK.view(B, T, -1)
