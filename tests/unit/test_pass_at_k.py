from __future__ import annotations

import itertools

import pytest

from realtime_rl.evaluate import pass_at_k


@pytest.mark.parametrize("n, c, k", [(5, 2, 1), (5, 2, 3), (6, 0, 2), (4, 4, 4), (7, 3, 5)])
def test_pass_at_k_matches_enumeration(n, c, k):
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    exact = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(exact)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)
