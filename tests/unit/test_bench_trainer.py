"""`rtrl bench trainer`: TRL is given the batch ours trains on, and both steps do the same work."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from realtime_rl.bench.learn import smoke_base
from realtime_rl.bench.trainer import QUICK, TRLStep, fresh, grpo_batch, trl_inputs
from realtime_rl.config import RLConfig
from realtime_rl.train import RLTrainer

PROMPT = QUICK.system + QUICK.task


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return smoke_base(tmp_path_factory.mktemp("base"))


def test_trl_sees_each_episode_as_prompt_and_completion_with_the_tool_results_masked(base):
    batch = grpo_batch(base, QUICK)
    assert len(batch) == QUICK.groups * QUICK.group_size
    inputs = trl_inputs(batch, QUICK.group_size, PROMPT, pad_id=7, device=torch.device("cpu"))
    for b, episode in enumerate(batch):
        seg = episode.segments[0]
        n = len(seg.token_ids) - PROMPT
        assert inputs["prompt_ids"][b].tolist() == seg.token_ids[:PROMPT].tolist()
        assert inputs["completion_ids"][b, :n].tolist() == seg.token_ids[PROMPT:].tolist()
        assert (inputs["completion_ids"][b, n:] == 7).all() and (inputs["completion_mask"][b, n:] == 0).all()
        assert inputs["completion_mask"][b, :n].all()
        assert inputs["tool_mask"][b, :n].tolist() == seg.loss_mask[PROMPT:].astype(int).tolist()
        assert not seg.loss_mask[:PROMPT].any() and seg.loss_mask[PROMPT:].any() and not seg.loss_mask[PROMPT:].all()
    assert int(inputs["num_items_in_batch"]) == sum(e.num_generated for e in batch)
    advantages = inputs["advantages"].view(QUICK.groups, QUICK.group_size)
    passed = torch.tensor([e.passed for e in batch]).view(QUICK.groups, QUICK.group_size)
    assert (advantages[passed] > 0).all() and (advantages[~passed] < 0).all()
    torch.testing.assert_close(advantages.sum(1), torch.zeros(QUICK.groups), atol=1e-5, rtol=0)
    # The prompts' routing is shared as the engine's prefix cache shares it: the trainer computes them once.
    first = batch[0].segments[0].routing
    for episode in batch:
        routing = episode.segments[0].routing
        assert np.array_equal(routing[:QUICK.system], first[:QUICK.system])
        group_first = next(e for e in batch if e.group_id == episode.group_id).segments[0].routing
        assert np.array_equal(routing[:PROMPT], group_first[:PROMPT])


def test_ours_and_trls_first_steps_move_the_weights_they_share_alike(base, tmp_path):
    """Token-level aggregation, no KL, no weight decay: at the first step both losses are the clipped policy
    gradient over the same trained tokens at ratio 1, and AdamW's first update is lr * g / |g|, so each weight
    both models name alike moves the same way."""
    batch = grpo_batch(base, QUICK)
    ours = RLTrainer.open(tmp_path / "ours", base, RLConfig(lr=1e-4, kl_coef=0.0, loss_aggregation="token",
                                                             weight_decay=0.0))
    before = ours.weights()
    metrics = ours.step(fresh(batch, 0, ours.version))
    assert metrics["train/trained_sequences"] == len(batch)
    trl = TRLStep(base, 0.0, torch.device("cpu"), torch.float32, tmp_path / "trl", len(batch), QUICK.group_size)
    trl_before = {name: p.detach().clone() for name, p in trl.model.named_parameters()}
    loss = trl.step(fresh(batch, 1, 0), PROMPT)
    assert np.isfinite(loss)
    trl_after = dict(trl.model.named_parameters())
    after = ours.weights()
    agree, compared = 0, 0
    for name, start in before.items():
        if name not in trl_before or trl_before[name].shape != start.shape:
            continue  # the experts: transformers fuses them into other tensors
        torch.testing.assert_close(trl_before[name], start)  # one base
        ours_move, trl_move = after[name] - start, trl_after[name].detach() - trl_before[name]
        moved = (ours_move.abs() > 5e-5) & (trl_move.abs() > 5e-5)  # ~lr: a real gradient, not eps noise
        agree += int((ours_move.sign() == trl_move.sign())[moved].sum())
        compared += int(moved.sum())
    assert compared > 1000
    assert agree / compared > 0.95, agree / compared
