"""The engine's slot table: which free slot a request takes, and how a decode batch addresses its slots.
(tests/unit/test_engine.py checks the same rules end to end, through the engine's outputs.)"""

import pytest
import torch

from realtime_rl.engine.slots import SlotTable, decode_slots, shared_runs
from realtime_rl.model.kv_cache import SharedRows, SlotRows, SlotWindow

CPU = torch.device("cpu")


def table(count=3, max_age=0):
    return SlotTable(count, version=0, prefix_caching=True, prefix_max_age=max_age, need_routing=False)


def test_takes_the_longest_cached_prefix_else_the_least_recently_freed():
    slots = table()
    a, _ = slots.take([1, 2, 3], 0)
    b, _ = slots.take([7, 8], 0)
    slots.release(b, [7, 8, 9], None)
    slots.release(a, [1, 2, 3, 4], None)
    assert slots.take([1, 2, 3, 4, 5], 0) == (a, 4)
    assert slots.take([1, 2, 3, 4], 0) == (2, 0)  # a is taken; the never-used slot is the least recently freed
    assert slots.take([6], 0) == (b, 0)


def test_at_least_one_prompt_token_is_recomputed():
    slots = table(1)
    slots.release(slots.take([1, 2, 3], 0)[0], [1, 2, 3, 4], None)
    assert slots.take([1, 2, 3], 0) == (0, 2)


def test_older_keys_values_only_for_a_continuation_within_the_age_bound():
    slots = table(1, max_age=1)
    slots.release(slots.take([1, 2, 3], 0)[0], [1, 2, 3, 9, 9], None)  # version 0's keys/values
    assert slots.take([1, 2, 3, 9, 9, 5], 1) == (0, 5)  # runs past the old prompt into what was generated
    slots.release(0, [1, 2, 3, 9, 9, 5, 7], None)
    assert slots.kv_version[0] == 0  # the oldest keys/values are still version 0's
    assert slots.take([1, 2, 3, 9, 9, 5, 7, 8], 2) == (0, 0)  # two versions old: past the bound
    assert slots.kv_version[0] == 2
    slots.release(0, [1, 2, 3, 9, 9], None)
    assert slots.take([1, 2, 3, 4], 3) == (0, 0)  # shares only the old prompt: prefilled afresh
    slots.release(0, [1, 2, 3, 9, 9], None)
    # Past the old prompt into its first generated token, then apart: another episode's turn (a sibling of
    # the same task that began with the same token), not this sequence's continuation: prefilled afresh.
    assert slots.take([1, 2, 3, 9, 4, 4], 4) == (0, 0)


def test_a_rollback_makes_nothing_cached_reusable():
    slots = table(1, max_age=2)
    slots.release(slots.take([1, 2, 3], 0)[0], [1, 2, 3, 4], None)
    slots.rollback()
    assert slots.take([1, 2, 3, 4, 5], 0) == (0, 0)
    assert slots.kv_epoch[0] == slots.epoch == 1


def test_a_sample_sharing_a_prompt_takes_on_its_version():
    slots = table(2, max_age=2)
    first, _ = slots.take([1, 2], 0)
    slots.kv_version[first] = 3
    second, hit = slots.take(None, 5, shares=first)
    assert hit == 0 and slots.kv_version[second] == 3


def test_a_slot_in_use_lends_its_prompt_only_when_the_current_weights_computed_all_of_it():
    slots = table(3, max_age=2)
    a, _ = slots.take([1, 2, 3, 4], 0)
    assert slots.live_prefix([1, 2, 3, 5], 0) == (None, 0)  # taken but not yet prefilled
    slots.hold(a, [1, 2, 3, 4], None)
    assert slots.live_prefix([1, 2, 3, 5], 0) == (a, 3)
    assert slots.live_prefix([1, 2, 3, 4], 0) == (a, 3)  # one prompt token is recomputed, for its logits
    assert slots.live_prefix([9, 2], 0) == (None, 0)
    # A free slot's cache is taken only when it holds more than the slot in use would lend.
    b, _ = slots.take([7], 0)
    slots.release(b, [1, 2, 9], None)
    assert slots.take([1, 2, 3, 5], 0, beat=3) == (2, 0)  # the least recently freed one, nothing reused
    slots.release(2, [], None)
    assert slots.take([1, 2, 9, 9], 0, beat=1) == (b, 3)
    # Weights moved on (even within prefix_max_age) or rolled back: not lent.
    assert slots.live_prefix([1, 2, 3, 5], 1) == (None, 0)
    slots.rollback()
    assert slots.live_prefix([1, 2, 3, 5], 0) == (None, 0)
    # Freed, its cache is a free slot's again.
    slots.release(a, [1, 2, 3, 4], None)
    assert slots.live_prefix([1, 2, 3, 5], 0) == (None, 0)


def test_routing_is_needed_for_reuse_when_the_engine_records_it():
    slots = SlotTable(1, version=0, prefix_caching=True, prefix_max_age=0, need_routing=True)
    slots.release(slots.take([1, 2, 3], 0)[0], [1, 2, 3, 4], None)
    assert slots.take([1, 2, 3, 4, 5], 0) == (0, 0)
    routing = torch.zeros(4, 1, 2, dtype=torch.long)
    slots.release(0, [1, 2, 3, 4], routing)
    assert slots.take([1, 2, 3, 4, 5], 0) == (0, 4)
    assert slots.pop_routing(0) is routing and slots.pop_routing(0) is None


def test_no_prefix_caching_never_reuses():
    slots = SlotTable(1, version=0, prefix_caching=False, prefix_max_age=0, need_routing=False)
    slots.release(slots.take([1, 2, 3], 0)[0], [1, 2, 3, 4], None)
    assert slots.take([1, 2, 3, 4, 5], 0) == (0, 0)


def test_bad_age_is_rejected():
    with pytest.raises(ValueError, match="prefix_max_age"):
        table(max_age=-1)


def test_decode_batch_reads_the_cache_the_cheapest_way():
    # Consecutive slots of equal lengths: a view, nothing padded.
    assert decode_slots([4, 5, 6], [900, 900, 900], gather=False, device=CPU) == 4
    # One free slot among short rows of equal lengths: padding one row costs less than a call per row.
    window = decode_slots([4, 5, 7], [200, 200, 200], gather=False, device=CPU)
    assert isinstance(window, SlotWindow) and (window.start, window.size) == (4, 4)
    assert window.offsets.tolist() == [0, 1, 3]
    # Agent episodes: lengths thousands of tokens apart; padding every row to the longest costs more.
    rows = decode_slots([4, 5, 7], [300, 2500, 800], gather=False, device=CPU)
    assert isinstance(rows, SlotRows) and rows.slots == [4, 5, 7] and rows.lengths == [300, 2500, 800]
    # Short rows far apart: copying two short prefixes beats two calls or a window of ten slots.
    assert decode_slots([0, 9], [40, 40], gather=False, device=CPU).tolist() == [0, 9]
    # A compiled decode graph always gathers.
    assert decode_slots([4, 5, 6], [300, 2500, 800], gather=True, device=CPU).tolist() == [4, 5, 6]


def test_slots_know_which_keys_values_they_hold_alike():
    t = table(count=5)
    assert [t.take(None, version=0) for _ in range(5)] == [(s, 0) for s in range(5)]
    t.computed(0, 0, 2000)  # a system prompt
    t.computed(0, 2000, 5000)  # ... and a long task prompt, prefilled later: one computation each
    t.copied(0, 1, 5000)  # the group's second episode
    t.copied(0, 2, 2000)  # another task copies the system prompt from the first, in flight ...
    t.computed(2, 2000, 4500)  # ... and prefills its own task
    t.computed(3, 0, 4500)  # the same tokens prefilled afresh: other keys/values, as far as the table knows
    assert t.blocks[1] == t.blocks[0] and t.blocks[2][0] == t.blocks[0][0] and t.blocks[2][1] != t.blocks[0][1]
    lengths = [5100, 5100, 4600, 4600]
    shared = shared_runs([0, 1, 2, 3], [t.blocks[s] for s in range(4)], lengths, CPU)
    assert [[(r.rows.tolist(), r.slot, r.start, r.end) for r in level] for level in shared.levels] == [
        [([0, 1, 2], 0, 0, 2000)], [([0, 1], 0, 2000, 5000)]]
    assert shared.starts == [5000, 5000, 2000, 0] and shared.first == 0
    # A freed slot keeps what it held, its decoded tokens as their own computation; a taker that reuses part
    # of it keeps that part and computes the rest.
    t.release(1, list(range(5099)), None)
    assert t.blocks[1][:2] == t.blocks[0][:2] and t.blocks[1][2][1] == 5099
    slot, hit = t.take(list(range(5099)) + [5], version=0)
    assert (slot, hit) == (1, 5099)
    t.computed(1, hit, 5100)
    assert t.blocks[1][:2] == t.blocks[0][:2] and len(t.blocks[1]) == 4
    # Nothing alike, or a run whose saving is less than its call's cost: no runs.
    assert shared_runs([0, 3], [t.blocks[0], t.blocks[3]], [5100, 4600], CPU) is None
    t.copied(0, 4, 2000)
    assert shared_runs([0, 4], [t.blocks[0], t.blocks[4]], [5100, 2001], CPU) is None


def test_decode_reads_a_batch_of_groups_prompts_once():
    t = table(count=32)
    for group in range(4):
        leader = 8 * group
        t.computed(leader, 0, 690)
        for s in range(leader + 1, leader + 8):
            t.copied(leader, s, 690)
    lineages = [t.blocks[s] for s in range(32)]
    batch = decode_slots(list(range(32)), [760] * 32, gather=False, device=CPU, lineages=lineages)
    assert isinstance(batch, SharedRows) and len(batch.levels) == 1 and len(batch.levels[0]) == 4
    assert batch.starts == [690] * 32 and not batch.by_row
    # Agent episodes later on: lengths far apart; the rest of each row's keys row by row.
    lengths = [1000 + 50 * i for i in range(32)]
    batch = decode_slots(list(range(32)), lengths, gather=False, device=CPU, lineages=lineages)
    assert isinstance(batch, SharedRows) and batch.by_row and [len(r.rows) for r in batch.levels[0]] == [8] * 4
    # Every other one of them: four episodes a group share too little to be worth a call a group.
    slots = list(range(0, 32, 2))
    assert isinstance(decode_slots(slots, lengths[::2], gather=False, device=CPU,
                                   lineages=[t.blocks[s] for s in slots]), SlotRows)
    # Without shared keys/values (or a compiled step) nothing changes.
    assert decode_slots(list(range(32)), [760] * 32, gather=False, device=CPU) == 0
    assert decode_slots(list(range(32)), [760] * 32, gather=True, device=CPU, lineages=lineages).shape == (32,)
