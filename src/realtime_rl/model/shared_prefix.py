"""Many rows that share a prefix, computed once: the trainer's forward over sequences with one prompt.

    prefix = SharedPrefix()
    model.hidden_states(ids[:1, :P], shared_prefix=prefix)                    # one row: records each layer's K/V
    h, _ = model.hidden_states(ids[:, P:], shared_prefix=prefix)              # every row attends to them

    task = prefix.extended()                                                  # a longer prefix some rows share
    model.hidden_states(ids[:1, P:Q], shared_prefix=task)                     # one row continues the first ...
    h, _ = model.hidden_states(ids[:8, Q:], shared_prefix=task)               # ... and those rows continue it

In the second call each row's queries attend to the prefix's keys and values (read as an expanded view,
never copied per row before attention) and causally to their own. Autograd sums the rows' gradients
back into the one prefix computation, so the loss and its gradient equal those of B full-length
forwards, up to float summation order, at the cost of one prefix plus B suffixes. In the live loop every
reply shares the system prompt and the tool schemas (about three quarters of a trained sequence), and the
replies of one GRPO group share their task's prompt as well: `extended` records that longer prefix once
per group, from one row that attends to the shorter one.

On CPU a row's attention runs as two flash-attention calls, one over the prefix (no mask) and one causal
over its own keys, merged by their log-sum-exps (`prefix_attention`); the backward gives each call the
merged output and log-sum-exp, so the gradients are those of one softmax over all the keys. One call with
a mask instead computes every query against every key (the kernel cannot skip the masked half of the
row's own keys) and adds the mask: 1.0-1.9x slower forward and backward at a trainer step's shapes.
Elsewhere (CUDA) it is one call over [prefix | own keys] with a causal mask aligned to the last key
(`causal_lower_right`), which the fused kernels (flash, memory-efficient) take without a mask tensor; a
boolean mask there sent each call to a kernel that reads a materialised [T, P + T] mask: on an H100 the
trainer's step spent 4 of its 5 seconds in that attention and its backward (BENCHMARKS.md, async).

Not here: choosing the prefix (the trainer does: equal token ids, equal replayed routing, no trained
target inside it), caching across forwards (the engine's KV cache does that for inference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from realtime_rl.model.kv_cache import _flash_cpu, merge_attention
from realtime_rl.model.layers import compute_dtype

_flash_cpu_backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class SharedPrefix:
    def __init__(self, parent: SharedPrefix | None = None) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.length: int | None = None
        """Prefix length once recorded."""
        self.parent = parent
        """The shorter prefix this one continues (`extended`)."""

    def extended(self) -> SharedPrefix:
        """A longer prefix that continues this recorded one: its first forward is one row starting where this
        prefix ends (attending to it), and later rows attend to both parts as one prefix."""
        if self.length is None:
            raise ValueError("only a recorded prefix can be extended")
        return SharedPrefix(parent=self)

    @property
    def start(self) -> int:
        """The position the next forward starts at: the prefix's end once recorded, else where it begins."""
        if self.length is not None:
            return self.length
        return 0 if self.parent is None else self.parent.length

    def begin(self, B: int, T: int, positions_BT: torch.Tensor | None = None) -> _Record | _Extend:
        """The step of one forward of B rows x T tokens: record the prefix (first call), or continue it in every
        row. positions_BT, when the caller chose them, must start at `start` (checked with one read of them);
        the model derives them from `start` otherwise."""
        start = self.start
        if positions_BT is not None:
            first, last = torch.stack(torch.aminmax(positions_BT[:, 0])).tolist()
            if first != start or last != start:
                what = "a prefix continuing" if self.length is None else "rows continuing a shared prefix of"
                raise ValueError(f"{what} {start} tokens must start at position {start}")
        if self.length is None:
            if B != 1:
                raise ValueError(f"a shared prefix is recorded from one row, got {B}")
            self.length = start + T
            return _Record(self)
        return _Extend(self, B)


@dataclass
class _Record:
    prefix: SharedPrefix

    def attend(self, layer_idx: int, q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor
               ) -> torch.Tensor:
        parent = self.prefix.parent
        if parent is None:
            self.prefix.keys[layer_idx], self.prefix.values[layer_idx] = k_BKTD, v_BKTD
            return F.scaled_dot_product_attention(q_BHTD, k_BKTD, v_BKTD, is_causal=True, enable_gqa=True)
        k_parent, v_parent = parent.keys[layer_idx], parent.values[layer_idx]
        self.prefix.keys[layer_idx] = torch.cat([k_parent, k_BKTD], dim=2)
        self.prefix.values[layer_idx] = torch.cat([v_parent, v_BKTD], dim=2)
        return prefix_attention(q_BHTD, k_parent, v_parent, k_BKTD, v_BKTD)


@dataclass
class _Extend:
    prefix: SharedPrefix
    rows: int

    def attend(self, layer_idx: int, q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor
               ) -> torch.Tensor:
        k_prefix = self.prefix.keys[layer_idx].expand(self.rows, -1, -1, -1)
        v_prefix = self.prefix.values[layer_idx].expand(self.rows, -1, -1, -1)
        return prefix_attention(q_BHTD, k_prefix, v_prefix, k_BKTD, v_BKTD)


def prefix_attention(q_BHTD: torch.Tensor, k_BKPD: torch.Tensor, v_BKPD: torch.Tensor, k_BKTD: torch.Tensor,
                     v_BKTD: torch.Tensor) -> torch.Tensor:
    """Attention of T queries per row over P prefix keys (all visible) then the row's own T keys (causal):
    query t sees prefix keys 0..P-1 and own keys 0..t. Grouped-query: H query heads over K key/value heads.
    Runs in autocast's dtype where autocast is on (the kernels below take one dtype; q and k leave their
    RMSNorm in fp32 while v leaves its projection in bf16), else in q's."""
    dtype = compute_dtype(q_BHTD)
    q_BHTD, k_BKPD, v_BKPD, k_BKTD, v_BKTD = (t.to(dtype) for t in (q_BHTD, k_BKPD, v_BKPD, k_BKTD, v_BKTD))
    if (_flash_cpu is not None and _flash_cpu_backward is not None and q_BHTD.is_cpu
            and dtype in (torch.float32, torch.bfloat16)):
        return _PrefixThenCausal.apply(q_BHTD, k_BKPD, v_BKPD, k_BKTD, v_BKTD)
    G = q_BHTD.shape[1] // k_BKPD.shape[1]
    k_BHSD, v_BHSD = (torch.cat([pre, own], dim=2).repeat_interleave(G, dim=1)  # the kernels' own GQA varies
                      for pre, own in ((k_BKPD, k_BKTD), (v_BKPD, v_BKTD)))
    T, S = q_BHTD.shape[2], k_BHSD.shape[2]
    return F.scaled_dot_product_attention(q_BHTD, k_BHSD, v_BHSD, attn_mask=causal_lower_right(T, S))


class _PrefixThenCausal(torch.autograd.Function):
    """prefix_attention on CPU: two flash-attention calls merged by log-sum-exp. With O and L the merged
    output and log-sum-exp, each key block's gradient is flash attention's backward given O and L (the
    softmax over all keys is exp(S - L)), and the query's is the sum over the blocks."""

    @staticmethod
    def forward(ctx, q_BHTD, k_BKPD, v_BKPD, k_BKTD, v_BKTD):  # type: ignore[override]
        out_prefix, lse_prefix_BHT = _flash_cpu(q_BHTD, k_BKPD, v_BKPD, 0.0, False)
        out_own, lse_own_BHT = _flash_cpu(q_BHTD, k_BKTD, v_BKTD, 0.0, True)
        out_BHTD, lse_BHT = merge_attention(out_prefix, lse_prefix_BHT, out_own, lse_own_BHT)  # q's dtype
        ctx.save_for_backward(q_BHTD, k_BKPD, v_BKPD, k_BKTD, v_BKTD, out_BHTD, lse_BHT)
        return out_BHTD

    @staticmethod
    def backward(ctx, grad_BHTD):  # type: ignore[override]
        q_BHTD, k_BKPD, v_BKPD, k_BKTD, v_BKTD, out_BHTD, lse_BHT = ctx.saved_tensors
        grad_BHTD = grad_BHTD.contiguous()
        merged = (out_BHTD, lse_BHT)
        dq_pre, dk_pre, dv_pre = _flash_cpu_backward(grad_BHTD, q_BHTD, k_BKPD, v_BKPD, *merged, 0.0, False)
        dq_own, dk_own, dv_own = _flash_cpu_backward(grad_BHTD, q_BHTD, k_BKTD, v_BKTD, *merged, 0.0, True)
        return dq_pre + dq_own, dk_pre, dv_pre, dk_own, dv_own
