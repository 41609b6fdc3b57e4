"""Opt-in (`pytest -m gpu`): the RL trainer and the rollout engine in bf16 on CUDA, alone and as `rtrl train`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from realtime_rl.config import RLConfig, RolloutConfig, TrainConfig
from realtime_rl.engine import Engine
from realtime_rl.rollout import train
from realtime_rl.train import RLTrainer
from realtime_rl.train.rl import CALL_OVERHEAD_TOKENS, MICRO_BATCH_TOKENS, SHARED_RUN_MIN_TOKENS
from tests.integration.test_rl_pipeline import AGENT
from tests.unit.test_rl_trainer import _episodes, _good_mass, _model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_bf16_trainer_and_bf16_engine_on_cuda_learn_with_router_replay(tmp_path):
    trainer = RLTrainer(_model(), None, RLConfig(lr=1e-2, device="cuda", dtype="bfloat16"), tmp_path)
    assert next(trainer.model.parameters()).dtype == torch.float32  # fp32 master weights on the GPU
    assert (trainer.micro_batch_tokens, trainer.shared_run_min_tokens, trainer.call_overhead_tokens) == (
        MICRO_BATCH_TOKENS["gpu"], SHARED_RUN_MIN_TOKENS["gpu"], CALL_OVERHEAD_TOKENS["gpu"])
    engine = Engine(_model().to("cuda", torch.bfloat16), max_batch=32, max_seq_len=64)
    engine.update_weights(trainer.weights(), 0)
    before = _good_mass(trainer.model)
    rewards, k3 = [], []
    for step in range(15):
        metrics = trainer.step(_episodes(engine, step))
        assert all(np.isfinite(v) for v in metrics.values())
        engine.update_weights(trainer.weights(), trainer.version)
        rewards.append(metrics["train/reward_mean"])
        k3.append(metrics["train/mismatch_k3"])
    after = _good_mass(trainer.model)
    print(f"good mass {before:.3f} -> {after:.3f}; mismatch_k3 median {np.median(k3):.2e} max {max(k3):.2e}")
    assert after > before + 0.3, (before, after)
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3])
    assert max(k3) < 1e-2  # a bf16 engine against the bf16 trainer, routing replayed: rounding, not policy drift
    trainer.save()
    resumed = RLTrainer.open(tmp_path, tmp_path / "nowhere", RLConfig(device="cuda", dtype="bfloat16"))
    assert resumed.version == trainer.version
    assert all(torch.equal(a, b) for a, b in zip(resumed.weights().values(), trainer.weights().values()))
    assert next(iter(resumed.optimizer.state.values()))["exp_avg"].device.type == "cuda"


def test_rtrl_train_with_the_trainer_and_the_workers_engines_on_cuda(tmp_path, tiny_checkpoint):
    config = TrainConfig(run_dir=tmp_path / "run", base_checkpoint=tiny_checkpoint, steps=3, max_staleness=1,
                         rl=RLConfig(group_size=2, groups_per_step=2, malformed_penalty=0.5, lr=1e-3, device="cuda",
                                     dtype="bfloat16"),
                         rollout=RolloutConfig(episodes_in_flight=4, max_difficulty=1, agent=AGENT, device="cuda",
                                               dtype="bfloat16", weights_dtype="bfloat16"))
    summary = train(config, show_progress=False)
    assert summary["version"] == 3
    lines = [json.loads(line)["metrics"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["train/staleness_max"] <= 1 for m in lines)
    k3 = [m["train/mismatch_k3"] for m in lines if "train/mismatch_k3" in m]
    print(f"rtrl train on cuda: mismatch_k3 {k3}, step_s {[round(m['train/step_s'], 2) for m in lines]}")
    assert all(0 <= v < 1e-2 for v in k3)
