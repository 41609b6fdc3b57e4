"""Policies the agent loop can drive without the engine: a scripted one (tests, demos of the loop) and
the local model through the reference decoder (`model.generate`); `task_seed`, how seeded policies
(these and the engine's) space their seeds so that episodes draw independently. The engine's batched
policy, with hot weight swaps and per-token versions, lives in `realtime_rl.engine`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from realtime_rl.config.components import TURN_SEEDS  # turn t of episode k samples with task_seed + t
from realtime_rl.environments.agent_loop import PolicyOutput
from realtime_rl.model.generate import generate
from realtime_rl.model.qwen3 import Qwen3ForCausalLM
from realtime_rl.model.tokenizer import Tokenizer


def task_seed(seed: int, k: int) -> int:
    """The sampling seed of the k-th episode's first turn. Episodes draw independently (one seed for all, or
    seeds one apart while each turn adds one, would make their outcomes move together), and the same for
    every checkpoint: two checkpoints evaluated with one seed see the same random numbers task by task, so
    their outcomes differ only where the models do (common random numbers for a paired comparison)."""
    return seed + TURN_SEEDS * k


class ScriptedPolicy:
    """Replies with fixed assistant texts, one per call (then repeats the last); logprobs are 0."""

    def __init__(self, tokenizer: Tokenizer, replies: Sequence[str], version: int = 0) -> None:
        if not replies:
            raise ValueError("ScriptedPolicy needs at least one reply")
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.version = version
        self.calls = 0
        self.contexts: list[list[int]] = []

    def generate(self, context_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> PolicyOutput:
        self.contexts.append(list(context_ids))
        text = self.replies[min(self.calls, len(self.replies) - 1)]
        self.calls += 1
        ids = (self.tokenizer.encode(text) + [self.tokenizer.im_end_id])[:max_new_tokens]
        return PolicyOutput(ids, [0.0] * len(ids), [self.version] * len(ids))


class ModelPolicy:
    """Samples from a local Qwen3 model with the reference decoder, one sequence at a time."""

    def __init__(self, model: Qwen3ForCausalLM, temperature: float = 1.0, top_p: float = 1.0,
                 seed: int | None = None, version: int = 0) -> None:
        self.model = model
        self.temperature = temperature
        self.top_p = top_p
        self.version = version
        self._seed = seed

    def generate(self, context_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> PolicyOutput:
        seed = None
        if self._seed is not None:
            seed, self._seed = self._seed, self._seed + 1
        gen = generate(self.model, context_ids, max_new_tokens, stop_ids, self.temperature, self.top_p, seed)
        routing = gen.routing_TLK.numpy() if isinstance(gen.routing_TLK, torch.Tensor) else None
        return PolicyOutput(gen.token_ids, gen.logprobs, [self.version] * len(gen.token_ids), routing,
                            self.temperature, self.top_p)
