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

Slots often hold the same keys/values for a prompt's leading positions: the engine copies a prompt's prefill
(`copy_prefix`) to every episode of a GRPO group and a system prompt to each request sharing it. A decode
step may then give `SharedRows` (cascade attention, as FlashInfer's): each shared run of positions is
attended once for all its rows, their queries stacked as one row's, then every row attends over the rest of
its own keys, and the parts merge by their log-sum-exps. The rows then read each shared prompt once instead
of once per row (on CPU, most of a decode step's attention over a rollout worker's batch of groups).

Not here: paging (a shared prefix is copied into each slot; `SharedRows` only reads it once).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
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

    def begin(self, slots: torch.Tensor | slice | SlotWindow | SlotRows | SharedRows, positions_BT: torch.Tensor,
              length: int | None = None) -> CacheStep:
        """Start one forward over the cache: the prefix length, row indices and mask, once for all layers.

        `slots` is a LongTensor [B] of slot ids (each layer gathers the rows' prefixes), a `slice` of
        consecutive slots in row order or a `SlotWindow` (each layer reads the prefixes as a view), or, for a
        decode step, `SlotRows` (each row reads its own prefix as a view, one attention call per row) or
        `SharedRows` (runs of positions several rows' slots hold alike read once, the rest from each row's own).
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
        if isinstance(slots, SharedRows):
            if positions_BT.shape[1] != 1 or len(slots.slots) != positions_BT.shape[0]:
                raise ValueError(f"SharedRows is for decode: one position per row, got positions of shape "
                                 f"{tuple(positions_BT.shape)} for {len(slots.slots)} slots")
            rows_BT = torch.tensor(slots.slots, device=positions_BT.device)[:, None]
            if slots.by_row:
                return CacheStep(self, slots, positions_BT, rows_BT, length, None)
            own_pos_S = torch.arange(slots.first, length, device=positions_BT.device)
            starts_B1 = torch.tensor(slots.starts, device=positions_BT.device)[:, None]
            visible_BS = (own_pos_S >= starts_B1) & (own_pos_S <= positions_BT)
            bias_BS = torch.zeros(visible_BS.shape, dtype=self.k_LSHPD[0].dtype, device=positions_BT.device)
            bias_BS.masked_fill_(~visible_BS, float("-inf"))
            return CacheStep(self, slots, positions_BT, rows_BT, length, None, bias_BS[:, None, None, :])
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
        """Copy positions [0, length) of one slot into another (n samples sharing one prefill): bit for bit,
        so a decode step may read them from either (`SharedRows`)."""
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


@dataclass(frozen=True)
class SharedRun:
    """Positions start..end-1 whose keys/values the slots of batch rows `rows` hold alike (copies of one
    prefill), read once, from `slot`."""

    rows: torch.Tensor
    """LongTensor [m], m >= 2: the batch rows (indices) that read this run."""
    slot: int
    start: int
    end: int


@dataclass(frozen=True)
class SharedRows:
    """Decode rows (one query each) in any slots, some of which share runs of keys/values (cascade attention):
    each run is attended once for all its rows; row b reads its own slot from position `starts[b]` (where its
    last run ends; 0 for a row that shares nothing) to its own: `by_row`, one call per row over exactly
    those keys (`lengths[b]` = its position + 1), else all rows in one call, padded to the longest (a view
    where the slots are consecutive, else gathered). `levels`: the runs by depth (a system prompt's, then the
    task prompts' continuing it): no row is in two runs of one level."""

    slots: list[int]
    starts: list[int]
    levels: list[list[SharedRun]]
    lengths: list[int]
    by_row: bool

    @cached_property
    def level_rows(self) -> list[torch.Tensor]:
        """Each level's runs' rows, concatenated (once per decode step, for every layer)."""
        return [torch.cat([run.rows for run in level]) for level in self.levels]

    @property
    def first(self) -> int:
        """The first position any row reads from its own slot."""
        return min(self.starts)


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


_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attention_lse(q_BKQD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor,
                  bias_B1QS: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of Q queries per key/value head (query heads already folded onto them) over all of k/v, and
    each query's log-sum-exp of scores (fp32 [B, K, Q]), so that attention over disjoint key sets merges
    exactly (`merge_attention`). `bias_B1QS`: added to the scores (-inf hides a key)."""
    if _flash_cpu is not None and q_BKQD.device.type == "cpu" and q_BKQD.dtype in (torch.float32, torch.bfloat16):
        return _flash_cpu(q_BKQD, k_BKSD, v_BKSD, 0.0, False, attn_mask=bias_B1QS)
    scores_BKQS = (q_BKQD.float() @ k_BKSD.float().transpose(-1, -2)) * q_BKQD.shape[-1] ** -0.5
    if bias_B1QS is not None:
        scores_BKQS = scores_BKQS + bias_B1QS
    lse_BKQ = scores_BKQS.logsumexp(-1)
    out_BKQD = (scores_BKQS - lse_BKQ[..., None]).exp().to(v_BKSD.dtype) @ v_BKSD
    return out_BKQD, lse_BKQ


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from attention over each (outputs [..., D], fp32
    log-sum-exps [...]): the softmax-weighted mean of the two, weighed in fp32, in out_a's dtype."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a, weight_b = (lse_a - lse).exp()[..., None], (lse_b - lse).exp()[..., None]
    return (out_a * weight_a + out_b * weight_b).to(out_a.dtype), lse


def cascade_attention(q_BHTD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: SharedRows,
                      slots_B: torch.Tensor, length: int, bias_B11S: torch.Tensor | None) -> torch.Tensor:
    """Decode attention of rows whose slots share runs of keys/values (`SharedRows`; `slots_B` their slots as
    a tensor): each row over its own slot's keys from its start (one call per row, or all rows over positions
    `rows.first`..`length`-1 with `bias_B11S` -inf where a row may not look), then each run once for its
    rows' queries stacked (a run of P positions read once instead of m times), merged by log-sum-exp."""
    B, H, _, D = q_BHTD.shape
    K = k_cache.shape[1]
    G = H // K
    q_BKGD = q_BHTD.reshape(B, K, G, D)
    if rows.by_row:
        parts = [attention_lse(q_BKGD[b : b + 1], k_cache[s : s + 1, :, start:n], v_cache[s : s + 1, :, start:n])
                 for b, (s, start, n) in enumerate(zip(rows.slots, rows.starts, rows.lengths, strict=True))]
        out_BKGD, lse_BKG = torch.cat([out for out, _ in parts]), torch.cat([lse for _, lse in parts])
    else:
        assert bias_B11S is not None
        own = slice(rows.first, length)
        first_slot = rows.slots[0]
        if rows.slots == list(range(first_slot, first_slot + B)):
            k_own, v_own = k_cache[first_slot : first_slot + B, :, own], v_cache[first_slot : first_slot + B, :, own]
        else:
            k_own, v_own = k_cache[:, :, own].index_select(0, slots_B), v_cache[:, :, own].index_select(0, slots_B)
        out_BKGD, lse_BKG = attention_lse(q_BKGD, k_own, v_own, bias_B11S)
    for level, level_rows in zip(rows.levels, rows.level_rows, strict=True):
        outs, lses = [], []
        for run in level:
            m = run.rows.shape[0]
            q_1KQD = q_BKGD.index_select(0, run.rows).transpose(0, 1).reshape(1, K, m * G, D)
            out_1KQD, lse_1KQ = attention_lse(q_1KQD, k_cache[run.slot : run.slot + 1, :, run.start : run.end],
                                              v_cache[run.slot : run.slot + 1, :, run.start : run.end])
            outs.append(out_1KQD.reshape(K, m, G, D).transpose(0, 1))
            lses.append(lse_1KQ.reshape(K, m, G).transpose(0, 1))
        merged_out, merged_lse = merge_attention(out_BKGD.index_select(0, level_rows),
                                                 lse_BKG.index_select(0, level_rows), torch.cat(outs), torch.cat(lses))
        out_BKGD = out_BKGD.index_copy(0, level_rows, merged_out)
        lse_BKG = lse_BKG.index_copy(0, level_rows, merged_lse)
    return out_BKGD.reshape(B, H, 1, D)


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
    slots: torch.Tensor | slice | SlotWindow | SlotRows | SharedRows
    positions_BT: torch.Tensor
    rows_BT: torch.Tensor
    """The slot each new key/value goes to."""
    length: int
    mask_B1TS: torch.Tensor | None
    """Key position <= query position: what each query may attend to (a window's rows: every slot in it;
    None for SlotRows, whose rows read exactly their own keys, and for SharedRows)."""
    bias_B11S: torch.Tensor | None = None
    """SharedRows read in one call: 0 where a row may see its own slot's key at positions `first`..length-1,
    else -inf."""

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
        if isinstance(slots, SharedRows):
            return cascade_attention(q_BHTD, k_cache, v_cache, slots, self.rows_BT[:, 0], self.length, self.bias_B11S)
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
