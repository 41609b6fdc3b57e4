"""A preallocated key/value cache with one slot per concurrent sequence.

Slot `s` holds the keys and values of one sequence at positions 0..S-1, head-major ([slot, head,
position, dim]), so the prefix a decode step reads is one contiguous block per slot and head: attention
runs on it in place, without a transposed copy. A forward writes its new
keys/values at the given positions of the given slots and reads back each row's prefix up to the
longest position in the batch (`begin` once per forward, then `CacheStep.update` per layer); attention
masks out keys past each query's own position, so rows of
different lengths share one batched decode step. Freeing a slot is free: the next sequence that gets
it overwrites positions from 0 and never attends past its own position.

Not here: paging, prefix sharing between slots (the engine copies a prefix with `copy_prefix`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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
        shape = (num_slots, config.num_key_value_heads, max_seq_len, config.head_dim)
        self.k_LSHPD = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.v_LSHPD = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]

    def begin(self, slots: torch.Tensor | slice, positions_BT: torch.Tensor, length: int | None = None) -> CacheStep:
        """Start one forward over the cache: the prefix length, row indices and mask, once for all layers.

        `slots` is a LongTensor [B] of slot ids, or a `slice` of consecutive slots in row order: then each
        layer reads the prefix as a view instead of gathering it (the engine passes one when it can).
        `length` (default: the largest position + 1, read from the tensor) is the prefix every row reads;
        a caller that knows it passes it, which keeps a compiled forward free of data-dependent shapes.
        """
        if length is None:
            length = int(positions_BT.max()) + 1
        if length > self.max_seq_len:
            raise ValueError(f"position {length - 1} exceeds the KV cache length {self.max_seq_len}")
        if isinstance(slots, slice):
            rows_BT = torch.arange(positions_BT.shape[0], device=positions_BT.device)[:, None].expand_as(positions_BT)
        else:
            rows_BT = slots[:, None].expand_as(positions_BT)
        key_pos_S = torch.arange(length, device=positions_BT.device)
        mask_B1TS = key_pos_S[None, None, None, :] <= positions_BT[:, None, :, None]
        return CacheStep(self, slots, positions_BT, rows_BT, length, mask_B1TS)

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Copy positions [0, length) of one slot into another (n samples sharing one prefill)."""
        for k_cache, v_cache in zip(self.k_LSHPD, self.v_LSHPD):
            k_cache[dst_slot, :, :length] = k_cache[src_slot, :, :length]
            v_cache[dst_slot, :, :length] = v_cache[src_slot, :, :length]


class KVStep(Protocol):
    """What attention needs from a forward that reads keys/values beyond its own input positions."""

    mask_B1TS: torch.Tensor

    def update(self, layer_idx: int, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class CacheStep:
    """One forward's view of the cache: every layer writes its new keys/values and reads the prefix."""

    cache: KVCache
    slots: torch.Tensor | slice
    positions_BT: torch.Tensor
    rows_BT: torch.Tensor
    length: int
    mask_B1TS: torch.Tensor
    """Key position <= query position: what each query may attend to."""

    def update(self, layer_idx: int, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys/values, return each row's cached prefix as (k, v) of shape [B, H, S, D]."""
        k_cache, v_cache = self.cache.k_LSHPD[layer_idx], self.cache.v_LSHPD[layer_idx]
        if isinstance(self.slots, slice):
            k_cache, v_cache = k_cache[self.slots], v_cache[self.slots]
        # Indexing [rows, :, positions] puts the indexed dims first: [B, T, H, D].
        k_cache[self.rows_BT, :, self.positions_BT] = k_BHTD.transpose(1, 2).to(k_cache.dtype)
        v_cache[self.rows_BT, :, self.positions_BT] = v_BHTD.transpose(1, 2).to(v_cache.dtype)
        if isinstance(self.slots, slice):
            return k_cache[:, :, : self.length], v_cache[:, :, : self.length]
        return k_cache[self.slots, :, : self.length], v_cache[self.slots, :, : self.length]
