"""Opt-in (`pytest -m gpu`): the engine's decode step replayed from CUDA graphs (engine/graphs.py) against its
eager step on the same GPU."""

from __future__ import annotations

import pytest
import torch

from realtime_rl.engine import Engine, SamplingParams
from realtime_rl.model import Qwen3ForCausalLM
from tests.conftest import tiny_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _model(moe: bool, dtype: torch.dtype) -> Qwen3ForCausalLM:
    model = Qwen3ForCausalLM(tiny_config(moe=moe))
    model.reset_parameters(seed=0)
    return model.to("cuda", dtype).eval()


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (int(torch.randint(3, 90, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _run(engine: Engine, prompts: list[list[int]], swap: dict[str, torch.Tensor] | None = None):
    """Ragged greedy and sampled requests; with `swap`, new weights staged after four steps."""
    params = [SamplingParams(temperature=0.0 if i % 3 else 1.0, max_tokens=4 + (7 * i) % 40, seed=i,
                             ignore_eos=True) for i in range(len(prompts))]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outs, steps = {}, 0
    while engine.has_work():
        outs.update({o.request_id: o for o in engine.step()})
        steps += 1
        if swap is not None and steps == 4:
            engine.update_weights(swap, version=1)
    return [outs[i].samples[0] for i in ids]


def test_graphs_replay_the_eager_step_dense_fp32():
    """fp32, dense: the graphs' tokens are the eager engine's and their logprobs agree to float error, for
    ragged batches of several buckets (40 rows, then fewer as they retire), across a hot swap."""
    model = _model(moe=False, dtype=torch.float32)
    state = {k: v + 0.02 * torch.randn_like(v) for k, v in model.state_dict().items()}
    original = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = _prompts(40)
    results = []
    for graphs in (False, True):
        engine = Engine(model, max_batch=48, max_seq_len=160, graphs=graphs)
        results.append(_run(engine, prompts, swap=state))
        if graphs:
            assert engine.graphs is not None and engine.graphs.capture_error is None
            assert engine.graphs.replays > 0 and len(engine.graphs.graphs) >= 3
        engine.update_weights(original, version=0)  # the model is shared: restore it for the next engine
        engine.step()
    for a, b in zip(*results):
        assert a.token_ids == b.token_ids and a.versions == b.versions
        torch.testing.assert_close(torch.tensor(a.raw_logprobs), torch.tensor(b.raw_logprobs), atol=2e-4, rtol=0)
    assert any(1 in s.versions and 0 in s.versions for s in results[1])  # the swap landed mid-request


def test_graphs_capture_the_moe_step_in_bf16():
    """bf16, MoE (grouped experts, routing captured): the graphs run and agree with the eager step. The first
    token comes from the prefill (eager in both); the second is the first decode step's, which agrees on
    nearly every row (a bf16 rounding of another key-length bucket may part one), as does its routing."""
    model = _model(moe=True, dtype=torch.bfloat16)
    prompts = _prompts(24, seed=1)
    results = []
    for graphs in (False, True):
        engine = Engine(model, max_batch=32, max_seq_len=160, graphs=graphs)
        results.append(_run(engine, prompts))
        assert (engine.graphs is not None) == graphs
        assert not graphs or (engine.graphs.capture_error is None and engine.graphs.replays > 0)
    second, flips, pairs = 0, 0, 0
    for a, b in zip(*results):
        assert a.token_ids[0] == b.token_ids[0] and a.raw_logprobs[0] == b.raw_logprobs[0]
        if a.token_ids[1] == b.token_ids[1]:
            second += 1
            assert abs(a.raw_logprobs[1] - b.raw_logprobs[1]) < 0.05
        step = len(a.routing) - len(a.token_ids) + 1  # the first decode step's routing row
        flips += int((a.routing[step] != b.routing[step]).any(-1).sum())
        pairs += a.routing.shape[1]
    assert second >= 0.9 * len(prompts) and flips <= 0.05 * pairs


def test_fp32_experts_get_no_graphs():
    model = _model(moe=True, dtype=torch.float32)
    assert Engine(model, max_batch=4, max_seq_len=32).graphs is None
    assert Engine(_model(moe=False, dtype=torch.float32), max_batch=4, max_seq_len=32).graphs is not None
