"""The inference engine: continuous batching over a per-slot KV cache, sampling with logprobs, MoE
routing capture, per-token policy versions, hot weight swaps; `AsyncEngine` serves concurrent callers."""

from realtime_rl.engine.async_engine import AsyncEngine, EngineOverloaded, EngineStopped, TokenEvent
from realtime_rl.engine.engine import Engine
from realtime_rl.engine.policy import EnginePolicy
from realtime_rl.engine.requests import RequestOutput, SampleOutput
from realtime_rl.engine.sampling import SamplingParams

__all__ = ["AsyncEngine", "Engine", "EngineOverloaded", "EngineStopped", "EnginePolicy", "RequestOutput",
           "SampleOutput", "SamplingParams", "TokenEvent"]
