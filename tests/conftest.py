"""Shared fixtures: tiny models and a tokenizer trained once per session, all on CPU in seconds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from realtime_rl.config import ModelConfig
from realtime_rl.model import Qwen3ForCausalLM, Tokenizer, generate_corpus

# The 24 real Exercism tasks, beside the repository as ../shared/tasks (MIT licensed, third party).
EXERCISM = Path(__file__).resolve().parents[2] / "shared" / "tasks" / "exercism-python"

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, initializer_range=0.1)


def tiny_config(moe: bool = False, **overrides) -> ModelConfig:
    base = dict(TINY)
    if moe:
        base.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, tie_word_embeddings=False)
    base.update(overrides)
    return ModelConfig(**base)


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs two workers on two cores), each worker's torch takes one thread:
    two workers of two threads each would oversubscribe the cores."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.fixture(params=[False, True], ids=["dense", "moe"])
def tiny_policy(request) -> Qwen3ForCausalLM:
    """A few-layer model with a small vocabulary, dense and MoE."""
    model = Qwen3ForCausalLM(tiny_config(moe=request.param))
    model.reset_parameters(seed=0)
    return model.eval()


@pytest.fixture
def tiny_moe() -> Qwen3ForCausalLM:
    model = Qwen3ForCausalLM(tiny_config(moe=True))
    model.reset_parameters(seed=0)
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.train(generate_corpus(1500, seed=0), vocab_size=1024)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tokenizer) -> Path:
    """A tiny MoE checkpoint directory with a chat tokenizer: the base model of RL pipeline tests."""
    from realtime_rl.model import save_checkpoint

    model = Qwen3ForCausalLM(tiny_config(moe=True, vocab_size=1024))
    model.reset_parameters(seed=0)
    return save_checkpoint(tmp_path_factory.mktemp("base") / "tiny", model, tokenizer)
