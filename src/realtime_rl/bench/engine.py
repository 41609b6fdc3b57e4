"""`rtrl bench engine`: decode throughput of our engine against transformers' `generate`, same run.

The same weights (the default MoE architecture, random init, saved once and loaded by both), the
same random prompts, greedy decoding of a fixed number of tokens (no early stop) at batch sizes 1, 8
and 32. Ours runs twice: with the compiled decode step (`tokens_per_s`, `speedup_vs_hf`) and eager
(`eager_*`); on a GPU a third time, replaying its decode steps from CUDA graphs (`graphs_*`, the engine's
default there; each graph captured in an untimed run first); transformers' `generate` runs eager, as its
users call it; on a GPU also one decode step of a rollout worker's batch (96 rows, 300-3,000 cached tokens
each), eager against replayed (`agent_decode_*`). Also: the seconds the compiled
engine's warm-up took (`compile_s`), the throughput cost of MoE routing capture, the pause of a hot
weight swap made while a batch-32 decode is running, and one eager decode step at agent-episode lengths
with the rows in scattered slots (28 of 32, 1,500-2,000 cached tokens each, what continuous batching
over agent episodes leaves), read through a slot window (`scattered_window_ms`), gathered
(`scattered_gather_ms`) and row by row (`scattered_rows_ms`); and the same for a ragged batch as a
rollout worker's engine runs one (14 rows in slots 0-27, 300-3,000 cached tokens each: `ragged_*_ms`,
`ragged_rows_speedup` against the window, which the engine used before it chose by cost). Last, a
rollout worker's batch of GRPO groups (4 tasks x 8 episodes, one ~690-token prompt per task of which 600
tokens are a system prompt all share, 70 sampled tokens each): with prefix sharing between requests
admitted together and sequences in flight, decode reading each group's shared prompt once (`grpo_shared_s`),
the same with every row reading its own copy (`grpo_copied_s`, as the engine did before cascade attention)
and with every prompt prefilled afresh (`grpo_recomputed_s`, as it did before it shared), with the ratios
`grpo_cascade_speedup` (copied / shared) and `grpo_sharing_speedup` (recomputed / shared). And one decode
step of such a batch (4 x 8 rows, each group's slots holding copies of its prompt) reading each group's
prompt once against every row reading its own copy: at a first turn (690 of 760 cached tokens shared,
`shared_*`) and under a 2,000-token shared prompt (`shared_long_*`).

`RTRL_BENCH_DEVICE` (default cpu) and `RTRL_BENCH_DTYPE` (float32 or bfloat16) place both models, as a
rollout worker's `rollout.device` / `rollout.dtype` place its engine. Off CPU or in bf16 the bench runs the
throughput comparison, the capture and sampling costs and the swap pause; the decode-step studies above are
CPU fp32's (they time the CPU kernels' choices). A compiled decode that fails to build is recorded (`compile_error`)
and the eager engine still measured.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from typing import Any

import torch

from realtime_rl.bench import device_and_dtype
from realtime_rl.config import ModelConfig
from realtime_rl.engine import Engine, SamplingParams
from realtime_rl.engine.slots import SlotTable, decode_slots
from realtime_rl.model import KVCache, Qwen3ForCausalLM, save_checkpoint
from realtime_rl.model.kv_cache import SharedRows, SlotRows, SlotWindow

BATCHES = (1, 8, 32)


def default_model(seed: int = 0) -> Qwen3ForCausalLM:
    config = ModelConfig(num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config)
    model.reset_parameters(seed=seed)
    return model.eval()


def _engine(model: Qwen3ForCausalLM, batch: int, max_seq_len: int, capture: bool = True,
            compile_decode: bool = False, graphs: bool = False) -> tuple[Engine, float]:
    """An engine for the benchmark and the seconds its construction and warm-up took (with compile_decode:
    compiling its decode graphs). No prefix caching: every run prefills its prompts afresh, as
    transformers does."""
    t0 = time.perf_counter()
    engine = Engine(model, max_batch=batch, max_seq_len=max_seq_len, capture_routing=capture,
                    prefix_caching=False, compile_decode=compile_decode, graphs=graphs)
    engine.generate([[1, 2, 3]] * min(batch, 4), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    return engine, time.perf_counter() - t0


def _ours(engine: Engine, prompts: list[list[int]], new_tokens: int, temperature: float = 0.0) -> float:
    params = SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True, seed=0)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    assert all(len(o.samples[0].token_ids) == new_tokens for o in outs)
    return len(prompts) * new_tokens / elapsed


def _hf(hf_model: Any, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts, device=hf_model.device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        hf_model.generate(ids[:1], **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2,
                                      "attention_mask": torch.ones_like(ids[:1])})
        t0 = time.perf_counter()
        out = hf_model.generate(ids, **kwargs).cpu()  # the copy waits for a GPU's last kernel
    elapsed = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new_tokens
    return len(prompts) * new_tokens / elapsed


def swap_pause_ms(model: Qwen3ForCausalLM, batch: int, new_tokens: int, repeats: int = 5) -> float:
    """Median pause of the decode loop for a swap staged while `batch` requests are mid-generation."""
    engine = Engine(model, max_batch=batch, max_seq_len=32 + new_tokens + 1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    pauses = []
    for r in range(repeats):
        for i in range(batch):
            engine.add_request(list(range(1, 33)), SamplingParams(temperature=0.0, max_tokens=new_tokens,
                                                                   ignore_eos=True))
        for _ in range(3):
            engine.step()
        stager = threading.Thread(target=engine.update_weights, args=(state, r + 1))
        stager.start()
        stager.join()
        while engine.has_work():
            engine.step()
        assert engine.version == r + 1
        pauses.append(engine.last_swap_pause_ms)
    return statistics.median(pauses)


def agent_decode_ms(model: Qwen3ForCausalLM, repeats: int, rows: int = 96, context: tuple[int, int] = (300, 3000),
                    max_seq_len: int = 4096, steps: int = 20) -> dict[str, float]:
    """One decode step of a rollout worker's batch on a GPU (`rows` episodes, 300-3,000 cached tokens each, in
    a 4,096-token cache): the eager step (gathered, as the engine runs it off a CPU) against the same step
    replayed from a CUDA graph. Medians over `repeats` alternations of `steps` steps each."""
    engine = Engine(model, max_batch=rows, max_seq_len=max_seq_len, graphs=True)
    assert engine.graphs is not None
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(context[0], context[1], (rows,), generator=g).tolist()
    tokens = torch.randint(0, model.config.vocab_size, (rows,), generator=g).tolist()
    positions, slots = [n - 1 for n in lengths], list(range(rows))

    def eager_step() -> torch.Tensor:  # from the host's lists, as a step builds its inputs and as graphs.run does
        ids = torch.tensor(tokens, device=engine.device)[:, None]
        pos = torch.tensor(positions, device=engine.device)[:, None]
        slots_t = torch.tensor(slots, device=engine.device)
        return engine._last_logits(ids, pos, slots_t, max(lengths))

    def timed(step) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps * 1e3

    with torch.no_grad():
        eager = eager_step
        graphed = lambda: engine.graphs.run(tokens, positions, slots)  # noqa: E731
        eager(), graphed()  # warm-up, and the graph's capture
        runs = {"eager": [], "graphs": []}
        for _ in range(repeats):
            runs["eager"].append(timed(eager))
            runs["graphs"].append(timed(graphed))
    eager_ms, graphs_ms = statistics.median(runs["eager"]), statistics.median(runs["graphs"])
    return {"agent_decode_eager_ms": eager_ms, "agent_decode_graphs_ms": graphs_ms,
            "agent_decode_graphs_speedup": eager_ms / graphs_ms,
            "agent_decode_capture_error": engine.graphs.capture_error}


def scattered_decode_ms(model: Qwen3ForCausalLM, repeats: int, slots: int = 32,
                        free: tuple[int, ...] = (3, 9, 17, 25), context: tuple[int, int] = (1500, 2000),
                        name: str = "scattered") -> dict[str, float]:
    """One decode step (ms, median of `repeats` timings of 10 steps) over rows in scattered KV-cache slots
    with random lengths in `context`, through a slot window, gathered and row by row; the cache holds random
    keys/values (the step's cost does not depend on them)."""
    rows = [s for s in range(slots) if s not in free]
    cache = KVCache(model.config, slots, context[1] + 1)
    for t in cache.k_LSHPD + cache.v_LSHPD:
        t.normal_()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (len(rows), 1), generator=gen)
    positions = torch.randint(context[0], context[1], (len(rows), 1), generator=gen)
    length = int(positions.max()) + 1
    ways = {"window": SlotWindow(rows[0], rows[-1] - rows[0] + 1, torch.tensor(rows) - rows[0]),
            "gather": torch.tensor(rows), "rows": SlotRows(rows, (positions[:, 0] + 1).tolist())}
    times = decode_step_ms(model, cache, ids, positions, ways, length, repeats)
    return {f"{name}_{way}_ms": ms for way, ms in times.items()}


def decode_step_ms(model: Qwen3ForCausalLM, cache: KVCache, ids: torch.Tensor, positions: torch.Tensor,
                   ways: dict[str, Any], length: int, repeats: int) -> dict[str, float]:
    """Each way's decode forward (ms, median of `repeats` timings of 10), the ways alternated so that load on
    the machine hits all alike."""
    times: dict[str, list[float]] = {way: [] for way in ways}
    with torch.no_grad():
        for _ in range(repeats):
            for way, slots_arg in ways.items():
                t0 = time.perf_counter()
                for _ in range(10):
                    model(ids, positions, kv_cache=cache, cache_slots=slots_arg, cache_length=length)
                times[way].append((time.perf_counter() - t0) / 10 * 1e3)
    return {way: statistics.median(t) for way, t in times.items()}


def shared_decode_ms(model: Qwen3ForCausalLM, repeats: int, groups: int = 4, group_size: int = 8,
                     shared: int = 690, context: int = 760, name: str = "shared") -> dict[str, float]:
    """One decode step (ms, median of `repeats` timings of 10 steps) of `groups` x `group_size` rows in
    consecutive slots, each group's slots holding copies of one `shared`-token prefill, `context` cached
    tokens a row: reading each group's copy once (cascade attention, `{name}_cascade_ms`) against each row
    reading its own (`{name}_own_ms`, what the engine chooses without the slots' lineages)."""
    rows = groups * group_size
    cache = KVCache(model.config, rows, context + 1)
    for t in cache.k_LSHPD + cache.v_LSHPD:
        t.normal_()
    table = SlotTable(rows, 0, prefix_caching=True, prefix_max_age=0, need_routing=False)
    for slot in range(rows):
        leader = slot - slot % group_size
        if slot == leader:
            table.computed(slot, 0, shared)
        else:
            cache.copy_prefix(leader, slot, shared)
            table.copied(leader, slot, shared)
        table.computed(slot, shared, context - 1)
    slots, lengths = list(range(rows)), [context] * rows
    cascade = decode_slots(slots, lengths, gather=False, device=torch.device("cpu"),
                           lineages=[table.blocks[s] for s in slots])
    own = decode_slots(slots, lengths, gather=False, device=torch.device("cpu"))
    assert isinstance(cascade, SharedRows) and not isinstance(own, SharedRows)
    ways = {"cascade": cascade, "own": slice(own, own + rows) if isinstance(own, int) else own}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (rows, 1), generator=gen)
    positions = torch.full((rows, 1), context - 1)
    times = decode_step_ms(model, cache, ids, positions, ways, context, repeats)
    metrics = {f"{name}_{way}_ms": ms for way, ms in times.items()}
    metrics[f"{name}_cascade_speedup"] = metrics[f"{name}_own_ms"] / metrics[f"{name}_cascade_ms"]
    return metrics


def grpo_batch_s(model: Qwen3ForCausalLM, repeats: int, groups: int = 4, group_size: int = 8,
                 system_len: int = 600, task_len: int = 90, new_tokens: int = 70) -> dict[str, float]:
    """Seconds (median of `repeats`, alternated) to sample `groups` GRPO groups of `group_size` episodes, each
    episode its own request as a rollout worker's agent loop sends them: with prefix caching and cascade decode
    attention, with prefix caching alone, and with neither."""
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    system = torch.randint(0, vocab, (system_len,), generator=gen).tolist()
    tasks = [torch.randint(0, vocab, (task_len,), generator=gen).tolist() for _ in range(groups)]
    prompts = [system + task for task in tasks for _ in range(group_size)]
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=0)
    engines = {way: Engine(model, max_batch=len(prompts), max_seq_len=system_len + task_len + new_tokens + 1,
                           prefix_caching=way != "recomputed", cascade_decode=way == "shared")
               for way in ("shared", "copied", "recomputed")}
    times: dict[str, list[float]] = {way: [] for way in engines}
    for _ in range(repeats):
        for way, engine in engines.items():
            engine.slots.rollback()  # nothing from the last repeat is reused
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params)
            times[way].append(time.perf_counter() - t0)
            assert all(len(o.samples[0].token_ids) == new_tokens for o in outs)
    shared_s, copied_s, recomputed_s = (statistics.median(times[way]) for way in engines)
    return {"grpo_shared_s": shared_s, "grpo_copied_s": copied_s, "grpo_recomputed_s": recomputed_s,
            "grpo_cascade_speedup": copied_s / shared_s, "grpo_sharing_speedup": recomputed_s / shared_s}


def run(quick: bool = False) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    device, dtype_name = device_and_dtype()
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    model = default_model()
    new_tokens = 16 if quick else 64
    prompt_len = 32
    gen = torch.Generator().manual_seed(0)
    all_prompts = torch.randint(0, model.config.vocab_size, (max(BATCHES), prompt_len), generator=gen).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(tmp, model)
        hf_model = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(device).eval()
    model = model.to(device, dtype)
    metrics: dict[str, Any] = {"model_parameters": model.num_parameters(), "new_tokens": new_tokens,
                               "prompt_tokens": prompt_len, "torch_threads": torch.get_num_threads(),
                               "hf_experts_implementation": hf_model.config._experts_implementation,
                               "device": str(device), "dtype": dtype_name}
    repeats = 2 if quick else 3
    max_seq_len = prompt_len + new_tokens + 1
    eager, _ = _engine(model, max(BATCHES), max_seq_len)
    try:
        compiled, metrics["compile_s"] = _engine(model, max(BATCHES), max_seq_len, compile_decode=True)
    except Exception as e:  # noqa: BLE001 - e.g. no inductor backend for this device: measure the rest
        if device.type == "cpu":
            raise
        compiled, metrics["compile_error"] = eager, f"{type(e).__name__}: {e}"[:500]
    metrics["compiled"] = compiled is not eager  # else tokens_per_s_* are the eager engine's
    graphed = None
    if device.type == "cuda":
        graphed, _ = _engine(model, max(BATCHES), max_seq_len, graphs=True)
    for b in BATCHES:
        prompts = all_prompts[:b]
        if graphed is not None:
            _ours(graphed, prompts, new_tokens)  # captures this batch's graphs
        # Alternate the engines so that load on the machine hits all alike; report medians.
        runs: dict[str, list[float]] = {"compiled": [], "eager": [], "hf": [], "graphs": []}
        for _ in range(repeats):
            runs["compiled"].append(_ours(compiled, prompts, new_tokens))
            runs["eager"].append(_ours(eager, prompts, new_tokens))
            runs["hf"].append(_hf(hf_model, prompts, new_tokens))
            if graphed is not None:
                runs["graphs"].append(_ours(graphed, prompts, new_tokens))
        if graphed is not None:
            metrics[f"graphs_tokens_per_s_b{b}"] = statistics.median(runs["graphs"])
            metrics[f"graphs_speedup_vs_hf_b{b}"] = metrics[f"graphs_tokens_per_s_b{b}"] / statistics.median(runs["hf"])
        metrics[f"tokens_per_s_b{b}"] = statistics.median(runs["compiled"])
        metrics[f"eager_tokens_per_s_b{b}"] = statistics.median(runs["eager"])
        metrics[f"hf_tokens_per_s_b{b}"] = statistics.median(runs["hf"])
        metrics[f"speedup_vs_hf_b{b}"] = metrics[f"tokens_per_s_b{b}"] / metrics[f"hf_tokens_per_s_b{b}"]
        metrics[f"eager_speedup_vs_hf_b{b}"] = metrics[f"eager_tokens_per_s_b{b}"] / metrics[f"hf_tokens_per_s_b{b}"]
    b = max(BATCHES)
    metrics["tokens_per_s"] = metrics[f"tokens_per_s_b{b}"]
    metrics["hf_tokens_per_s"] = metrics[f"hf_tokens_per_s_b{b}"]
    metrics["speedup_vs_hf"] = metrics[f"speedup_vs_hf_b{b}"]
    metrics["eager_speedup_vs_hf"] = metrics[f"eager_speedup_vs_hf_b{b}"]
    if graphed is not None:
        metrics["graphs_tokens_per_s"] = metrics[f"graphs_tokens_per_s_b{b}"]
        metrics["graphs_speedup_vs_hf"] = metrics[f"graphs_speedup_vs_hf_b{b}"]
        metrics["graphs_captured"] = len(graphed.graphs.graphs) if graphed.graphs is not None else 0
        metrics["graphs_capture_error"] = graphed.graphs.capture_error if graphed.graphs is not None else None
    # Capture cost (eager, where it is largest relative to the step): interleave runs with and without
    # capture so drift hits both alike.
    # And the cost of sampling at T = 1 (each row's own seeded draw) against greedy rows, on the eager engine.
    no_capture, _ = _engine(model, b, max_seq_len, capture=False)
    with_capture, without, sampled = [], [], []
    for _ in range(repeats):
        without.append(_ours(no_capture, all_prompts, new_tokens))
        with_capture.append(_ours(eager, all_prompts, new_tokens))
        sampled.append(_ours(eager, all_prompts, new_tokens, temperature=1.0))
    metrics["tokens_per_s_no_capture"] = statistics.median(without)
    metrics["capture_overhead"] = 1.0 - statistics.median(with_capture) / statistics.median(without)
    metrics["sampled_tokens_per_s"] = statistics.median(sampled)
    metrics["sampling_cost"] = 1.0 - statistics.median(sampled) / statistics.median(with_capture)
    metrics["swap_pause_ms"] = swap_pause_ms(model, batch=b, new_tokens=new_tokens)
    if device.type == "cuda":
        metrics |= agent_decode_ms(model, repeats=2 if quick else 5)
    if device.type != "cpu" or dtype != torch.float32:
        return metrics
    metrics |= scattered_decode_ms(model, repeats=2 if quick else 5)
    metrics["scattered_window_speedup"] = metrics["scattered_gather_ms"] / metrics["scattered_window_ms"]
    ragged_free = tuple(s for s in range(32) if s % 2 or s >= 28)  # 14 rows in slots 0, 2, ..., 26
    metrics |= scattered_decode_ms(model, repeats=2 if quick else 5, free=ragged_free, context=(300, 3000),
                                   name="ragged")
    metrics["ragged_rows_speedup"] = metrics["ragged_window_ms"] / metrics["ragged_rows_ms"]
    metrics |= (grpo_batch_s(model, repeats=1, groups=2, group_size=2, system_len=40, task_len=8, new_tokens=4)
                if quick else grpo_batch_s(model, repeats=3))
    metrics |= shared_decode_ms(model, repeats=2 if quick else 15)  # a first turn: 690 of 760 tokens shared
    metrics |= shared_decode_ms(model, repeats=2 if quick else 15, shared=2000, context=2100, name="shared_long")
    return metrics
