"""The model's two modes agree, and routing capture/replay does what the trainer relies on."""

from __future__ import annotations

import pytest
import torch

from realtime_rl.model import KVCache, Qwen3ForCausalLM
from tests.conftest import tiny_config


def _ids(B=2, T=12, V=512, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def test_kv_cache_prefill_then_decode_matches_full_sequence(tiny_policy):
    ids = _ids()
    B, T = ids.shape
    with torch.no_grad():
        full = tiny_policy(ids).logits_BTV
        cache = KVCache(tiny_policy.config, num_slots=4, max_seq_len=32)
        slots = torch.tensor([2, 0])  # any slots, in any order
        pos = torch.arange(T).expand(B, T)
        parts = [tiny_policy(ids[:, :5], pos[:, :5], kv_cache=cache, cache_slots=slots).logits_BTV]
        for t in range(5, T):
            parts.append(tiny_policy(ids[:, t:t + 1], pos[:, t:t + 1], kv_cache=cache, cache_slots=slots).logits_BTV)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_ragged_batch_decode_matches_each_sequence_alone(tiny_policy):
    """Rows at different positions share one decode step (continuous batching)."""
    a, b = _ids(1, 9, seed=1)[0], _ids(1, 4, seed=2)[0]
    cache = KVCache(tiny_policy.config, num_slots=2, max_seq_len=16)
    with torch.no_grad():
        tiny_policy(a[None, :8], torch.arange(8)[None], kv_cache=cache, cache_slots=torch.tensor([0]))
        tiny_policy(b[None, :3], torch.arange(3)[None], kv_cache=cache, cache_slots=torch.tensor([1]))
        step = tiny_policy(torch.stack([a[8:9], b[3:4]]), torch.tensor([[8], [3]]), kv_cache=cache,
                           cache_slots=torch.tensor([0, 1])).logits_BTV
        alone_a = tiny_policy(a[None]).logits_BTV[0, -1]
        alone_b = tiny_policy(b[None]).logits_BTV[0, -1]
    torch.testing.assert_close(step[0, 0], alone_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step[1, 0], alone_b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("slots,by_row", [([1, 2, 3, 5], False), ([2, 3, 4, 5], False), ([1, 2, 3, 5], True)])
@pytest.mark.parametrize("kernel", ["flash", "matmul"])
def test_cascade_attention_over_shared_runs_equals_each_rows_own_attention(slots, by_row, kernel, monkeypatch):
    """Decode rows reading runs of keys/values their slots hold alike once (nested: three rows share 20
    positions, two of them 10 more) and the rest from their own slots attend exactly as over their own,
    with the CPU flash kernel or the plain one other devices run."""
    import realtime_rl.model.kv_cache as kv_cache_module
    from realtime_rl.model.kv_cache import SharedRows, SharedRun, masked_attention

    if kernel == "matmul":
        monkeypatch.setattr(kv_cache_module, "_flash_cpu", None)

    config = tiny_config(moe=True)
    cache = KVCache(config, num_slots=6, max_seq_len=64)
    gen = torch.Generator().manual_seed(0)
    for layer in cache.k_LSHPD + cache.v_LSHPD:
        layer.copy_(torch.randn(layer.shape, generator=gen))
    a, b, c, d = slots
    cache.copy_prefix(a, b, 20)
    cache.copy_prefix(b, c, 30)
    positions_B1 = torch.tensor([[25], [40], [33], [10]])
    shared = SharedRows(slots, [20, 30, 30, 0], [[SharedRun(torch.tensor([0, 1, 2]), a, 0, 20)],
                                                 [SharedRun(torch.tensor([1, 2]), b, 20, 30)]],
                        lengths=[26, 41, 34, 11], by_row=by_row)
    H, K, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q, k, v = (torch.randn(4, n, 1, D, generator=gen) for n in (H, K, K))
    out = cache.begin(shared, positions_B1).attend(0, q, k, v)
    # Each row's own keys, its new one written at its position, the same way any decode step reads them.
    expected = cache.begin(torch.tensor(slots), positions_B1).attend(0, q, k, v)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    L = 41
    own_k = cache.k_LSHPD[0][:, :, :L].index_select(0, torch.tensor(slots))
    own_v = cache.v_LSHPD[0][:, :, :L].index_select(0, torch.tensor(slots))
    mask = torch.arange(L)[None, None, None, :] <= positions_B1[:, None, :, None]
    torch.testing.assert_close(out, masked_attention(q, own_k, own_v, mask), atol=1e-6, rtol=0)


def test_kv_cache_rejects_overflow(tiny_policy):
    cache = KVCache(tiny_policy.config, num_slots=1, max_seq_len=4)
    with pytest.raises(ValueError, match="exceeds the KV cache length"):
        tiny_policy(_ids(1, 5), torch.arange(5)[None], kv_cache=cache, cache_slots=torch.tensor([0]))


def test_copy_prefix_shares_a_prefill(tiny_policy):
    ids = _ids(1, 10)
    cache = KVCache(tiny_policy.config, num_slots=2, max_seq_len=16)
    with torch.no_grad():
        tiny_policy(ids[:, :9], torch.arange(9)[None], kv_cache=cache, cache_slots=torch.tensor([0]))
        cache.copy_prefix(0, 1, 9)
        out = tiny_policy(ids[:, 9:].repeat(2, 1), torch.tensor([[9], [9]]), kv_cache=cache,
                          cache_slots=torch.tensor([0, 1])).logits_BTV
    torch.testing.assert_close(out[0], out[1])


def test_capture_then_replay_gives_identical_logits(tiny_moe):
    ids = _ids()
    with torch.no_grad():
        captured = tiny_moe(ids, capture_routing=True)
        replayed = tiny_moe(ids, replay_routing=captured.routing_BTLK)
    B, T = ids.shape
    assert captured.routing_BTLK.shape == (B, T, 3, 2)
    assert captured.routing_BTLK.dtype == torch.uint8
    assert torch.equal(captured.logits_BTV, replayed.logits_BTV)


def test_topk_order_is_recorded_in_rank_order(tiny_moe):
    ids = _ids()
    with torch.no_grad():
        routing = tiny_moe(ids, capture_routing=True).routing_BTLK
        x = tiny_moe.model.embed_tokens(ids)
        layer0 = tiny_moe.model.layers[0]
        cos_sin = tiny_moe.model.rotary_emb(torch.arange(ids.shape[1]).expand_as(ids), x.dtype)
        h = x + layer0.self_attn(layer0.input_layernorm(x), cos_sin, None)
        probs = torch.softmax(layer0.mlp.gate.weight @ layer0.post_attention_layernorm(h).transpose(1, 2), dim=1)
    top = probs.transpose(1, 2).topk(2, dim=-1).indices
    assert torch.equal(routing[:, :, 0].long(), top)


def test_replay_after_weight_change_routes_exactly_as_recorded(tiny_moe):
    ids = _ids()
    with torch.no_grad():
        before = tiny_moe(ids, capture_routing=True).routing_BTLK
        for layer in tiny_moe.model.layers:  # a large change of every router and expert
            layer.mlp.gate.weight.add_(torch.randn_like(layer.mlp.gate.weight))
        free = tiny_moe(ids, capture_routing=True).routing_BTLK
        forced = tiny_moe(ids, replay_routing=before, capture_routing=True).routing_BTLK
    assert not torch.equal(free, before), "the perturbation should change free routing"
    assert torch.equal(forced, before)


def test_gradients_reach_the_router_under_replay(tiny_moe):
    tiny_moe.train()
    ids = _ids()
    with torch.no_grad():
        routing = tiny_moe(ids, capture_routing=True).routing_BTLK
    out = tiny_moe(ids, replay_routing=routing)
    out.logits_BTV.logsumexp(-1).mean().backward()
    for layer in tiny_moe.model.layers:
        grad = layer.mlp.gate.weight.grad
        assert grad is not None and grad.abs().sum() > 0


def test_capture_agrees_between_cached_and_full_sequence_modes(tiny_moe):
    ids = _ids()
    B, T = ids.shape
    with torch.no_grad():
        full = tiny_moe(ids, capture_routing=True).routing_BTLK
        cache = KVCache(tiny_moe.config, num_slots=B, max_seq_len=T)
        slots, pos = torch.arange(B), torch.arange(T).expand(B, T)
        parts = [tiny_moe(ids[:, :7], pos[:, :7], kv_cache=cache, cache_slots=slots, capture_routing=True).routing_BTLK]
        for t in range(7, T):
            parts.append(tiny_moe(ids[:, t:t + 1], pos[:, t:t + 1], kv_cache=cache, cache_slots=slots,
                                  capture_routing=True).routing_BTLK)
    assert torch.equal(torch.cat(parts, dim=1), full)


def test_replay_rejects_bad_records(tiny_moe):
    ids = _ids()
    with torch.no_grad():
        routing = tiny_moe(ids, capture_routing=True).routing_BTLK
        with pytest.raises(ValueError, match="expected"):
            tiny_moe(ids[:, :5], replay_routing=routing)
        bad = routing.clone()
        bad[0, 0, 0, 0] = 200
        with pytest.raises(ValueError, match="outside"):
            tiny_moe(ids, replay_routing=bad)


def test_sparse_step_and_mlp_only_layers_build_dense_layers():
    model = Qwen3ForCausalLM(tiny_config(moe=True, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert [layer.is_moe for layer in model.model.layers] == [False, True, False, False]
    out = model(_ids(), capture_routing=True)
    assert out.routing_BTLK.shape[2] == 1


def test_bf16_forward_runs_and_tracks_fp32(tiny_policy):
    ids = _ids()
    with torch.no_grad():
        ref = tiny_policy(ids).logits_BTV
        low = tiny_policy.to(torch.bfloat16)(ids).logits_BTV.float()
    assert low.dtype == torch.float32 and torch.isfinite(low).all()
    assert (low - ref).abs().max() < 0.1 * ref.abs().max()


def expert_paths(device: str, autocast: bool, seed: int = 0) -> dict[bool, list[torch.Tensor]]:
    """One expert block's output and the gradients of its input, mixing weights and expert weights, through the
    grouped matmuls (True) and the per-expert loop (False), on the same inputs. Experts 5 and 6 get no token."""
    from realtime_rl.model.moe import Experts

    config = tiny_config(moe=True)
    g = torch.Generator().manual_seed(seed)
    experts = Experts(config).to(device)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    N, k = 50, config.num_experts_per_tok
    x = torch.randn(N, config.hidden_size, generator=g)
    indices = torch.tensor([[0, 7], [1, 2], [3, 4]])[torch.randint(0, 3, (N,), generator=g)]
    weights = torch.rand(N, k, generator=g)
    upstream = torch.randn(N, config.hidden_size, generator=g)
    out = {}
    for grouped in (True, False):
        experts.zero_grad(set_to_none=True)
        leaves = [t.to(device).requires_grad_() for t in (x, weights)]
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            y = experts(leaves[0], indices.to(device), leaves[1], grouped=grouped)
        (y.float() * upstream.to(device)).sum().backward()
        out[grouped] = [t.detach().float().cpu() for t in (y, *(t.grad for t in leaves),
                                                           experts.gate_up_proj.grad, experts.down_proj.grad)]
    return out


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_grouped_and_looped_experts_agree_with_their_gradients(autocast):
    """The trainer's experts run as grouped matmuls wherever their kernels take the dtype (every dtype on CPU):
    the same output and gradients as the per-expert loop, unused experts' gradients zero."""
    got = expert_paths("cpu", autocast)
    for grouped, looped in zip(got[True], got[False], strict=True):
        if autocast:  # bf16 matmuls in both, summed in their own orders
            torch.testing.assert_close(grouped, looped, atol=2e-2 * float(looped.abs().max()), rtol=0)
        else:
            torch.testing.assert_close(grouped, looped, atol=1e-5, rtol=1e-5)
    assert not got[True][3][5:7].any() and not got[True][4][5:7].any()


def test_inference_and_training_paths_agree(tiny_moe, monkeypatch):
    """No grad (the engine: one custom op the compiled decode keeps whole) against grad (the trainer), whose
    default is the grouped matmuls called directly, and against the per-expert loop."""
    from realtime_rl.model import moe

    ids = _ids()
    with torch.no_grad():
        fast = tiny_moe(ids).logits_BTV
    calls = []
    grouped = moe._grouped_swiglu
    monkeypatch.setattr(moe, "_grouped_swiglu", lambda *args: calls.append(1) or grouped(*args))
    trained = tiny_moe(ids).logits_BTV.detach()
    assert len(calls) == tiny_moe.num_moe_layers  # under grad, by default: grouped
    monkeypatch.setattr(moe, "_HAS_GROUPED_MM", False)
    looped = tiny_moe(ids).logits_BTV.detach()
    assert len(calls) == tiny_moe.num_moe_layers  # the loop
    for got in (trained, looped):
        torch.testing.assert_close(fast, got, atol=1e-5, rtol=1e-5)


def test_contiguous_slot_slice_reads_the_same_cache(tiny_policy):
    ids = _ids(3, 6)
    pos = torch.arange(6).expand(3, 6)
    a = KVCache(tiny_policy.config, num_slots=5, max_seq_len=8)
    b = KVCache(tiny_policy.config, num_slots=5, max_seq_len=8)
    with torch.no_grad():
        by_index = tiny_policy(ids, pos, kv_cache=a, cache_slots=torch.tensor([1, 2, 3])).logits_BTV
        by_slice = tiny_policy(ids, pos, kv_cache=b, cache_slots=slice(1, 4)).logits_BTV
    assert torch.equal(by_index, by_slice)
    assert torch.equal(a.k_LSHPD[0], b.k_LSHPD[0])


def test_slot_rows_decode_reads_each_rows_own_prefix(tiny_policy):
    """Rows of different lengths in scattered slots: one attention call per row over exactly its keys gives
    the logits and keys/values of the padded, masked gather (to float rounding: sums run in another order)."""
    from realtime_rl.model.kv_cache import SlotRows

    lengths = [3, 9, 6]
    slots = [0, 2, 4]
    caches = [KVCache(tiny_policy.config, num_slots=5, max_seq_len=16) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            for slot, n in zip(slots, lengths):  # prefill each row's prompt, all but its last token
                tiny_policy(_ids(1, n - 1, seed=slot), torch.arange(n - 1)[None], kv_cache=cache,
                            cache_slots=torch.tensor([slot]))
        last = _ids(3, 1, seed=9)
        pos = torch.tensor(lengths)[:, None] - 1
        gathered = tiny_policy(last, pos, kv_cache=caches[0], cache_slots=torch.tensor(slots)).logits_BTV
        by_row = tiny_policy(last, pos, kv_cache=caches[1], cache_slots=SlotRows(slots, lengths)).logits_BTV
    torch.testing.assert_close(by_row, gathered, atol=1e-5, rtol=0)
    assert torch.equal(caches[0].k_LSHPD[0], caches[1].k_LSHPD[0])  # layer 0's new keys precede any attention
    for k0, k1 in zip(caches[0].k_LSHPD[1:], caches[1].k_LSHPD[1:]):
        torch.testing.assert_close(k0, k1, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="decode"):
        tiny_policy(_ids(3, 2), torch.zeros(3, 2, dtype=torch.long), kv_cache=caches[1],
                    cache_slots=SlotRows(slots, lengths))


@pytest.mark.parametrize("split", [True, False], ids=["two-calls", "one-call"])
def test_prefix_attention_is_one_softmax_over_prefix_and_own_keys(monkeypatch, split):
    """Rows continuing a shared prefix: outputs and every gradient (the prefix's summed over rows) equal one
    attention over [prefix | own keys] with the lower-right causal mask, on the CPU path of two merged calls
    and on the one-call path (CUDA's; here PyTorch materialises its causal_lower_right mask)."""
    from realtime_rl.model import shared_prefix

    if not split:
        monkeypatch.setattr(shared_prefix, "_flash_cpu", None)
    B, H, K, T, P, D = 3, 4, 2, 9, 6, 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=g, requires_grad=True)
    k_pre, v_pre = (torch.randn(1, K, P, D, generator=g, requires_grad=True) for _ in range(2))
    k_own, v_own = (torch.randn(B, K, T, D, generator=g, requires_grad=True) for _ in range(2))
    upstream = torch.randn(B, H, T, D, generator=g)
    leaves = (q, k_pre, v_pre, k_own, v_own)

    def run(fn):
        for t in leaves:
            t.grad = None
        out = fn()
        (out * upstream).sum().backward()
        return [out.detach()] + [t.grad.clone() for t in leaves]

    k_rows, v_rows = k_pre.expand(B, -1, -1, -1), v_pre.expand(B, -1, -1, -1)
    got = run(lambda: shared_prefix.prefix_attention(q, k_rows, v_rows, k_own, v_own))
    mask = torch.ones(T, P + T, dtype=torch.bool).tril(P)
    want = run(lambda: torch.nn.functional.scaled_dot_product_attention(
        q, torch.cat([k_rows, k_own], 2), torch.cat([v_rows, v_own], 2), attn_mask=mask, enable_gqa=True))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # bf16 (the trainer's dtype on accelerators) tracks fp32
        low = shared_prefix.prefix_attention(*(t.detach().bfloat16().expand(B, -1, -1, -1) if t.shape[0] == 1
                                               else t.detach().bfloat16() for t in leaves))
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), want[0], atol=3e-2, rtol=3e-2)
    # The bf16 trainer's inputs: autocast on, q and k fp32 out of their RMSNorm, v bf16 out of its projection.
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = shared_prefix.prefix_attention(q.detach(), k_rows.detach(), v_rows.detach().bfloat16(),
                                               k_own.detach(), v_own.detach().bfloat16())
    assert mixed.dtype == torch.bfloat16
    torch.testing.assert_close(mixed.float(), want[0], atol=3e-2, rtol=3e-2)


def test_sample_rows_draws_from_each_rows_distribution():
    from scipy import stats

    from realtime_rl.model.sampling import sample_rows

    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0, 0.0])
    rows = 20_000
    logprobs = probs.log().expand(rows, -1).contiguous()
    gen = torch.Generator().manual_seed(0)
    tokens = sample_rows(logprobs, [False] * rows, [gen] * rows)
    counts = torch.bincount(torch.tensor(tokens), minlength=6)
    assert counts[4:].sum() == 0  # probability 0 is never drawn
    assert stats.chisquare(counts[:4].numpy(), probs[:4].numpy() * rows).pvalue > 1e-3

    # Greedy rows take the argmax; a point mass is drawn whatever the uniform; a row's draw depends only on
    # its own generator.
    mixed = torch.tensor([[-1.0, -0.2, -3.0], [0.0, float("-inf"), float("-inf")], [-2.0, -0.5, -1.5]])
    seeded = [torch.Generator().manual_seed(7) for _ in range(3)]
    assert sample_rows(mixed, [True, False, False], seeded)[:2] == [1, 0]
    alone = sample_rows(mixed[2:], [False], [torch.Generator().manual_seed(7)])
    fresh = [torch.Generator().manual_seed(7) for _ in range(3)]
    assert alone == sample_rows(mixed, [True, False, False], fresh)[2:]


@pytest.mark.parametrize("u,token", [(0.0, 1), (0.2, 1), (0.5, 4), (1 - 2**-24, 4), (1.0, 4)])
def test_sample_rows_never_draws_a_zero_probability_token(monkeypatch, u, token):
    """Zeros first, between and last; u = 1.0 (which torch.rand never gives) stands for u x total rounding
    up to the total: the guard takes the last token of nonzero probability."""
    from realtime_rl.model.sampling import sample_rows

    logprobs = torch.tensor([[0.0, 0.3, 0.0, 0.0, 0.7, 0.0]]).log()
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.tensor(u))
    assert sample_rows(logprobs, [False], [None]) == [token]


def test_shared_prefix_positions_follow_from_the_prefix_and_chosen_ones_are_checked(tiny_moe):
    """Rows continuing a shared prefix start where it ends: left out, their positions are derived from it (no
    read of a device value); given, they must start there."""
    from realtime_rl.model.shared_prefix import SharedPrefix

    ids = _ids(3, 12)
    ids[1:, :5] = ids[0, :5]  # one prefix, three continuations
    with torch.no_grad():
        full = tiny_moe.hidden_states(ids)[0]
        prefix = SharedPrefix()
        tiny_moe.hidden_states(ids[:1, :5], shared_prefix=prefix)
        derived = tiny_moe.hidden_states(ids[:, 5:], shared_prefix=prefix)[0]
        chosen = tiny_moe.hidden_states(ids[:, 5:], torch.arange(5, 12).expand(3, 7), shared_prefix=prefix)[0]
        with pytest.raises(ValueError, match="must start at position 5"):
            tiny_moe.hidden_states(ids[:, 5:], torch.arange(4, 11).expand(3, 7), shared_prefix=prefix)
        task = prefix.extended()
        with pytest.raises(ValueError, match="must start at position 5"):
            tiny_moe.hidden_states(ids[:1, 6:9], torch.arange(6, 9)[None], shared_prefix=task)
        with pytest.raises(ValueError, match="recorded from one row"):
            tiny_moe.hidden_states(ids[:, 5:8], shared_prefix=task)
    assert torch.equal(derived, chosen)
    torch.testing.assert_close(derived, full[:, 5:], atol=1e-5, rtol=1e-5)
