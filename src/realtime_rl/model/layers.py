"""Building blocks of the Qwen3 decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Numerics follow transformers' Qwen3 exactly where it matters for parity: RMSNorm in fp32 then cast
back, QK-norm per head before RoPE, rotate-half RoPE with cos/sin computed in fp32.

Attention has two modes. Full-sequence (no step): each batch row is one sequence, causal by index.
With a `KVStep`, the step takes the new keys/values and the queries and returns the attention output:
the engine's `CacheStep` writes them into the KV cache at `positions` of the rows' slots and attends over
each row's prefix (prefill, decode and ragged batches alike); the trainer's `SharedPrefix` puts one
prefix, computed once, before every row's own keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from realtime_rl.config import ModelConfig
from realtime_rl.model.kv_cache import KVStep


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables computed on the fly from integer positions, so any position layout works.

    The inverse frequencies are recomputed in fp32 each call (a few dozen flops) rather than kept as
    a buffer, which `model.to(torch.bfloat16)` would round.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, positions_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=positions_BT.device).float()
        inv_freq_F = 1.0 / (self.theta ** (exponents / self.head_dim))
        freqs_BTF = positions_BT.float()[..., None] * inv_freq_F
        emb_BTD = torch.cat((freqs_BTF, freqs_BTF), dim=-1)
        return emb_BTD.cos().to(dtype), emb_BTD.sin().to(dtype)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype x's matmuls run in: autocast's on x's device where autocast is on, else x's own. For the
    kernels autocast does not cover (grouped matmuls, and attention taking inputs of mixed dtypes)."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x_BHTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_BTD[:, None], sin_BTD[:, None]
    return x_BHTD * cos + _rotate_half(x_BHTD) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x_BTC: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache_step: KVStep | None,
    ) -> torch.Tensor:
        B, T, _ = x_BTC.shape
        q_BHTD = self.q_norm(self.q_proj(x_BTC).view(B, T, self.num_heads, self.head_dim)).transpose(1, 2)
        k_BHTD = self.k_norm(self.k_proj(x_BTC).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v_BHTD = self.v_proj(x_BTC).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos_sin
        q_BHTD = apply_rope(q_BHTD, cos, sin)
        k_BHTD = apply_rope(k_BHTD, cos, sin)

        if cache_step is None:
            out_BHTD = F.scaled_dot_product_attention(q_BHTD, k_BHTD, v_BHTD, is_causal=True, enable_gqa=True)
        else:
            out_BHTD = cache_step.attend(self.layer_idx, q_BHTD, k_BHTD, v_BHTD)
        return self.o_proj(out_BHTD.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
