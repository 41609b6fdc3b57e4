"""A preallocated key/value cache with one slot per concurrent sequence.

Slot `s` holds the keys and values of one sequence at positions 0..S-1, head-major ([slot, head,
position, dim]), so the prefix a decode step reads is one contiguous block per slot and head: attention
runs on it in place, without a transposed copy. A forward writes its new keys/values at the given
positions of the given slots and attends over each row's prefix up to the longest position in the batch
(`begin` once per forward, then `CacheStep.attend` per layer), masking keys past each query's own
position, so rows of different lengths share one batched decode step. Rows in consecutive slots read
their prefixes as a view; so do rows in a `SlotWindow` (ascending slots with a few free ones between
them, what continuous batching leaves): attention runs over every slot of the window, the free slots'
rows padded and dropped, instead of gathering a copy of each row's prefix in every layer (on CPU that
copy was the largest cost of a decode step at agent-episode lengths). A decode step may instead give
`SlotRows`: each row attends over exactly its own prefix, one attention call per row on a view of its
slot, neither padded to the batch's longest row nor copied (agent episodes in flight differ in length by
thousands of tokens; the engine picks whichever way costs least, engine/slots.py). Freeing a slot is free:
the next sequence that gets it overwrites positions from 0 and never attends past its own position.

Not here: paging, prefix sharing between slots (the engine copies a prefix with `copy_prefix`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

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

    def begin(self, slots: torch.Tensor | slice | SlotWindow | SlotRows, positions_BT: torch.Tensor,
              length: int | None = None) -> CacheStep:
        """Start one forward over the cache: the prefix length, row indices and mask, once for all layers.

        `slots` is a LongTensor [B] of slot ids (each layer gathers the rows' prefixes), a `slice` of
        consecutive slots in row order or a `SlotWindow` (each layer reads the prefixes as a view), or, for a
        decode step, `SlotRows` (each row reads its own prefix as a view, one attention call per row).
        `length` (default: the largest position + 1, read from the tensor) is the prefix every row reads;
        a caller that knows it passes it, which keeps a compiled forward free of data-dependent shapes.
        """
        if length is None:
            length = int(positions_BT.max()) + 1
        if length > self.max_seq_len:
            raise ValueError(f"position {length - 1} exceeds the KV cache length {self.max_seq_len}")
        if isinstance(slots, SlotRows):
            if positions_BT.shape[1] != 1 or len(slots.slots) != positions_BT.shape[0]:
                raise ValueError(f"SlotRows is for decode: one position per row, got positions of shape "
                                 f"{tuple(positions_BT.shape)} for {len(slots.slots)} slots")
            rows_BT = torch.tensor(slots.slots, device=positions_BT.device)[:, None]
            return CacheStep(self, slots, positions_BT, rows_BT, length, None)
        key_pos_S = torch.arange(length, device=positions_BT.device)
        query_pos_BT = positions_BT
        if isinstance(slots, SlotWindow):
            rows_BT = (slots.start + slots.offsets)[:, None].expand_as(positions_BT)
            # Each free slot of the window gets a query row that sees only key 0: finite, then dropped.
            query_pos_BT = positions_BT.new_zeros((slots.size, positions_BT.shape[1])).index_copy(
                0, slots.offsets, positions_BT)
        elif isinstance(slots, slice):
            first = slots.start or 0
            rows_BT = torch.arange(first, first + positions_BT.shape[0], device=positions_BT.device)
            rows_BT = rows_BT[:, None].expand_as(positions_BT)
        else:
            rows_BT = slots[:, None].expand_as(positions_BT)
        mask_B1TS = key_pos_S[None, None, None, :] <= query_pos_BT[:, None, :, None]
        return CacheStep(self, slots, positions_BT, rows_BT, length, mask_B1TS)

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Copy positions [0, length) of one slot into another (n samples sharing one prefill)."""
        for k_cache, v_cache in zip(self.k_LSHPD, self.v_LSHPD):
            k_cache[dst_slot, :, :length] = k_cache[src_slot, :, :length]
            v_cache[dst_slot, :, :length] = v_cache[src_slot, :, :length]


@dataclass(frozen=True)
class SlotWindow:
    """Rows whose slots lie in start .. start + size - 1, ascending, some slots between them unused."""

    start: int
    size: int
    offsets: torch.Tensor
    """LongTensor [B]: each row's slot - start."""


@dataclass(frozen=True)
class SlotRows:
    """Decode rows (one query each) in any slots, each reading exactly its own prefix: `lengths[i]` keys of
    slot `slots[i]` (its position + 1)."""

    slots: list[int]
    lengths: list[int]


class KVStep(Protocol):
    """What attention needs from a forward that reads keys/values beyond its own input positions."""

    def attend(self, layer_idx: int, q_BHTD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor
               ) -> torch.Tensor:
        """Take this forward's new keys/values; return the queries' attention output [B, H, T, D]."""
        ...


def masked_attention(q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor,
                     mask_B1TS: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention over K key/value heads with a boolean mask. The G = H / K query heads that
    share a key/value head are folded into the query positions, so attention reads each key/value head
    once and never expands it to H heads (on CPU, ~20% of a decode step's attention)."""
    B, H, T, D = q_BHTD.shape
    K = k_BKSD.shape[1]
    G = H // K
    q_BKQD = q_BHTD.reshape(B, K, G * T, D)  # query head h = kv head h // G, as in enable_gqa
    mask_B1QS = mask_B1TS.repeat(1, 1, G, 1) if G > 1 and T > 1 else mask_B1TS
    out_BKQD = F.scaled_dot_product_attention(q_BKQD, k_BKSD, v_BKSD, attn_mask=mask_B1QS)
    return out_BKQD.reshape(B, H, T, D)  # a CUDA kernel may return it strided: reshape copies only then


def row_attention(q_1HTD: torch.Tensor, k_1KSD: torch.Tensor, v_1KSD: torch.Tensor) -> torch.Tensor:
    """One row's attention over all of k/v (no mask: the caller passes exactly the keys it may see), its
    query heads folded onto the key/value heads as in masked_attention."""
    _, H, T, D = q_1HTD.shape
    K = k_1KSD.shape[1]
    out = F.scaled_dot_product_attention(q_1HTD.reshape(1, K, H // K * T, D), k_1KSD, v_1KSD)
    return out.reshape(1, H, T, D)


@dataclass
class CacheStep:
    """One forward's view of the cache: every layer writes its new keys/values and reads the prefix."""

    cache: KVCache
    slots: torch.Tensor | slice | SlotWindow | SlotRows
    positions_BT: torch.Tensor
    rows_BT: torch.Tensor
    """The slot each new key/value goes to."""
    length: int
    mask_B1TS: torch.Tensor | None
    """Key position <= query position: what each query may attend to (a window's rows: every slot in it;
    None for SlotRows, whose rows read exactly their own keys)."""

    def attend(self, layer_idx: int, q_BHTD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor
               ) -> torch.Tensor:
        k_cache, v_cache = self.cache.k_LSHPD[layer_idx], self.cache.v_LSHPD[layer_idx]
        # Indexing [rows, :, positions] puts the indexed dims first: [B, T, H, D].
        k_cache[self.rows_BT, :, self.positions_BT] = k_BHTD.transpose(1, 2).to(k_cache.dtype)
        v_cache[self.rows_BT, :, self.positions_BT] = v_BHTD.transpose(1, 2).to(v_cache.dtype)
        slots = self.slots
        if isinstance(slots, SlotRows):
            rows = enumerate(zip(slots.slots, slots.lengths, strict=True))
            return torch.cat([row_attention(q_BHTD[b : b + 1], k_cache[s : s + 1, :, :n],
                                            v_cache[s : s + 1, :, :n]) for b, (s, n) in rows])
        assert self.mask_B1TS is not None
        if isinstance(slots, SlotWindow):
            window = slice(slots.start, slots.start + slots.size)
            q_WHTD = q_BHTD.new_zeros((slots.size, *q_BHTD.shape[1:])).index_copy(0, slots.offsets, q_BHTD)
            out_WHTD = masked_attention(q_WHTD, k_cache[window, :, : self.length],
                                        v_cache[window, :, : self.length], self.mask_B1TS)
            return out_WHTD.index_select(0, slots.offsets)
        k_cache, v_cache = k_cache[:, :, : self.length], v_cache[:, :, : self.length]
        if isinstance(slots, slice):
            return masked_attention(q_BHTD, k_cache[slots], v_cache[slots], self.mask_B1TS)
        # A copy of each row's prefix (index_select: several times faster than advanced indexing on CPU).
        return masked_attention(q_BHTD, k_cache.index_select(0, slots), v_cache.index_select(0, slots),
                                self.mask_B1TS)
