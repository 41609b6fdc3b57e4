"""What a request is while the engine runs it, and what it gives back.

    prompt = check_request(prompt_ids, params, vocab, max_seq_len, max_batch)  # or a clear ValueError
    seq.finish_reason = finish_reason(seq, stop_ids, tokenizer, max_seq_len)   # after each sampled token
    out = request_output(request, tokenizer, reason)                           # once its samples are done
    notify(request, index, token, out)                                         # the caller's on_update

The engine (engine.py) schedules slots, batches and weights; everything here concerns one request.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from realtime_rl.engine.sampling import SamplingParams
from realtime_rl.model import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class SampleOutput:
    """One generated continuation. All per-token lists share the length of token_ids."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    """Under the distribution sampled from (0.0 for greedy)."""
    raw_logprobs: list[float]
    """Under the untempered model distribution."""
    versions: list[int]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str
    """"stop" (stop token or string), "length" (max_tokens or the context), "abort"."""
    text: str | None = None
    """Decoded text with any stop string cut off (None without a tokenizer)."""
    routing: np.ndarray | None = None
    """[prompt_len + len(token_ids) - 1, moe_layers, k]: routing of every position that was an input."""


@dataclass
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    samples: list[SampleOutput]
    queued_s: float
    """From add_request to prefill."""
    first_token_s: float
    """From add_request to the first sampled token."""
    total_s: float


@dataclass
class Seq:
    """One sample of a request while it runs: its slot, its generator and what it has generated."""

    req: Request
    index: int
    slot: int
    generator: torch.Generator
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    routing: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Request:
    """A request from add_request to its output."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    on_update: Callable[[str, int, int | None, RequestOutput | None], None] | None
    created: float
    prefilled: float = 0.0
    first_token: float = 0.0
    seqs: list[Seq] = field(default_factory=list)
    prompt_routing: torch.Tensor | None = None
    aborted: bool = False


def _token_id(t: object, position: int) -> int:
    """`t` as a token id: an int (numpy's and 0-d torch integers too), never a float, bool or string."""
    if not isinstance(t, bool):
        with contextlib.suppress(TypeError):
            return operator.index(t)
    raise ValueError(f"prompt token ids must be integers; position {position} holds {t!r}")


def check_request(prompt_ids: Sequence[int], params: SamplingParams, vocab: int, max_seq_len: int,
                  max_batch: int, tokenizer: Tokenizer | None) -> list[int]:
    """The prompt as a list of ints, or a ValueError saying what is wrong with the request."""
    if params.stop and tokenizer is None:
        raise ValueError("stop strings need text: this engine has no tokenizer (use stop_token_ids)")
    for stop in params.stop or ():  # checked here, on the caller's thread: the engine's would die encoding it
        try:
            stop.encode()
        except UnicodeEncodeError:
            raise ValueError(f"stop string {stop!r} is not Unicode text (a lone surrogate)") from None
    if isinstance(prompt_ids, (str, bytes)):
        raise ValueError("the prompt is a sequence of token ids, not text: tokenize it first")
    prompt = [_token_id(t, i) for i, t in enumerate(prompt_ids)]
    if not prompt:
        raise ValueError("the prompt is empty")
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise ValueError(f"prompt token ids must be in 0..{vocab - 1}")
    if params.stop_token_ids and (min(params.stop_token_ids) < 0 or max(params.stop_token_ids) >= vocab):
        raise ValueError(f"stop_token_ids must be in 0..{vocab - 1}, got {params.stop_token_ids}")
    if len(prompt) >= max_seq_len:
        raise ValueError(f"the prompt has {len(prompt)} tokens; the context holds {max_seq_len}")
    if params.n > max_batch:
        raise ValueError(f"n={params.n} exceeds the engine's batch of {max_batch}")
    return prompt


def finish_reason(s: Seq, default_stop_ids: Sequence[int], tokenizer: Tokenizer | None,
                  max_seq_len: int) -> str | None:
    """Why sample `s` ends at its last token ("abort", "stop", "length"), or None while it goes on."""
    p = s.req.params
    if s.req.aborted:
        return "abort"
    if p.stop_token_ids is not None:
        stop_ids = p.stop_token_ids
    else:
        stop_ids = () if p.ignore_eos else default_stop_ids
    if s.token_ids[-1] in stop_ids:
        return "stop"
    if p.stop and tokenizer is not None:  # the same text request_output cuts at the stop string
        window = 16 + max(len(x.encode()) for x in p.stop)  # in bytes: a byte-level token may be one byte
        tail = tokenizer.decode(s.token_ids[-window:], skip_special_tokens=True)
        if any(x in tail for x in p.stop):
            return "stop"
    if len(s.token_ids) >= p.max_tokens or len(s.req.prompt_ids) + len(s.token_ids) >= max_seq_len:
        return "length"
    return None


def request_output(req: Request, tokenizer: Tokenizer | None, reason: str | None) -> RequestOutput:
    """The output of a request whose samples are done; `reason` for a sample that never finished."""
    samples = []
    for s in req.seqs:
        text = None
        if tokenizer is not None:
            text = tokenizer.decode(s.token_ids, skip_special_tokens=True)
            for stop in req.params.stop:
                if stop in text:
                    text = text[: text.index(stop)]
        routing = None if req.prompt_routing is None else torch.cat([req.prompt_routing, *s.routing]).numpy()
        samples.append(SampleOutput(s.index, s.token_ids, s.logprobs, s.raw_logprobs, s.versions, s.top,
                                    s.finish_reason or reason or "abort", text, routing))
    now = time.perf_counter()
    return RequestOutput(req.request_id, req.prompt_ids, samples, (req.prefilled or now) - req.created,
                         (req.first_token or now) - req.created, now - req.created)


def notify(req: Request, index: int, token: int | None, output: RequestOutput | None) -> None:
    """Call the request's on_update; one that raises (a caller that went away) ends only its request."""
    if req.on_update is None:
        return
    try:
        req.on_update(req.request_id, index, token, output)
    except Exception:
        log.exception("on_update of request %s raised; the request is aborted", req.request_id)
        req.aborted = True
