"""Which program task i of a split is: the train/held-out split, the index space and its size.

A split's tasks are a disjoint union of pools, one per (difficulty, input type). A pool holds every
(structure, constants, surface) triple of its structures; the surface is the parameter name, the
function-name style, the instruction layout and the wording. Index i walks the pools round robin (so
difficulties and input types come evenly until a pool runs out), and its place within a pool goes
through a seeded Feistel permutation before it is read as mixed-radix digits. Both steps are
bijections, so distinct indices below `split_size` give distinct tasks.

A structure (`filter:gt -> map:mul -> reduce:sum`) is held out when the sha256 of its name falls below
HELDOUT_FRACTION: no held-out program shape is ever generated for training, whatever its constants.
"reserved" names a fixed RESERVED_FRACTION of the train structures (another hash of the name): a
pre-training that leaves them out (`PretrainConfig.reserve_structures`) lets RL practise on structures
the base never saw, as the held-out ones, without touching the held-out split. A longer train structure
may hold a held-out one as consecutive stages (`holds_heldout_part`: 1,205 of the 6,115 train three-stage
structures hold a held-out pair); `PretrainConfig.exclude_heldout_parts` leaves those out of pre-training.

This module only counts and picks; it renders nothing (synthetic.py does).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from realtime_rl.environments.synthetic_ops import (
    INPUT_TYPES, LAYOUTS, MAX_DEPTH, NAME_STYLES, PARAMETER_NAMES, Op, structure_name, structures,
)

Split = Literal["train", "heldout", "reserved"]
SPLITS: tuple[Split, ...] = ("train", "heldout")
"""The partition of all structures; "reserved" is a part of "train"."""
TASK_SETS: tuple[Split, ...] = (*SPLITS, "reserved")
HELDOUT_FRACTION = 0.125
RESERVED_FRACTION = 0.25
WORDINGS = 2
SURFACES = len(PARAMETER_NAMES["ints"]) * len(NAME_STYLES) * len(LAYOUTS) * WORDINGS
assert all(len(names) == len(PARAMETER_NAMES["ints"]) for names in PARAMETER_NAMES.values())


def structure_split(structure: str) -> Split:
    """'heldout' for a stable ~HELDOUT_FRACTION of structure names, 'train' for the rest."""
    digest = hashlib.sha256(structure.encode()).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") < HELDOUT_FRACTION * 2**64 else "train"


def reserved_structure(structure: str) -> bool:
    """True for a stable ~RESERVED_FRACTION of the train structures (never a held-out one)."""
    digest = hashlib.sha256(f"reserved/{structure}".encode()).digest()
    return (structure_split(structure) == "train"
            and int.from_bytes(digest[:8], "big") < RESERVED_FRACTION * 2**64)


def task_set(structure: str) -> Split:
    """The narrowest task set holding a structure: "heldout", "reserved" or "train"."""
    return "reserved" if reserved_structure(structure) else structure_split(structure)


@dataclass(frozen=True)
class Pick:
    """One point of the index space: a program and how it is dressed."""
    ops: tuple[Op, ...]
    constants: tuple[tuple[tuple[str, int | str], ...], ...]
    """Per stage, (name, value) of each of its constants."""
    parameter: int
    name_style: int
    layout: int
    wording: int


@dataclass(frozen=True)
class _Pool:
    structures: tuple[tuple[Op, ...], ...]
    ends: tuple[int, ...]
    """ends[i]: programs (structure x constants) in structures[: i + 1]."""

    @property
    def programs(self) -> int:
        return self.ends[-1] if self.ends else 0


@functools.cache
def _pools(split: Split) -> dict[tuple[int, str], _Pool]:
    grouped: dict[tuple[int, str], list[tuple[Op, ...]]] = {
        (d, t): [] for d in range(1, MAX_DEPTH + 1) for t in INPUT_TYPES}
    for ops in structures():
        name = structure_name(ops)
        if structure_split(name) == split or (split == "reserved" and reserved_structure(name)):
            grouped[(len(ops), ops[0].takes)].append(ops)
    pools = {}
    for key, members in grouped.items():
        ends = []
        for ops in members:
            ends.append((ends[-1] if ends else 0) + math.prod(op.constant_combinations for op in ops))
        pools[key] = _Pool(tuple(members), tuple(ends))
    return pools


def check_arguments(split: str, difficulty: int | None) -> None:
    if split not in TASK_SETS:
        raise ValueError(f"split must be one of {TASK_SETS}, got {split!r}")
    if difficulty is not None and not (isinstance(difficulty, int) and 1 <= difficulty <= MAX_DEPTH):
        raise ValueError(f"difficulty must be 1..{MAX_DEPTH} or None, got {difficulty!r}")


def _pool_keys(difficulty: int | None) -> list[tuple[int, str]]:
    depths = range(1, MAX_DEPTH + 1) if difficulty is None else [difficulty]
    return [(d, t) for d in depths for t in INPUT_TYPES]


def split_size(split: Split = "train", difficulty: int | None = None) -> int:
    """How many distinct tasks `generate_task` gives for this split (and difficulty)."""
    check_arguments(split, difficulty)
    return sum(_pools(split)[key].programs for key in _pool_keys(difficulty)) * SURFACES


@functools.cache
def _heldout_names() -> frozenset[str]:
    return frozenset(name for name in map(structure_name, structures()) if structure_split(name) == "heldout")


def holds_heldout_part(ops: tuple[Op, ...]) -> bool:
    """True when two or more consecutive stages of `ops`, short of all of them, are a held-out structure: a
    three-stage program whose first two stages are a held-out pair shows the model that pair."""
    return any(structure_name(ops[i:j]) in _heldout_names()
               for i in range(len(ops)) for j in range(i + 2, len(ops) + 1) if j - i < len(ops))


def train_indices(seed: int, difficulty: int, skip_reserved: bool = False,
                  skip_heldout_parts: bool = False) -> Iterator[int]:
    """The train indices of one difficulty, in order: all of them (0, 1, ...) unless a skip is set; then
    those whose structure is not reserved (skip_reserved) and holds no held-out part (skip_heldout_parts,
    holds_heldout_part), cycling at the end."""
    if not (skip_reserved or skip_heldout_parts):
        yield from itertools.count()
        return

    def kept(ops: tuple[Op, ...]) -> bool:
        return not ((skip_reserved and reserved_structure(structure_name(ops)))
                    or (skip_heldout_parts and holds_heldout_part(ops)))

    if not any(kept(ops) for ops in structures()
               if len(ops) == difficulty and structure_split(structure_name(ops)) == "train"):
        raise ValueError(f"every train structure of difficulty {difficulty} is skipped")
    for i in itertools.cycle(range(split_size("train", difficulty))):
        if kept(pick(i, "train", seed, difficulty).ops):
            yield i


def count_distinct_tasks() -> int:
    """Exact: distinct (structure, constants, surface) triples over both splits, one per index."""
    return sum(split_size(split) for split in SPLITS)


def count_distinct_programs() -> int:
    """Exact: distinct (structure, constants) pairs over both splits, i.e. distinct function bodies."""
    return sum(pool.programs for split in SPLITS for pool in _pools(split).values())


def _interleave(index: int, sizes: list[int]) -> tuple[int, int]:
    """Round robin over pools of these sizes, skipping exhausted ones: a bijection from range(sum(sizes))
    to (pool, place in pool)."""
    used = [0] * len(sizes)
    active = [i for i, size in enumerate(sizes) if size > 0]
    while active:
        rounds = min(sizes[i] - used[i] for i in active)
        if index < rounds * len(active):
            pool = active[index % len(active)]
            return pool, used[pool] + index // len(active)
        index -= rounds * len(active)
        used = [u + rounds if i in active else u for i, u in enumerate(used)]
        active = [i for i in active if used[i] < sizes[i]]
    raise AssertionError("index beyond the pools")


def _deinterleave(pool: int, place: int, sizes: list[int]) -> int:
    """The inverse of _interleave: the index that lands on `place` of pool `pool`."""
    if not 0 <= place < sizes[pool]:
        raise ValueError(f"place {place} is beyond pool {pool}'s {sizes[pool]} tasks")
    offset, used = 0, [0] * len(sizes)
    active = [i for i, size in enumerate(sizes) if size > 0]
    while True:
        rounds = min(sizes[i] - used[i] for i in active)
        if place < used[pool] + rounds:
            return offset + (place - used[pool]) * len(active) + active.index(pool)
        offset += rounds * len(active)
        used = [u + rounds if i in active else u for i, u in enumerate(used)]
        active = [i for i in active if used[i] < sizes[i]]


def pool_size(split: Split, difficulty: int, input_type: str) -> int:
    """How many tasks of this split and difficulty take `input_type` (synthetic_ops.INPUT_TYPES)."""
    check_arguments(split, difficulty)
    if input_type not in INPUT_TYPES:
        raise ValueError(f"input_type must be one of {INPUT_TYPES}, got {input_type!r}")
    return _pools(split)[(difficulty, input_type)].programs * SURFACES


def pool_task_index(split: Split, difficulty: int, input_type: str, place: int) -> int:
    """The index (of `pick`/`generate_task` at this split and difficulty) of the place-th task taking
    `input_type`: the index space deals the input types in turn only until its smallest pool runs out
    (past it, difficulty 2's train tasks are integer lists alone), this reaches each input type's tasks."""
    size = pool_size(split, difficulty, input_type)
    if not 0 <= place < size:
        raise ValueError(f"place {place} is beyond the {size} {split} tasks of difficulty {difficulty} taking "
                         f"{input_type}")
    return _deinterleave(INPUT_TYPES.index(input_type), place,
                         [pool_size(split, difficulty, t) for t in INPUT_TYPES])


def _mix(x: int, key: int) -> int:
    """splitmix64's finalizer: a cheap, well-spread 64-bit hash."""
    z = (x * 0x9E3779B97F4A7C15 + key) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def _permute(position: int, size: int, key: int) -> int:
    """A keyed bijection of range(size): a 4-round Feistel network on 2h bits, cycle-walking into range."""
    half_bits = max(1, ((size - 1).bit_length() + 1) // 2)
    mask = (1 << half_bits) - 1
    x = position
    while True:
        left, right = x >> half_bits, x & mask
        for round_key in range(key, key + 4):
            left, right = right, left ^ (_mix(right, round_key) & mask)
        x = (left << half_bits) | right
        if x < size:
            return x


def pick(index: int, split: Split, seed: int, difficulty: int | None) -> Pick:
    """The program and surface of task `index`; ValueError past the end of the split."""
    check_arguments(split, difficulty)
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    keys = _pool_keys(difficulty)
    pools = [_pools(split)[key] for key in keys]
    sizes = [pool.programs * SURFACES for pool in pools]
    if index >= sum(sizes):
        raise ValueError(f"index {index} is beyond the {sum(sizes)} distinct {split} tasks"
                         + (f" of difficulty {difficulty}" if difficulty else ""))
    which, place = _interleave(index, sizes)
    pool = pools[which]
    key = int.from_bytes(hashlib.sha256(f"{seed}/{split}/{keys[which]}".encode()).digest()[:8], "big")
    program, surface = divmod(_permute(place, sizes[which], key), SURFACES)
    s = bisect.bisect_right(pool.ends, program)
    ops = pool.structures[s]
    digits = program - (pool.ends[s - 1] if s else 0)
    constants = []
    for op in ops:
        chosen = []
        for name, values in op.params:
            digits, digit = divmod(digits, len(values))
            chosen.append((name, values[digit]))
        constants.append(tuple(chosen))
    surface, parameter = divmod(surface, len(PARAMETER_NAMES["ints"]))
    surface, name_style = divmod(surface, len(NAME_STYLES))
    wording, layout = divmod(surface, len(LAYOUTS))
    return Pick(ops, tuple(constants), parameter, name_style, layout, wording)
