"""Parity with transformers' Qwen3 and Qwen3-MoE, both load directions (fp32, max |diff| <= 1e-4)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="transformers is a dev dependency")

from realtime_rl.bench.parity import CASES, run_case  # noqa: E402


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_logits_match_transformers(case):
    r = run_case(case)
    assert r["we_load_hf"] and r["hf_loads_ours"]
    assert r["hf_to_ours_max_abs_diff"] <= 1e-4
    assert r["ours_to_hf_max_abs_diff"] <= 1e-4
