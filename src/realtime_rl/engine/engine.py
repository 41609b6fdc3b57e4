"""The continuous-batching inference engine (synchronous core; async_engine.py runs it on a thread).

    engine = Engine(model, tokenizer, max_batch=32, max_seq_len=2048)
    outputs = engine.generate([prompt_ids, ...], SamplingParams(max_tokens=64, n=4))
    engine.update_weights(state_dict, version=7)      # staged beside the live weights, swapped between steps

Each `step()` does, in order: apply a staged weight swap (pointer swaps, requests frozen not dropped);
admit waiting requests into free KV-cache slots and prefill them in one batch (a request's n samples
share its prefill: the prompt's keys/values are copied to the other slots); decode one token for every
running sequence in one batch; retire finished sequences, freeing their slots. Every token records the
policy version whose weights produced it, its logprobs and its MoE routing.

Prefix caching (slots.py keeps the slots): a freed slot keeps its keys/values (and routing) until reused.
A new request takes the free slot whose cached tokens share the longest prefix with its prompt and
prefills only the rest, so an agent's next turn (its previous context + the tool results) costs only the
new tokens. Sequences in flight share too: a request whose prompt shares a longer prefix with the prompt
of a running sequence that the current weights computed copies those keys/values, and requests admitted
in one step with the same prompt (a GRPO group's episodes) share one prefill as a request's n samples do.
The cache is reused only under the weights that computed it (`prefix_max_age` 0, the default: serving),
or, with `prefix_max_age` k, by a continuation of the cached sequence (an agent's next turn: the new
prompt holds the whole old prompt and what was generated) while its oldest keys/values are at most k
versions old. As with PipelineRL's in-flight updates, that turn reuses keys/values (and routing) older
weights computed and only its new tokens see the new weights; its tokens' logprobs are still exactly what
the sampler used, and the trainer's decoupled objective corrects the difference. An episode that has not
yet spanned a swap never gets older keys/values (a new episode sharing only the system prompt with a
stale slot prefills it afresh), so sequences whose every token the current weights generated stay exactly
on-policy. Asynchronous RL rollouts set their staleness bound here: the trainer publishes every step, and
otherwise every episode in flight would re-prefill its whole context after each one. A swap to an older
version (a rolled-back policy served again), or to other weights under the same version number, starts a
new cache epoch: nothing cached before it is reused.

Prefill batching (`prefill_wait_ms`, default 0): while sequences decode, a new request waits up to that long
to be prefilled together with those arriving after it. On a GPU a prefill is an eager forward whose cost is
its launches, whatever its rows: an agent's turns arriving one a step would otherwise add one to most steps.

Compiled decode (`compile_decode=True`): the decode step's forward runs through `torch.compile` with
dynamic batch and prefix sizes (a graph for a single row, one for every batch of more),
which removes most of the per-operator overhead that bounds a small model's decode step on CPU. The
constructor compiles both graphs (tens of seconds on two cores; inductor caches the result on disk for
the next process), so no request waits on it; the weights stay inputs of the graph, so hot swaps need no
recompilation. Prefill stays eager.

Cascade decode (`cascade_decode=True`, the default; eager decode on a CPU): the slot table records which slots
hold copies of one prefill (slots.py), and a decode step whose rows share such runs reads each once for all
its rows (the model's `SharedRows`), when that attends over fewer key positions.

CUDA graphs (`graphs=None`, the default: on a CUDA device): the decode step runs in static shapes, padded to
a bucket of rows and of key length, and is replayed from a CUDA graph captured per bucket (graphs.py): a small
model's eager step on a GPU is bound by its hundreds of kernel launches. Weight swaps then copy into the live
weights, which the graphs read. The per-row and cascade reads are for CPUs: on a GPU each of their attention
calls is more launches, so an eager step there always gathers. Prefill stays eager. `graphs=True` on a CPU
runs the static-shape step eagerly (tests); a model whose experts cannot run on the GPU without reading
their counts back (fp32 experts) gets none.

Not here: paged attention (shared prefixes are copied, then read once, not referenced), chunked prefill,
speculative decoding.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from realtime_rl.engine.graphs import DecodeGraphs
from realtime_rl.engine.requests import (
    Request, RequestOutput, Seq, check_request, finish_reason, notify, request_output,
)
from realtime_rl.engine.sampling import SamplingParams, draw_tokens
from realtime_rl.engine.slots import SlotTable, decode_slots
from realtime_rl.model import KVCache, Qwen3ForCausalLM, Tokenizer
from realtime_rl.model.kv_cache import SharedRows, SlotRows, SlotWindow
from realtime_rl.model.moe import grouped_experts

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineStats:
    """Where an engine's steps went, cumulative: what tells a decode-bound engine from a prefill-bound or a
    starved one (seconds are host wall time, GPU waits included)."""

    steps: int = 0
    busy_s: float = 0.0
    """Inside step()."""
    prefills: int = 0
    """Prefill forwards (each admits every request that fits)."""
    prefill_s: float = 0.0
    """Admitting, prefilling and sampling the first tokens."""
    decode_steps: int = 0
    decode_rows: int = 0
    """Rows over all decode steps (/ decode_steps: the mean batch)."""
    decode_s: float = 0.0
    """Decode forwards and their sampling."""


class Engine:
    def __init__(self, model: Qwen3ForCausalLM, tokenizer: Tokenizer | None = None, *, max_batch: int = 32,
                 max_seq_len: int = 2048, version: int = 0, capture_routing: bool = True, seed: int = 0,
                 prefix_caching: bool = True, prefix_max_age: int = 0, compile_decode: bool = False,
                 cascade_decode: bool = True, graphs: bool | None = None, prefill_wait_ms: float = 0.0) -> None:
        if max_batch < 1 or max_seq_len < 2:
            raise ValueError("need max_batch >= 1 and max_seq_len >= 2")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.version = version
        self.capture_routing = capture_routing and model.num_moe_layers > 0
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.graphs: DecodeGraphs | None = None
        if graphs is None:
            graphs = self.device.type == "cuda" and not compile_decode
        if graphs and model.num_moe_layers and not grouped_experts(self.device, self.dtype):
            log.warning("no CUDA graphs: the experts in %s on %s read their counts back each step", self.dtype,
                        self.device)
            graphs = False
        if graphs:  # one slot more: the padding rows' scratch slot, which no sequence ever holds
            self.graphs = DecodeGraphs(self._last_logits, max_batch=max_batch, max_seq_len=max_seq_len,
                                       scratch_slot=max_batch, device=self.device)
        self.cache = KVCache(model.config, max_batch + (self.graphs is not None), max_seq_len, dtype=self.dtype,
                             device=self.device)
        self.default_stop_ids = tokenizer.stop_token_ids if tokenizer is not None else []
        self.slots = SlotTable(max_batch, version, prefix_caching=prefix_caching, prefix_max_age=prefix_max_age,
                               need_routing=self.capture_routing)
        self.prefix_hit_tokens = 0
        self.prefill_tokens = 0
        self._waiting: deque[Request] = deque()
        self._running: list[Seq] = []
        self._requests: dict[str, Request] = {}  # every request queued or running, by id (for aborts)
        self._lock = threading.Lock()  # guards _waiting, _requests, _pending_swap and aborts across threads
        self._pending_swap: tuple[dict[str, torch.Tensor], int] | None = None
        self._rng = torch.Generator(device="cpu").manual_seed(seed)
        self._ids = itertools.count()
        self.last_swap_pause_ms: float | None = None
        self.stats = EngineStats()
        if prefill_wait_ms < 0:
            raise ValueError(f"prefill_wait_ms must be >= 0, got {prefill_wait_ms}")
        self.prefill_wait_s = prefill_wait_ms / 1e3
        if compile_decode and self.graphs is not None:
            raise ValueError("compile_decode and graphs are two ways of one decode step: pick one")
        self.compile_decode = compile_decode
        self.cascade_decode = cascade_decode and not compile_decode and self.device.type == "cpu"
        self._decode_forward = self._last_logits
        if compile_decode:
            # The C++ wrapper calls the graph's kernels without Python in between (~10% faster on CPU).
            self._decode_forward = torch.compile(self._last_logits, dynamic=True,
                                                 options={"cpp_wrapper": self.device.type == "cpu"})
            self._compile_graphs()

    # ------------------------------------------------------------------------------------------ intake

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                    on_update: Callable[[str, int, int | None, RequestOutput | None], None] | None = None) -> str:
        """Queue a request. on_update(request_id, sample_index, token or None, output when done) runs on the
        engine thread; one that raises is logged and its request aborted, the engine goes on."""
        prompt = self._check(prompt_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} is already queued or running")
            req = Request(request_id, prompt, params, on_update, time.perf_counter())
            self._requests[request_id] = req
            self._waiting.append(req)
        return request_id

    def _check(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        vocab = self.model.config.vocab_size
        return check_request(prompt_ids, params, vocab, self.max_seq_len, self.max_batch, self.tokenizer)

    def abort(self, request_id: str) -> None:
        """End a request at the next step, wherever it is (queued, being prefilled or decoding); a no-op once
        it has finished."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is not None:
                req.aborted = True

    def abort_all(self) -> None:
        """End every queued or running request now, telling each caller ("abort"): the engine cannot go on."""
        with self._lock:
            requests = list(self._requests.values())
            self._waiting.clear()
        self._running = []
        self.slots.discard_taken()  # a restarted engine gets every slot back (they leaked, and it hung)
        for req in requests:
            try:
                self._output(req, "abort")
            except Exception:
                log.exception("could not tell request %s that the engine stopped", req.request_id)

    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self._pending_swap)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    # ------------------------------------------------------------------------------------------ weights

    def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Stage `state` (our parameter names) beside the live weights; the next step swaps it in.

        Validation happens here, before anything changes: a wrong name or shape raises ValueError and
        the live weights keep serving. Safe to call from any thread.
        """
        params = dict(self.model.named_parameters())
        missing = sorted(set(params) - set(state))
        unknown = sorted(set(state) - set(params) - {"lm_head.weight"})
        if missing or unknown:
            raise ValueError(f"weight update does not match the model: missing {missing[:3]}, unknown {unknown[:3]}")
        staged = {}
        for name, p in params.items():
            t = state[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"weight update: {name} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
            staged[name] = t.detach().to(device=self.device, dtype=self.dtype, copy=True)
        with self._lock:
            self._pending_swap = (staged, version)

    def _apply_swap(self) -> None:
        with self._lock:
            pending, self._pending_swap = self._pending_swap, None
        if pending is None:
            return
        staged, version = pending
        t0 = time.perf_counter()
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if self.graphs is not None:
                    p.copy_(staged[name])  # the graphs read the live tensors where they lie
                else:
                    p.data = staged[name]
        if version <= self.version:  # older weights, or others under the same number: none cached is theirs
            self.slots.rollback()
        self.version = version
        self.last_swap_pause_ms = (time.perf_counter() - t0) * 1e3

    # ------------------------------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns the requests that finished in it."""
        stats, t0 = self.stats, time.perf_counter()
        self._apply_swap()
        finished: list[RequestOutput] = []
        prefills = stats.prefills
        t1 = time.perf_counter()
        self._admit_and_prefill(finished)
        t2 = time.perf_counter()
        if stats.prefills != prefills:
            stats.prefill_s += t2 - t1
        if self._running:
            rows = self._decode()
            stats.decode_s += time.perf_counter() - t2
            stats.decode_steps += rows > 0
            stats.decode_rows += rows
        finished += self._retire()
        stats.steps += 1
        stats.busy_s += time.perf_counter() - t0
        return finished

    @property
    def steps(self) -> int:
        return self.stats.steps

    def _admit_and_prefill(self, finished: list[RequestOutput]) -> None:
        admitted: list[Request] = []  # prefilled in this step's forward
        hits: list[int] = []  # how many leading prompt tokens each one's slot already holds
        reused_routing: list[torch.Tensor | None] = []  # and the routing of those tokens
        leaders: dict[tuple[int, ...], int] = {}  # a prompt -> the index in `admitted` of its first request
        followers: list[tuple[Request, int]] = []  # (request, its prompt's leader) for later ones
        aborted: list[Request] = []  # told after the lock is released (their callbacks may call in again)
        with self._lock:
            if any(r.aborted for r in self._waiting):  # wherever they wait: one blocked at the head holds no other
                aborted = [r for r in self._waiting if r.aborted]
                self._waiting = deque(r for r in self._waiting if not r.aborted)
            # Decode on while the oldest waits less than prefill_wait_s: those arriving meanwhile join its prefill.
            hold = bool(self.prefill_wait_s and self._running and self._waiting
                        and time.perf_counter() - self._waiting[0].created < self.prefill_wait_s)
            while not hold and self._waiting and self._waiting[0].params.n <= len(self.slots.free):
                req = self._waiting.popleft()
                key = tuple(req.prompt_ids) if self.slots.prefix_caching else None
                leader = leaders.get(key) if key is not None else None
                for i in range(req.params.n):
                    seed = None if req.params.seed is None else req.params.seed + i
                    seed = int(torch.randint(0, 2**62, (1,), generator=self._rng)) if seed is None else seed
                    gen = torch.Generator(device="cpu").manual_seed(seed)  # draws a uniform a token (sampling.py)
                    if i == 0 and leader is None:
                        slot, hit, routing = self._take_with_prefix(req.prompt_ids)
                        hits.append(hit)
                        reused_routing.append(routing)
                    else:
                        # A copy of the prompt's keys/values: sample 0's, or those of the request admitted
                        # with the same prompt.
                        source = (req if leader is None else admitted[leader]).seqs[0].slot
                        slot, _ = self.slots.take(None, self.version, shares=source)
                    req.seqs.append(Seq(req, i, slot, gen))
                if leader is None:
                    if key is not None:
                        leaders[key] = len(admitted)
                    admitted.append(req)
                else:
                    followers.append((req, leader))
        finished += [self._output(req, "abort") for req in aborted]
        if not admitted:
            return
        self.stats.prefills += 1
        lengths = [len(r.prompt_ids) for r in admitted]
        T = max(n - s for n, s in zip(lengths, hits))
        ids = torch.zeros(len(admitted), T, dtype=torch.long)
        positions = torch.zeros(len(admitted), T, dtype=torch.long)
        for b, (req, start) in enumerate(zip(admitted, hits)):
            new = lengths[b] - start
            ids[b, :new] = torch.tensor(req.prompt_ids[start:])
            # Padding writes throwaway keys past the prompt (overwritten before any query reaches them).
            positions[b] = torch.cat([torch.arange(start, lengths[b]),
                                      torch.arange(lengths[b], lengths[b] + T - new).clamp(max=self.max_seq_len - 1)])
        self.prefill_tokens += sum(lengths) + sum(len(r.prompt_ids) for r, _ in followers)
        self.prefix_hit_tokens += sum(hits) + sum(len(r.prompt_ids) for r, _ in followers)
        slots = torch.tensor([r.seqs[0].slot for r in admitted])
        for req, start, n in zip(admitted, hits, lengths):
            self.slots.computed(req.seqs[0].slot, start, n)
        last = torch.tensor([n - s for n, s in zip(lengths, hits)]) - 1
        with torch.no_grad():  # the LM head at each row's last position only: [B, T, vocab] logits are GiBs
            hidden_BTC, routing_BTLK = self.model.hidden_states(
                ids.to(self.device), positions.to(self.device), kv_cache=self.cache, cache_slots=slots.to(self.device),
                capture_routing=self.capture_routing)
            logits_BV = self.model.lm_head(hidden_BTC[torch.arange(len(admitted)), last.to(self.device)])
        now = time.perf_counter()
        if routing_BTLK is not None:
            for b, (req, start) in enumerate(zip(admitted, hits)):
                computed = routing_BTLK[b, : lengths[b] - start].cpu()
                req.prompt_routing = torch.cat([reused_routing[b][:start], computed]) if start else computed
        rows: list[Seq] = []
        row_logits = []
        for req, b in [(r, b) for b, r in enumerate(admitted)] + followers:
            leader = admitted[b]
            req.prefilled = now
            req.prompt_routing = leader.prompt_routing
            held = np.asarray(req.prompt_ids)
            for seq in req.seqs:
                if seq.slot != leader.seqs[0].slot:
                    self._copy_prefix(leader.seqs[0].slot, seq.slot, len(held))
                self.slots.hold(seq.slot, held, req.prompt_routing)
            rows += req.seqs
            row_logits += [logits_BV[b]] * len(req.seqs)
        self._sample(rows, torch.stack(row_logits))
        self._running += rows

    def _take_with_prefix(self, prompt: list[int]) -> tuple[int, int, torch.Tensor | None]:
        """A slot for a request's prompt, how many leading tokens of it are already there and their routing:
        the longest prefix a free slot's cache holds, or a copy of a longer one from a slot in use."""
        source, live_hit = self.slots.live_prefix(prompt, self.version)
        slot, hit = self.slots.take(prompt, self.version, beat=live_hit)
        routing = self.slots.pop_routing(slot)
        if live_hit and not hit:
            self._copy_prefix(source, slot, live_hit)
            routing, hit = self.slots.routing[source], live_hit
        return slot, hit, routing

    def _copy_prefix(self, source: int, slot: int, length: int) -> None:
        self.cache.copy_prefix(source, slot, length)
        self.slots.copied(source, slot, length)

    def _decode(self) -> int:
        """Decode one token of every running sequence; returns how many rows the step ran."""
        seqs = sorted((s for s in self._running if s.finish_reason is None), key=lambda s: s.slot)
        if not seqs:
            return 0
        if self.graphs is not None:
            pos = [len(s.req.prompt_ids) + len(s.token_ids) - 1 for s in seqs]
            logits_BV, routing_BTLK = self.graphs.run([s.token_ids[-1] for s in seqs], pos, [s.slot for s in seqs])
            self._keep_routing(seqs, routing_BTLK)
            self._sample(seqs, logits_BV)
            return len(seqs)
        ids = torch.tensor([[s.token_ids[-1]] for s in seqs], device=self.device)
        pos = [len(s.req.prompt_ids) + len(s.token_ids) - 1 for s in seqs]
        positions = torch.tensor(pos, device=self.device)[:, None]
        lineages = [self.slots.blocks[s.slot] for s in seqs] if self.cascade_decode else None
        # Off a CPU, always gathered: a fixed number of launches, where the other reads add calls per row or run.
        slots = decode_slots([s.slot for s in seqs], [p + 1 for p in pos],
                             gather=self.compile_decode or self.device.type != "cpu", device=self.device,
                             lineages=lineages)
        with torch.no_grad():
            logits_BV, routing_BTLK = self._decode_forward(ids, positions, slots, max(pos) + 1)
        self._keep_routing(seqs, routing_BTLK)
        self._sample(seqs, logits_BV)
        return len(seqs)

    @staticmethod
    def _keep_routing(seqs: list[Seq], routing_BTLK: torch.Tensor | None) -> None:
        if routing_BTLK is not None:
            routing = routing_BTLK[:, 0].cpu()
            for b, s in enumerate(seqs):
                s.routing.append(routing[b : b + 1])

    def _last_logits(self, ids_BT: torch.Tensor, positions_BT: torch.Tensor,
                     slots: torch.Tensor | int | SlotWindow | SlotRows | SharedRows, length: int
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decode forward: logits of each row's last position, and the routing it used. `slots`: each
        row's slot, the first of consecutive ones, the window they lie in, or each row's slot and length."""
        if isinstance(slots, int):
            slots = slice(slots, slots + ids_BT.shape[0])
        out = self.model(ids_BT, positions_BT, kv_cache=self.cache, cache_slots=slots,
                         capture_routing=self.capture_routing, cache_length=length)
        return out.logits_BTV[:, -1], out.routing_BTLK

    def _sample(self, seqs: list[Seq], logits_BV: torch.Tensor) -> None:
        params = [s.req.params for s in seqs]
        drawn = draw_tokens(logits_BV, params, [s.generator for s in seqs])
        top = drawn.top
        now = time.perf_counter()
        for b, s in enumerate(seqs):
            token = drawn.tokens[b]
            s.token_ids.append(token)
            s.logprobs.append(drawn.logprobs[b])
            s.raw_logprobs.append(drawn.raw_logprobs[b])
            s.versions.append(self.version)
            if top is not None and params[b].top_logprobs:
                k = params[b].top_logprobs
                s.top.append(list(zip(top.indices[b, :k].tolist(), top.values[b, :k].tolist())))
            if not s.req.first_token:
                s.req.first_token = now
            notify(s.req, s.index, token, None)
            s.finish_reason = finish_reason(s, self.default_stop_ids, self.tokenizer, self.max_seq_len)

    def _retire(self) -> list[RequestOutput]:
        done: list[RequestOutput] = []
        still: list[Seq] = []
        for s in self._running:
            if s.finish_reason is None and s.req.aborted:
                s.finish_reason = "abort"
            if s.finish_reason is None:
                still.append(s)
            else:
                # The slot's cache holds the prompt and every generated token but the last (never an input).
                routing = torch.cat([s.req.prompt_routing, *s.routing]) if s.req.prompt_routing is not None else None
                self.slots.release(s.slot, s.req.prompt_ids + s.token_ids[:-1], routing)
        finished_reqs = {id(s.req): s.req for s in self._running if s.finish_reason is not None}
        self._running = still
        for req in finished_reqs.values():
            if all(s.finish_reason is not None for s in req.seqs):
                done.append(self._output(req, None))
        return done

    def _output(self, req: Request, reason: str | None) -> RequestOutput:
        """The request's output, told to its caller; the engine forgets the request."""
        out = request_output(req, self.tokenizer, reason)
        with self._lock:
            self._requests.pop(req.request_id, None)
        notify(req, -1, None, out)
        return out

    # ------------------------------------------------------------------------------------------ sync use

    def _compile_graphs(self) -> None:
        """Run one decode step of one row and of two, so that both compiled graphs exist before any request
        arrives. Seeded greedy requests on token 0: no randomness is drawn from the engine."""
        params = SamplingParams(temperature=0.0, max_tokens=2, seed=0, ignore_eos=True)
        for rows in sorted({1, min(2, self.max_batch)}):
            self.generate([[0]] * rows, params)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 timeout_s: float = 600.0) -> list[RequestOutput]:
        """Run prompts to completion on the calling thread (tests, benchmarks, offline eval)."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        for p, sp in zip(prompts, plist):
            self._check(p, sp)  # every prompt before any is queued: a bad one leaves nothing behind
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        results: dict[str, RequestOutput] = {}
        deadline = time.monotonic() + timeout_s
        mine = set(ids)  # requests queued before (add_request, an earlier call that timed out) finish here too
        while len(results) < len(ids):
            if time.monotonic() > deadline:
                for rid in ids:
                    self.abort(rid)
                raise TimeoutError(f"generation did not finish within {timeout_s} s")
            for out in self.step():
                if out.request_id in mine:
                    results[out.request_id] = out
        return [results[i] for i in ids]
