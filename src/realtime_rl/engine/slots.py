"""The engine's KV-cache slots: which are free, what a freed slot still holds, which one a request takes.

    slots = SlotTable(32, version=0, prefix_caching=True, prefix_max_age=2, need_routing=True)
    source, live_hit = slots.live_prefix(prompt_ids, version)  # a running slot holding more of the prompt
    slot, hit = slots.take(prompt_ids, version, beat=live_hit)  # hit: leading prompt tokens its cache holds
    slots.hold(slot, prompt_ids, routing)             # prefilled: other requests may copy its prompt
    slots.release(slot, tokens, routing)              # free again; the cache stays for the next taker
    slots.discard_taken()                             # every slot free, the taken ones' caches dropped (abort_all)
    slots.computed(slot, hit, len(prompt_ids))        # the prefill computed those positions' keys/values
    slots.copied(slot, other, len(prompt_ids))        # another sample of the prompt got a copy of them
    batch = decode_slots([3, 4, 6], [900, 40, 2100], gather=False, device=device,  # how a decode step reads
                         lineages=[slots.blocks[s] for s in (3, 4, 6)])

A freed slot keeps the keys/values of every token its sequence fed the model, and their MoE routing, until
it is reused. `take` gives a request the free slot whose cache shares the longest prefix with its prompt,
under the reuse rules of engine.py's docstring (the weights that computed the cache, or a continuation of
the cached sequence within `prefix_max_age` versions, never across a rollback), else the least recently
freed slot. Each slot remembers the version of its oldest keys/values and the cache epoch they belong to.

A slot in use holds its prompt's keys/values from its prefill on (`hold`); `live_prefix` finds the one
sharing the longest prefix with a new prompt among those the current weights computed entirely, so the
engine copies it instead of recomputing it (the episodes of one GRPO group, or of tasks sharing a system
prompt, arriving while another is still decoding): exact, since the same weights computed it.

Each slot also records where its keys/values came from (`blocks`): runs of positions from 0, each named by
the computation (a prefill, or a sequence's decoded tokens) that wrote it; a copy takes the source's runs.
Two slots whose runs agree up to position p hold bit-identical keys/values before p, whatever the weights'
versions, so a decode step reads them once for all its rows (`shared_runs`, the model's `SharedRows`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np
import torch

from realtime_rl.model.kv_cache import SharedRows, SharedRun, SlotRows, SlotWindow

ROW_CALL_POSITIONS = 300
"""One attention call per row (SlotRows) costs about as much as attending over this many more key positions
(on CPU, one thread: ~10 us a call against ~30 ns a row-position)."""
GATHER_COST = 2
"""Gathering copies every row's prefix in every layer: about as costly again as attending over it."""
RUN_CALL_POSITIONS = 2500
"""A shared run (`SharedRows`) costs an attention call for its rows' stacked queries and a log-sum-exp merge:
about as much as attending over this many more key positions (on CPU, one thread; at 1500, 690 positions
shared by 4 agent episodes read apart made a decode step 8% slower than reading each row's own)."""

Blocks = list[tuple[int, int]]
"""(computation id, end position) runs: the first covers positions 0..end-1, each next one on from there."""


class SlotTable:
    def __init__(self, count: int, version: int, *, prefix_caching: bool, prefix_max_age: int,
                 need_routing: bool) -> None:
        if prefix_max_age < 0:
            raise ValueError(f"prefix_max_age must be >= 0, got {prefix_max_age}")
        self.prefix_caching = prefix_caching
        self.prefix_max_age = prefix_max_age
        self.need_routing = need_routing
        self.free = list(range(count))
        self.tokens: list[np.ndarray | None] = [None] * count  # tokens whose keys/values a free slot holds
        self.routing: list[torch.Tensor | None] = [None] * count  # and their routing
        self.kv_version = [version] * count  # the version of a slot's oldest keys/values
        # A swap to an older version (a rollback) starts a new epoch: no cache from before it is reused, since
        # the versions a slot's keys/values span are no longer ordered by when they were computed.
        self.epoch = 0
        self.kv_epoch = [0] * count
        self._freed_at = [-1] * count  # when each slot was last freed (LRU eviction)
        self._frees = itertools.count()
        self.blocks: list[Blocks] = [[] for _ in range(count)]  # where each slot's keys/values came from
        self._computations = itertools.count()

    def rollback(self) -> None:
        """The weights went back to an older version: nothing cached so far is reusable."""
        self.epoch += 1

    def take(self, prompt: Sequence[int] | None, version: int, shares: int | None = None,
             beat: int = 0) -> tuple[int, int]:
        """(a free slot, how many leading prompt tokens its cache already holds), for weights `version`.

        The slot with the longest reusable cached prefix of `prompt`, if longer than `beat` (what a slot in
        use could give, `live_prefix`); otherwise the least recently freed slot. At least one prompt token is
        always recomputed, for its logits. `shares`: the slot whose prompt keys/values this one will receive
        a copy of (another sample of the same request); it takes on that slot's version and epoch.
        """
        best, best_hit = None, beat
        if prompt is not None and self.prefix_caching:
            p = np.asarray(prompt)
            for slot in self.free:
                cached = self.tokens[slot]
                if cached is None or (self.need_routing and self.routing[slot] is None):
                    continue
                if self.kv_epoch[slot] != self.epoch:
                    continue  # computed before a swap back to older weights
                if self.kv_version[slot] < version - self.prefix_max_age:
                    continue  # computed by weights older than the engine will reuse
                hit = shared_prefix(cached, p)
                if self.kv_version[slot] < version and hit < len(cached):
                    continue  # older keys/values only for a continuation: the prompt holds the whole sequence
                if hit > best_hit:
                    best, best_hit = slot, hit
        if best is None:
            best, best_hit = min(self.free, key=lambda s: (self._freed_at[s], s)), 0
        self.free.remove(best)
        self.tokens[best] = None
        if shares is not None:
            self.kv_version[best], self.kv_epoch[best] = self.kv_version[shares], self.kv_epoch[shares]
        elif not best_hit:
            self.kv_version[best], self.kv_epoch[best] = version, self.epoch
        return best, best_hit

    def live_prefix(self, prompt: Sequence[int], version: int) -> tuple[int | None, int]:
        """(the slot in use whose held prompt shares the longest prefix with `prompt`, how many tokens; at
        least one prompt token left to recompute), among those whose every key/value weights `version`
        computed in this epoch; (None, 0) when none shares any."""
        best, best_hit = None, 0
        if not self.prefix_caching:
            return best, best_hit
        p = np.asarray(prompt)
        for slot, held in enumerate(self.tokens):
            if held is None or slot in self.free:
                continue
            if self.kv_version[slot] != version or self.kv_epoch[slot] != self.epoch:
                continue  # some of its keys/values older weights computed
            if self.need_routing and self.routing[slot] is None:
                continue
            hit = shared_prefix(held, p)
            if hit > best_hit:
                best, best_hit = slot, hit
        return best, best_hit

    def discard_taken(self) -> None:
        """Free every slot in use without keeping its keys/values for reuse: their requests were cut off, maybe
        mid-step (the engine stopped or failed), so what the slots hold is not known to be whole."""
        for slot in sorted(set(range(len(self.tokens))) - set(self.free)):
            self.free.append(slot)
            self._freed_at[slot] = next(self._frees)
            self.tokens[slot], self.routing[slot], self.blocks[slot] = None, None, []

    def computed(self, slot: int, start: int, end: int) -> None:
        """Positions start..end-1 of `slot` were just computed (a prefill from `start`): new keys/values that no
        other slot holds yet; those before `start` are kept."""
        self.blocks[slot] = _cut(self.blocks[slot], start) + [(next(self._computations), end)]

    def copied(self, source: int, slot: int, length: int) -> None:
        """`slot` got a copy of positions 0..length-1 of `source` (`KVCache.copy_prefix`)."""
        self.blocks[slot] = _cut(self.blocks[source], length)

    def hold(self, slot: int, prompt: Sequence[int], routing: torch.Tensor | None) -> None:
        """`slot`, in use, now holds the keys/values (and routing) of `prompt`: others may copy them."""
        self.tokens[slot] = np.asarray(prompt)
        self.routing[slot] = routing

    def pop_routing(self, slot: int) -> torch.Tensor | None:
        """The cached routing of a slot just taken (its prefix's rows), no longer kept for the slot."""
        routing, self.routing[slot] = self.routing[slot], None
        return routing

    def release(self, slot: int, tokens: Sequence[int], routing: torch.Tensor | None) -> None:
        """Free `slot`, whose cache holds the keys/values of `tokens` (its request's prompt and output)."""
        self.free.append(slot)
        self._freed_at[slot] = next(self._frees)
        held = self.blocks[slot][-1][1] if self.blocks[slot] else 0
        if held < len(tokens):
            self.computed(slot, held, len(tokens))  # the tokens it decoded
        self.tokens[slot] = np.asarray(tokens)
        if routing is not None:
            self.routing[slot] = routing


def shared_prefix(cached: np.ndarray, prompt: np.ndarray) -> int:
    """How many leading tokens of `prompt` `cached` holds; the prompt's last token is always recomputed
    (for its logits)."""
    n = min(len(cached), len(prompt) - 1)
    differ = np.flatnonzero(cached[:n] != prompt[:n])
    return int(differ[0]) if len(differ) else n


def decode_slots(slots: Sequence[int], lengths: Sequence[int], gather: bool, device: torch.device,
                 lineages: Sequence[Blocks] | None = None) -> torch.Tensor | int | SlotWindow | SlotRows | SharedRows:
    """How a decode batch whose rows run in `slots` (ascending) with `lengths` cached keys each (position + 1)
    reads the cache, whichever costs the fewest key positions attended (padding included): as a view of
    the slots they span (the first slot when consecutive, else their window: every row padded to the longest
    and the free slots' rows computed and dropped), row by row (`SlotRows`: exactly each row's own keys,
    plus a call per row), gathered (a copy of each row's prefix, padded to the longest: the only way when
    `gather`, since a compiled graph that reads a view specialises on the batch size), or, given the slots'
    `lineages` (`SlotTable.blocks`), reading the runs of keys/values several rows hold alike once each and
    the rest of every row's own (`SharedRows`)."""
    if gather:
        return torch.tensor(list(slots), device=device)
    rows, longest = len(slots), max(lengths)
    span = slots[-1] - slots[0] + 1
    view, gathered = span * longest, GATHER_COST * rows * longest
    by_row = sum(lengths) + ROW_CALL_POSITIONS * rows
    if lineages is not None:
        shared = shared_runs(slots, lineages, lengths, device)
        if shared is not None:
            own = longest - shared.first
            together = rows * own if span == rows else GATHER_COST * rows * own
            apart = sum(n - start for n, start in zip(lengths, shared.starts)) + ROW_CALL_POSITIONS * rows
            runs = sum(r.end - r.start + RUN_CALL_POSITIONS for level in shared.levels for r in level)
            if runs + min(together, apart) < min(view, by_row, gathered):
                return dataclasses.replace(shared, by_row=apart < together)
    if view <= min(by_row, gathered):
        return slot_view(slots, device)
    if by_row <= gathered:
        return SlotRows(list(slots), list(lengths))
    return torch.tensor(list(slots), device=device)


def shared_runs(slots: Sequence[int], lineages: Sequence[Blocks], lengths: Sequence[int], device: torch.device
                ) -> SharedRows | None:
    """How decode rows in `slots` (whose keys/values came from `lineages`, `lengths` to read each) read the runs
    of positions several of their slots hold alike: each run worth reading once (it saves more key positions
    than its call costs), nested (rows sharing a system prompt, then those of them sharing a task's prompt).
    None when no run is worth it. Each row keeps at least its own position to read from its own slot."""
    levels: list[list[SharedRun]] = []
    starts = [0] * len(slots)

    def split(rows: list[int], start: int, depth: int) -> None:
        by_block: dict[int, list[int]] = {}
        for r in rows:
            block = _block_at(lineages[r], start)
            if block is not None:
                by_block.setdefault(block, []).append(r)
        for group in by_block.values():
            if len(group) < 2:
                continue
            end = min(min(_common(lineages[group[0]], lineages[r]) for r in group[1:]),
                      min(lengths[r] - 1 for r in group))
            if (len(group) - 1) * (end - start) <= RUN_CALL_POSITIONS:
                continue
            if depth == len(levels):
                levels.append([])
            levels[depth].append(SharedRun(torch.tensor(group, device=device), slots[group[0]], start, end))
            for r in group:
                starts[r] = end
            split(group, end, depth + 1)

    split(list(range(len(slots))), 0, 0)
    return SharedRows(list(slots), starts, levels, list(lengths), by_row=False) if levels else None


def _cut(blocks: Blocks, length: int) -> Blocks:
    """The runs of `blocks` that cover positions 0..length-1 (the last one cut at `length`)."""
    kept: Blocks = []
    for block, end in blocks:
        if end >= length:
            return kept + [(block, length)] if length > 0 else kept
        kept.append((block, end))
    return kept


def _block_at(blocks: Blocks, position: int) -> int | None:
    """The computation that wrote `position` (None past the runs)."""
    for block, end in blocks:
        if position < end:
            return block
    return None


def _common(a: Blocks, b: Blocks) -> int:
    """How many leading positions two slots' runs agree on."""
    agreed = 0
    for (block_a, end_a), (block_b, end_b) in zip(a, b):
        if block_a != block_b:
            break
        if end_a != end_b:
            return min(end_a, end_b)
        agreed = end_a
    return agreed


def slot_view(slots: Sequence[int], device: torch.device) -> int | SlotWindow:
    """The view of ascending `slots`: the first one when they are consecutive, else the window they lie in."""
    span = slots[-1] - slots[0] + 1
    if span == len(slots):
        return slots[0]
    return SlotWindow(slots[0], span, torch.tensor([s - slots[0] for s in slots], device=device))
