"""A preallocated key/value cache with one slot per concurrent sequence.

Slot `s` holds the keys and values of one sequence at positions 0..S-1. A forward writes its new
keys/values at the given positions of the given slots and reads back each row's prefix up to the
longest position in the batch; attention masks out keys past each query's own position, so rows of
different lengths share one batched decode step. Freeing a slot is free: the next sequence that gets
it overwrites positions from 0 and never attends past its own position.

Not here: paging, prefix sharing between slots (the engine copies a prefix with `copy_prefix`).
"""

from __future__ import annotations

import torch

from realtime_rl.config import ModelConfig


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        max_seq_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if num_slots < 1 or max_seq_len < 1:
            raise ValueError(f"KVCache needs num_slots >= 1 and max_seq_len >= 1, got {num_slots}, {max_seq_len}")
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        shape = (num_slots, max_seq_len, config.num_key_value_heads, config.head_dim)
        self.k_LSPHD = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.v_LSPHD = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]

    def update(
        self,
        layer_idx: int,
        slots: torch.Tensor | slice,
        positions_BT: torch.Tensor,
        k_BHTD: torch.Tensor,
        v_BHTD: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys/values, return each row's cached prefix as (k, v) of shape [B, H, S, D].

        `slots` is a LongTensor [B] of slot ids, or a `slice` of consecutive slots in row order: then the
        prefix is read as a view instead of gathered (the engine passes one when its batch is contiguous).
        """
        length = int(positions_BT.max()) + 1
        if length > self.max_seq_len:
            raise ValueError(f"position {length - 1} exceeds the KV cache length {self.max_seq_len}")
        k_cache, v_cache = self.k_LSPHD[layer_idx], self.v_LSPHD[layer_idx]
        if isinstance(slots, slice):
            k_cache, v_cache = k_cache[slots], v_cache[slots]
            rows = torch.arange(k_cache.shape[0], device=positions_BT.device)[:, None].expand_as(positions_BT)
        else:
            rows = slots[:, None].expand_as(positions_BT)
        k_cache[rows, positions_BT] = k_BHTD.transpose(1, 2).to(k_cache.dtype)
        v_cache[rows, positions_BT] = v_BHTD.transpose(1, 2).to(v_cache.dtype)
        if isinstance(slots, slice):
            return k_cache[:, :length].transpose(1, 2), v_cache[:, :length].transpose(1, 2)
        return (
            k_cache[slots, :length].transpose(1, 2),
            v_cache[slots, :length].transpose(1, 2),
        )

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Copy positions [0, length) of one slot into another (n samples sharing one prefill)."""
        for k_cache, v_cache in zip(self.k_LSPHD, self.v_LSPHD):
            k_cache[dst_slot, :length] = k_cache[src_slot, :length]
            v_cache[dst_slot, :length] = v_cache[src_slot, :length]
