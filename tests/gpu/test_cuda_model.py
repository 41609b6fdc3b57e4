"""Opt-in (`pytest -m gpu`): the model's modes and router replay on CUDA, in bf16 and fp32."""

from __future__ import annotations

import pytest
import torch

from realtime_rl.model import KVCache, Qwen3ForCausalLM
from tests.conftest import tiny_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cached_decode_tracks_full_sequence_on_cuda(dtype):
    model = Qwen3ForCausalLM(tiny_config(moe=True)).to("cuda", dtype).eval()
    ids = torch.randint(0, 512, (2, 16), device="cuda")
    with torch.no_grad():
        full = model(ids, capture_routing=True)
        cache = KVCache(model.config, 2, 16, dtype=dtype, device="cuda")
        pos = torch.arange(16, device="cuda").expand(2, 16)
        slots = torch.arange(2, device="cuda")
        a = model(ids[:, :8], pos[:, :8], kv_cache=cache, cache_slots=slots, capture_routing=True)
        b = model(ids[:, 8:], pos[:, 8:], kv_cache=cache, cache_slots=slots, capture_routing=True)
        replay = model(ids, replay_routing=torch.cat([a.routing_BTLK, b.routing_BTLK], 1))
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    got = torch.cat([a.logits_BTV, b.logits_BTV], 1).float()
    assert (got - full.logits_BTV.float()).abs().max() <= tol * full.logits_BTV.float().abs().max()
    assert (replay.logits_BTV.float() - got).abs().max() <= tol * got.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cache_attention_on_cuda_matches_cpu(dtype):
    """The decode attention kernels fold query heads onto key/value heads; CUDA's kernels return the folded
    output strided (fp32), which a view could not unfold."""
    from realtime_rl.model.kv_cache import masked_attention, row_attention

    q, k, v = torch.randn(3, 8, 5, 16), torch.randn(3, 2, 11, 16), torch.randn(3, 2, 11, 16)
    mask = torch.ones(3, 1, 5, 11, dtype=torch.bool).tril(6)
    want = masked_attention(q, k, v, mask)
    got = masked_attention(*(t.to("cuda", dtype) for t in (q, k, v)), mask.cuda())
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2 if dtype == torch.bfloat16 else 1e-4, rtol=0)
    want = row_attention(q[:1], k[:1], v[:1])
    got = row_attention(*(t[:1].to("cuda", dtype) for t in (q, k, v)))
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2 if dtype == torch.bfloat16 else 1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("by_row", [False, True], ids=["together", "by-row"])
def test_cascade_attention_on_cuda_matches_each_rows_own(dtype, by_row):
    """Cascade decode attention (runs of keys/values several slots hold alike, read once) through the
    matmul kernel CUDA runs, against each row's own attention on the same device."""
    from realtime_rl.model.kv_cache import SharedRows, SharedRun

    config = tiny_config(moe=True)
    cache = KVCache(config, num_slots=6, max_seq_len=64, dtype=dtype, device="cuda")
    for layer in cache.k_LSHPD + cache.v_LSHPD:
        layer.normal_()
    slots = [1, 2, 3, 5]
    cache.copy_prefix(1, 2, 20)
    cache.copy_prefix(2, 3, 30)
    positions = torch.tensor([[25], [40], [33], [10]], device="cuda")
    runs = [[SharedRun(torch.tensor([0, 1, 2], device="cuda"), 1, 0, 20)],
            [SharedRun(torch.tensor([1, 2], device="cuda"), 2, 20, 30)]]
    shared = SharedRows(slots, [20, 30, 30, 0], runs, lengths=[26, 41, 34, 11], by_row=by_row)
    H, K, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q, k, v = (torch.randn(4, n, 1, D, device="cuda", dtype=dtype) for n in (H, K, K))
    got = cache.begin(shared, positions).attend(0, q, k, v)
    want = cache.begin(torch.tensor(slots, device="cuda"), positions).attend(0, q, k, v)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "autocast"], ids=["fp32", "bf16", "autocast"])
def test_prefix_attention_on_cuda_matches_cpu_with_its_gradients(dtype, monkeypatch):
    """The trainer's prefix attention on CUDA (one fused call, its causal mask aligned to the last key, never a
    materialised mask) against the CPU path of two merged flash calls: the output and the gradient of every
    input, the prefix's summed over the rows that read it. "autocast": the bf16 trainer's inputs, q and k fp32
    out of their RMSNorm and v bf16 out of its projection, under autocast."""
    from torch.nn.attention.bias import CausalBias

    from realtime_rl.model.shared_prefix import prefix_attention

    def materialised(*_, **__):
        raise AssertionError("CUDA fell back to a materialised mask: no fused kernel took the inputs")

    B, H, K, T, P, D = 3, 4, 2, 40, 24, 32
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(B, H, T, D, generator=g), torch.randn(1, K, P, D, generator=g),
              torch.randn(1, K, P, D, generator=g), torch.randn(B, K, T, D, generator=g),
              torch.randn(B, K, T, D, generator=g)]
    upstream = torch.randn(B, H, T, D, generator=g)

    def run(device: str, cast: torch.dtype | str) -> list[torch.Tensor]:
        dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16] if cast == "autocast" \
            else [cast] * 5
        leaves = [t.to(device, d, copy=True).requires_grad_() for t, d in zip(inputs, dtypes)]
        q, k_pre, v_pre, k_own, v_own = leaves
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cast == "autocast"):
            out = prefix_attention(q, k_pre.expand(B, -1, -1, -1), v_pre.expand(B, -1, -1, -1), k_own, v_own)
        (out.float() * upstream.to(device)).sum().backward()
        return [out.detach().float().cpu()] + [t.grad.float().cpu() for t in leaves]

    want = run("cpu", torch.float32)
    monkeypatch.setattr(CausalBias, "_materialize", materialised)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for got, expected in zip(run("cuda", dtype), want, strict=True):
        torch.testing.assert_close(got, expected, atol=tol * max(1.0, float(expected.abs().max())), rtol=0)


def test_grouped_experts_on_cuda_match_the_loop_with_their_gradients():
    """The bf16 trainer's experts on CUDA: grouped matmuls (casts to bf16 under autocast, no per-expert loop, no
    read of the counts) against the per-expert loop under autocast, output and every gradient."""
    from tests.unit.test_model import expert_paths

    got = expert_paths("cuda", autocast=True)
    for grouped, looped in zip(got[True], got[False], strict=True):
        torch.testing.assert_close(grouped, looped, atol=2e-2 * float(looped.abs().max()), rtol=0)
