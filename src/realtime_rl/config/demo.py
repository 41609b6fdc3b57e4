"""`rtrl demo`: the end-to-end job on a laptop-sized budget."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from realtime_rl.config.base import StrictModel
from realtime_rl.config.components import ModelConfig, TokenizerTrainConfig


class DemoConfig(StrictModel):
    """`rtrl demo`: the most complete end-to-end job the code can run today, on a laptop-sized budget."""

    run_dir: Path = Path("runs/demo")
    """Where tasks, the corpus, checkpoints and metrics are written."""
    seed: int = 0
    """Seed for tasks, weights, corpus and sampling."""
    train_tasks: int = Field(120, ge=4, le=1_000_000)
    """Synthetic train tasks whose scripted episodes make the pre-training corpus."""
    eval_tasks: int = Field(6, ge=1, le=10_000)
    """Held-out synthetic tasks the model then attempts through the engine and the agent loop."""
    pretrain_steps: int = Field(60, ge=1, le=1_000_000)
    """Pre-training steps (a smoke-sized run; `rtrl pretrain` builds the real base model)."""
    tokenizer: TokenizerTrainConfig = Field(default_factory=lambda: TokenizerTrainConfig(vocab_size=2048))
    """Tokenizer training."""
    model: ModelConfig = Field(default_factory=lambda: ModelConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, tie_word_embeddings=False))
    """Architecture of the demo model (MoE, to exercise router replay)."""
    max_turns: int = Field(4, ge=1, le=50)
    """Agent turns per held-out episode."""
    max_new_tokens: int = Field(160, ge=1, le=4096)
    """Tokens the policy may generate per turn."""
    rl_steps: int = Field(2, ge=1, le=1000)
    """Asynchronous RL steps after pre-training (a smoke-sized run; `rtrl train` runs the real thing)."""
