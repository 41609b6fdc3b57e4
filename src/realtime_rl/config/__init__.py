"""Typed configuration: one pydantic root per process, loaded from TOML recipes in `configs/`.

Every field has a docstring and bounds; unknown keys are rejected so a typo in a recipe fails loudly.
`load_config(cls, path, overrides)` reads a TOML file (or the class defaults when `path` is None) and
applies `--set a.b=value` overrides, whose values are parsed as TOML literals (`lr=3e-4`,
`model.num_experts=8`, `name="x"`), falling back to a bare string.

This module imports nothing of ours and no torch: recipes are validated without loading a model.

Layout: base.py (StrictModel, load_config and `--set` overrides), components.py (model, tokenizer,
sandbox, agent loop, eval), serve.py, training.py (pretrain, RL, rollout, train), rewards.py (reward rules,
hacking monitors), loop.py (the real-time loop: gate, A/B), users.py (simulated users), demo.py.
"""

from __future__ import annotations

from pydantic import BaseModel

from realtime_rl.config.base import StrictModel, apply_overrides, format_validation_error, load_config
from realtime_rl.config.components import AgentConfig, EvalConfig, ModelConfig, SandboxConfig, TokenizerTrainConfig
from realtime_rl.config.demo import DemoConfig
from realtime_rl.config.loop import ABConfig, GateConfig, LoopConfig
from realtime_rl.config.rewards import ActionRewards, EventWeights, MonitorConfig, RewardRules
from realtime_rl.config.serve import ApiKey, ServeConfig
from realtime_rl.config.training import PretrainConfig, RLConfig, RolloutConfig, TrainConfig
from realtime_rl.config.users import SimulateUsersConfig


# Which root each recipe folder under configs/ holds; a test parses every recipe with it.
RECIPE_ROOTS: dict[str, type[BaseModel]] = {
    "model": ModelConfig,
    "demo": DemoConfig,
    "sandbox": SandboxConfig,
    "eval": EvalConfig,
    "serve": ServeConfig,
    "pretrain": PretrainConfig,
    "train": TrainConfig,
    "rewards": RewardRules,
    "loop": LoopConfig,
    "users": SimulateUsersConfig,
}

__all__ = ["RECIPE_ROOTS", "ABConfig", "ActionRewards", "AgentConfig", "ApiKey", "DemoConfig", "EvalConfig", "EventWeights",
           "GateConfig", "LoopConfig", "ModelConfig", "MonitorConfig", "PretrainConfig", "RLConfig", "RewardRules", "RolloutConfig", "SandboxConfig", "ServeConfig", "SimulateUsersConfig", "StrictModel", "TokenizerTrainConfig",
           "TrainConfig", "apply_overrides", "format_validation_error", "load_config"]
