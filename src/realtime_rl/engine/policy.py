"""The engine as an agent-loop Policy: rollout workers drive episodes through the shared engine."""

from __future__ import annotations

from realtime_rl.engine.async_engine import AsyncEngine
from realtime_rl.engine.sampling import SamplingParams
from realtime_rl.environments.agent_loop import PolicyOutput


class EnginePolicy:
    """Each generate() is one engine request; versions are per token (weights may swap mid-request)."""

    def __init__(self, engine: AsyncEngine, temperature: float = 1.0, top_p: float = 1.0,
                 seed: int | None = None, timeout_s: float = 300.0) -> None:
        self.engine = engine
        self.temperature = temperature
        self.top_p = top_p
        self.timeout_s = timeout_s
        self._seed = seed

    def generate(self, context_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> PolicyOutput:
        seed = None
        if self._seed is not None:
            seed, self._seed = self._seed, self._seed + 1
        params = SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=max_new_tokens,
                                stop_token_ids=list(stop_ids), seed=seed)
        sample = self.engine.generate_sync(context_ids, params, self.timeout_s).samples[0]
        # Behaviour logprobs are those of the distribution sampled from; the trainer recomputes at the same
        # temperature. Rollouts sample the whole distribution (top_p 1): the gate's evaluations alone truncate it.
        return PolicyOutput(sample.token_ids, sample.logprobs, sample.versions, sample.routing,
                            self.temperature, self.top_p)
