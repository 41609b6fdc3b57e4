"""Sampling parameters of an engine request, and one decode step's draw for a batch of rows
(`draw_tokens`); the math lives in `realtime_rl.model.sampling`."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from realtime_rl.model.sampling import sample_rows, sampling_logprobs


@dataclass
class SamplingParams:
    temperature: float = 1.0
    """0 is greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    max_tokens: int = 256
    n: int = 1
    """Samples of one prompt; they share its prefill."""
    seed: int | None = None
    """Sample i uses seed + i; None draws from the engine's generator."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: generation ends once the text (special tokens left out) ends with one; the tokens stay,
    the text is cut. They need an engine with a tokenizer."""
    stop_token_ids: list[int] | None = None
    """Tokens that end generation; None uses the engine's default (the tokenizer's turn-ending tokens)."""
    ignore_eos: bool = False
    """Do not end at the engine's default stop tokens: with no stop strings or stop_token_ids, exactly
    max_tokens are generated (benchmarks). Stop strings and explicit stop_token_ids still end it (as vLLM)."""
    top_logprobs: int = 0
    """Alternatives to return per token (0 to 20)."""

    def __post_init__(self) -> None:
        # Types first: a float n or a bare int as stop_token_ids would otherwise fail on the engine's thread,
        # which ends it for every caller.
        def integer(x: object) -> bool:  # numpy's integers too
            return isinstance(x, numbers.Integral) and not isinstance(x, bool)

        def number(x: object) -> bool:
            return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)

        types = {
            "temperature": (number, "a finite number"), "top_p": (number, "a finite number"),
            "top_k": (integer, "an integer"), "max_tokens": (integer, "an integer"), "n": (integer, "an integer"),
            "top_logprobs": (integer, "an integer"), "seed": (lambda x: x is None or integer(x), "an integer or None"),
            "stop_token_ids": (lambda x: x is None or (isinstance(x, (list, tuple)) and all(map(integer, x))),
                               "a list of integers or None"),
            "ignore_eos": (lambda x: isinstance(x, bool), "a bool"),
        }
        if not isinstance(self.stop, (str, list, tuple)):  # an iterator would be used up by the checks below
            raise ValueError(f"stop must be a list of strings, got {type(self.stop).__name__}")
        if not isinstance(self.stop, str):
            self.stop = list(self.stop)
        for name, (ok, kind) in types.items():
            if not ok(value := getattr(self, name)):
                raise ValueError(f"{name} must be {kind}, got {value!r}")
        for name in ("top_k", "max_tokens", "n", "top_logprobs"):  # numpy's integers as Python's (torch seeds)
            setattr(self, name, int(getattr(self, name)))
        self.seed = None if self.seed is None else int(self.seed)
        self.stop_token_ids = None if self.stop_token_ids is None else [int(t) for t in self.stop_token_ids]
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.top_k < 2**31, f"top_k must be in 0..2**31 - 1, got {self.top_k}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (1 <= self.n <= 128, f"n must be in 1..128, got {self.n}"),
            (0 <= self.top_logprobs <= 20, f"top_logprobs must be in 0..20, got {self.top_logprobs}"),
            (not isinstance(self.stop, str), f"stop is a list of strings, got the string {self.stop!r}: pass [it]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (self.seed is None or -(2**63) <= self.seed <= 2**64 - self.n,  # seed + i seeds a torch generator
             f"seed must be in -2**63..2**64 - n, got {self.seed}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass
class Draw:
    """One token per row, with its logprob under the distribution sampled from (0.0 for a greedy row: the
    argmax is certain) and under the untempered model's, and the untempered top alternatives (None when no row
    asks for any)."""

    tokens: list[int]
    logprobs: list[float]
    raw_logprobs: list[float]
    top: torch.return_types.topk | None


def draw_tokens(logits_BV: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator]) -> Draw:
    """Each row's next token under its own params, drawn with its own generator. The path (filtered or not,
    all at T = 1 or not) is chosen from the params on the host, so a GPU's logits are read only for the tokens
    and their logprobs."""
    dev = logits_BV.device
    lp_BV, raw_BV = sampling_logprobs(
        logits_BV,
        torch.tensor([p.temperature for p in params], device=dev, dtype=torch.float32),
        torch.tensor([p.top_k for p in params], device=dev),
        torch.tensor([p.top_p for p in params], device=dev, dtype=torch.float32),
        filtered=any(p.top_k > 0 or p.top_p < 1 for p in params),
        unit_temperature=all(p.temperature == 1 for p in params),
    )
    tokens = sample_rows(lp_BV, [p.temperature == 0 for p in params], list(generators))
    tok_B1 = torch.tensor(tokens, device=dev)[:, None]
    k_max = max(p.top_logprobs for p in params)
    chosen = lp_BV.gather(1, tok_B1)[:, 0].tolist()
    return Draw(tokens, [0.0 if p.temperature == 0 else lp for p, lp in zip(params, chosen)],
                raw_BV.gather(1, tok_B1)[:, 0].tolist(), raw_BV.topk(k_max, dim=-1) if k_max else None)
