"""Where to cut length-sorted rows into padded forwards: the fewest padded positions plus a price per forward.

    runs = cheapest_cut([180, 190, 210, 640, 900], overhead=150, max_tokens=4096)   # [(0, 3), (3, 4), (4, 5)]

Rows padded to the longest of their forward waste compute on the padding; each extra forward costs a fixed
amount (its kernel calls, the shared prefix's attention set up again). Pre-training cuts a step's documents
into micro-batches with it, the RL trainer a GRPO group's rows into forwards that share the group's prompt.
"""

from __future__ import annotations

import math


def cheapest_cut(lengths: list[int], overhead: int, max_tokens: int | None = None) -> list[tuple[int, int]]:
    """Consecutive runs [a, b) of rows of ascending `lengths`, each padded to its last (longest) row, at the
    least padded positions plus `overhead` a run, each run within `max_tokens` padded positions unless it is
    one row. Exact: dynamic programming over where the last run starts (O(n^2), n a step's or a group's rows)."""
    if any(b < a for a, b in zip(lengths, lengths[1:])):
        raise ValueError("cheapest_cut takes lengths in ascending order")
    limit = math.inf if max_tokens is None else max_tokens
    best = [0] * (len(lengths) + 1)  # best[b]: the least cost of rows [0, b)
    start = [0] * (len(lengths) + 1)
    for b in range(1, len(lengths) + 1):
        best[b], start[b] = min((best[a] + (b - a) * lengths[b - 1] + overhead, a) for a in range(b)
                                if a == b - 1 or (b - a) * lengths[b - 1] <= limit)
    runs, b = [], len(lengths)
    while b:
        runs.append((start[b], b))
        b = start[b]
    return runs[::-1]
