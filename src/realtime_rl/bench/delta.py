"""`rtrl bench delta`: weight-delta size and speed on consecutive versions from real optimizer steps.

Two models: the default architecture (configs/pretrain/default.toml [model], 2.8M parameters) and a
~100M-parameter dense Qwen3 (hidden 768, 12 layers, vocab 8192). Each trains with AdamW (lr 1e-6,
weight decay 0.01, fp32 master weights) on the next-token loss over code tokens from the generated
corpus; after every step the weights are published in bf16. Warm-up steps fill Adam's moments
first, then consecutive published versions are measured. In the same run, on the same versions:

- ratio: bf16 bytes of the weights / bytes of our delta blob (header, digests and trailer included)
- ratio_int32_bf16: the same over an int32 index + bf16 value per changed element (TRL, prime-rl)
- ratio_xor_zstd: the same over zstd (level 3) of each tensor's XOR with its previous version
  (slime, SkyRL, NeMo-RL)
- entropy_bound_ratio: bf16 bytes / the empirical entropy of the delta under an order-0 model per
  tensor (each element changes independently with the tensor's rate; each move, in ulps, drawn from
  the tensor's move histogram); entropy_bound_ratio_exponent: the same with rates and histograms per
  exponent of the base element (the context our codec uses); fraction_of_entropy_bound = ratio /
  entropy_bound_ratio_exponent, the stricter of the two. Model costs are not charged to the bounds.
- encode/decode GB/s (bf16 bytes per second: digesting, encoding; decoding, verifying every tensor)
- swap_pause_ms: the 100M model served by the engine, the delta applied by a WeightSubscriber while
  4 requests decode; the pause inside Engine._apply_swap (median of 5)
- alternatives (payload bytes only, on the last pair): the encodings we tried before this one
- a learning-rate sweep on the default model (lr 3e-7 .. 1e-5; the 1e-6 row is the main measurement),
  to show the ratio where ~1% of elements change.

Those versions come from random initial weights (std 0.02). `rl_steps` measures the same figures on
real steps of our RL trainer: `rollout.train` with configs/train/default.toml (GRPO, local backend,
one worker, here synchronous) for 4 steps from the default base model (`RTRL_BENCH_BASE=DIR` picks
another) at the recipe's learning rate; the full run repeats it at lr 1e-6 (`rl_steps_low_lr`), the
rate of the versions above. The trainer checkpoints only after a step, so version 0 is the base
checkpoint itself. Every consecutive pair of versions is measured as bf16 copies (what a bf16
inference server receives: the headline) and in fp32 (what the trainer publishes to our CPU workers
today). In the fp32 figures the peer encoding is int32 index + fp32 value, and the bounds are
optimistic: the histograms of moves hundreds to tens of thousands of ulps wide are not charged.
`published_bytes_delta` are the sizes of the delta files the trainer's WeightPublisher wrote to
run_dir/weights, checked to rebuild exactly the checkpointed versions. A step whose groups all
carried no signal leaves the weights bit-identical: it is listed in `unchanged_versions`, not
measured. `--quick` runs 2 steps from a smoke-sized base (bench/learn.py) that never passes a task,
so there malformed tool calls are penalised (rl.malformed_penalty 0.5) to give the groups a signal.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import zstandard

from realtime_rl.bench.learn import base_and_recipe
from realtime_rl.config import ModelConfig, PretrainConfig, TrainConfig, load_config
from realtime_rl.deploy import (
    FilesystemTransport, WeightPublisher, WeightState, WeightSubscriber, decode, encode_delta, read_header,
)
from realtime_rl.deploy import tensor_codec as tc
from realtime_rl.deploy.bits import gaps
from realtime_rl.engine import Engine, SamplingParams
from realtime_rl.model import Qwen3ForCausalLM, Tokenizer, generate_corpus, load_checkpoint
from realtime_rl.rollout import train

DEFAULT_TOML = Path(__file__).resolve().parents[3] / "configs" / "pretrain" / "default.toml"
LR = 1e-6
RL_STEPS, QUICK_RL_STEPS = 4, 2
BIG = dict(vocab_size=8192, hidden_size=768, intermediate_size=2304, num_hidden_layers=12,
           num_attention_heads=12, num_key_value_heads=4, head_dim=64, tie_word_embeddings=False)
QUICK_BIG = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
Versions = list[dict[str, torch.Tensor]]


def default_config() -> ModelConfig:
    if DEFAULT_TOML.is_file():
        return load_config(PretrainConfig, DEFAULT_TOML).model
    return PretrainConfig().model


def token_stream(seed: int = 0) -> torch.Tensor:
    docs = list(generate_corpus(2000, seed=seed))
    tokenizer = Tokenizer.train(docs, vocab_size=4096)
    return torch.tensor([t for d in docs for t in tokenizer.encode(d)])


def train_versions(config: ModelConfig, tokens: torch.Tensor, lr: float, warmup: int, measured: int,
                   batch: int, seq: int, seed: int = 0) -> tuple[Qwen3ForCausalLM, Versions]:
    """bf16 copies of the fp32 master weights after each of the last `measured` + 1 AdamW steps."""
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.reset_parameters(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    versions = []
    for step in range(warmup + measured + 1):
        starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=gen)
        ids = torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()]) % config.vocab_size
        logits = model(ids[:, :-1]).logits_BTV
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step >= warmup:
            versions.append({n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()})
    return model, versions


# ------------------------------------------------------------------------------------- measurements

def _entropy_bits(old: np.ndarray, new: np.ndarray, fmt: tc.FloatFormat, by_exponent: bool) -> float:
    """Empirical entropy (bits) of the change mask and the moves, per tensor or per base exponent."""
    e = tc._exponents(old, fmt).astype(np.int64) if by_exponent else np.zeros(old.size, dtype=np.int64)
    changed = np.flatnonzero(old != new)
    n_ctx = np.bincount(e)
    c_ctx = np.bincount(e[changed], minlength=n_ctx.size)
    bits = float(tc._entropy_bits(n_ctx.astype(np.float64), c_ctx.astype(np.float64)).sum())
    if changed.size:
        move = tc.ordered(new[changed]).astype(np.int64) - tc.ordered(old[changed]).astype(np.int64)
        pair = e[changed] * (1 << 34) + (move + (1 << 33))
        _, first, counts = np.unique(pair, return_index=True, return_counts=True)
        ctx_total = c_ctx[e[changed][first]]
        bits += float(-(counts * np.log2(counts / ctx_total)).sum())
    return bits


def measure_pair(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], version: int) -> dict[str, Any]:
    base = WeightState.of(old, version - 1)
    t1 = time.perf_counter()
    state = WeightState.of(new, version)
    blob = encode_delta(base, state)
    t2 = time.perf_counter()
    rebuilt = decode(blob, base)
    t3 = time.perf_counter()
    assert rebuilt.digests == state.digests
    full = state.nbytes
    changed = int_bf16 = xor_zstd = 0
    h0 = hexp = 0.0
    zstd = zstandard.ZstdCompressor(level=3)
    for name, t in new.items():
        fmt = tc.float_format(t.dtype)
        a, b = tc.bit_view(old[name]), tc.bit_view(t)
        c = int((a != b).sum())
        changed += c
        int_bf16 += c * (4 + t.element_size())
        xor_zstd += len(zstd.compress((a ^ b).tobytes()))
        h0 += _entropy_bits(a, b, fmt, by_exponent=False)
        hexp += _entropy_bits(a, b, fmt, by_exponent=True)
    numel = sum(t.numel() for t in new.values())
    ratio = full / len(blob)
    return {
        "changed_fraction": changed / numel, "ratio": ratio, "ratio_int32_bf16": full / int_bf16,
        "ratio_xor_zstd": full / xor_zstd, "entropy_bound_ratio": full / (h0 / 8),
        "entropy_bound_ratio_exponent": full / (hexp / 8),
        "fraction_of_entropy_bound": ratio / (full / (hexp / 8)),
        "encode_gb_per_s": full / (t2 - t1) / 1e9, "decode_gb_per_s": full / (t3 - t2) / 1e9,
        "bytes_full": full, "bytes_delta": len(blob), "blob": blob,
    }


def _varint_bytes(v: np.ndarray) -> bytes:
    v = v.astype(np.uint64)
    nbytes = np.ones(v.size, dtype=np.int64)
    for shift in (7, 14, 21, 28, 35):
        nbytes += v >= np.uint64(1 << shift)
    out = np.zeros(int(nbytes.sum()), dtype=np.uint8)
    start = np.cumsum(nbytes) - nbytes
    for j in range(int(nbytes.max(initial=1))):
        has = nbytes > j
        byte = (v[has] >> np.uint64(7 * j)) & np.uint64(0x7F)
        out[start[has] + j] = byte | np.where(nbytes[has] > j + 1, 0x80, 0).astype(np.uint64)
    return out.tobytes()


def _moves_zstd(a: np.ndarray, b: np.ndarray, changed: np.ndarray, level: int) -> int:
    move = (tc.ordered(b[changed]) - tc.ordered(a[changed])).astype(a.dtype)
    planes = tc._zigzag(move).view(np.uint8).reshape(-1, a.dtype.itemsize).T
    return len(zstandard.ZstdCompressor(level=level).compress(np.ascontiguousarray(planes).tobytes()))


def alternatives(prev: dict[str, torch.Tensor], old: dict[str, torch.Tensor],
                 new: dict[str, torch.Tensor]) -> dict[str, float]:
    """Payload-only ratios of the encodings we tried (prev -> old trains the zstd dictionary)."""
    full = sum(t.numel() * t.element_size() for t in new.values())
    sizes = dict.fromkeys(["bitmap_zstd", "gaps_varint_zstd3", "gaps_varint_zstd19", "gaps_varint_zstd_dict",
                           "gaps_u32_planes_zstd", "rice_one_class", "ours"], 0)
    samples = []
    for name in prev:
        a, b = tc.bit_view(prev[name]), tc.bit_view(old[name])
        changed = np.flatnonzero(a != b)
        if changed.size:
            samples.append(_varint_bytes(gaps(changed)))
    dictionary = zstandard.train_dictionary(16384, samples) if len(samples) >= 8 else None
    z3, z19 = zstandard.ZstdCompressor(level=3), zstandard.ZstdCompressor(level=19)
    zd = zstandard.ZstdCompressor(level=3, dict_data=dictionary) if dictionary else z3
    for name, t in new.items():
        fmt = tc.float_format(t.dtype)
        a, b = tc.bit_view(old[name]), tc.bit_view(t)
        changed = np.flatnonzero(a != b)
        if changed.size == 0:
            continue
        moves = _moves_zstd(a, b, changed, 3)
        varint = _varint_bytes(gaps(changed))
        sizes["bitmap_zstd"] += len(z3.compress(np.packbits(a != b).tobytes())) + moves
        sizes["gaps_varint_zstd3"] += len(z3.compress(varint)) + moves
        sizes["gaps_varint_zstd19"] += len(z19.compress(varint)) + _moves_zstd(a, b, changed, 19)
        sizes["gaps_varint_zstd_dict"] += len(zd.compress(varint)) + moves
        planes = np.ascontiguousarray(gaps(changed).astype(np.uint32).view(np.uint8).reshape(-1, 4).T)
        sizes["gaps_u32_planes_zstd"] += len(z3.compress(planes.tobytes())) + moves
        sizes["rice_one_class"] += len(tc.encode_change(a, b, fmt, max_classes=1)[1])
        sizes["ours"] += len(tc.encode_change(a, b, fmt)[1])
    return {f"alt_{k}_ratio": full / v for k, v in sizes.items()}


def swap_pause(model: Qwen3ForCausalLM, versions: Versions, repeats: int) -> dict[str, float]:
    """The engine serves `model`; deltas travel publisher -> filesystem -> subscriber -> engine while
    4 requests decode; the pause is measured inside Engine._apply_swap."""
    model = model.eval()
    engine = Engine(model, max_batch=4, max_seq_len=4096)
    params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)

    def keep_busy() -> None:
        while engine.num_running + engine.num_waiting < 4:
            engine.add_request(list(range(1, 17)), params)

    keep_busy()
    engine.step()
    pauses, stage_s, poll_s = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        transport = FilesystemTransport(tmp)
        publisher = WeightPublisher(transport, snapshot_every=1000)

        def staged(state, version):
            t = time.perf_counter()
            engine.update_weights(state, version)
            stage_s.append(time.perf_counter() - t)

        subscriber = WeightSubscriber(transport, apply=staged)
        publisher.publish(versions[0], 0)
        subscriber.poll()
        engine.step()
        for r in range(repeats):
            publisher.publish(versions[1] if r % 2 == 0 else versions[0], r + 1)  # one real step, either way
            t = time.perf_counter()
            poller = threading.Thread(target=subscriber.poll)  # fetch, decode, verify beside the live weights
            poller.start()
            while poller.is_alive():
                keep_busy()
                engine.step()
            poller.join()
            poll_s.append(time.perf_counter() - t)
            keep_busy()
            engine.step()
            assert engine.version == r + 1 and engine.num_running == 4
            pauses.append(engine.last_swap_pause_ms)
    return {"swap_pause_ms": statistics.median(pauses), "swap_pause_max_ms": max(pauses),
            "stage_ms": 1e3 * statistics.median(stage_s), "poll_ms": 1e3 * statistics.median(poll_s)}


def summarize(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for k in (k for k in pairs[0] if k not in ("blob", "version")):
        values = [p[k] for p in pairs]
        out[k] = statistics.median_low(values) if isinstance(values[0], int) else statistics.median(values)
    return out


def measure_versions(versions: Versions) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Medians over every consecutive pair of `versions` that differs, the codecs of the last delta,
    and the per-pair figures (index i: versions[i - 1] -> versions[i])."""
    pairs = []
    for i, (old, new) in enumerate(zip(versions, versions[1:]), start=1):
        if any(not np.array_equal(tc.bit_view(old[n]), tc.bit_view(t)) for n, t in new.items()):
            pairs.append({"version": i, **measure_pair(old, new, i)})
    if not pairs:
        raise ValueError("no two consecutive versions differ: nothing to measure")
    out = summarize(pairs)
    codecs: dict[str, int] = {}
    for entry in read_header(pairs[-1]["blob"]).tensors:
        codecs[tc.CODEC_NAMES[entry[3]]] = codecs.get(tc.CODEC_NAMES[entry[3]], 0) + 1
    out["codecs"] = codecs
    return out, [{k: v for k, v in p.items() if k != "blob"} for p in pairs]


def measure_model(config: ModelConfig, tokens: torch.Tensor, warmup: int, measured: int, batch: int,
                  seq: int, lr: float = LR) -> tuple[Qwen3ForCausalLM, Versions, dict[str, Any]]:
    model, versions = train_versions(config, tokens, lr, warmup, measured, batch, seq)
    out, pairs = measure_versions(versions)
    out.update(parameters=model.num_parameters(), lr=lr, warmup_steps=warmup, measured_pairs=len(pairs),
               batch=batch, seq_len=seq)
    return model, versions, out


# ------------------------------------------------------------------------------ real RL steps

def rl_steps(base: Path, recipe: TrainConfig, steps: int, lr: float, run_dir: Path) -> dict[str, Any]:
    """`steps` synchronous RL steps of our trainer from `base` at `lr`; every consecutive pair of
    versions measured in bf16 and fp32, and the delta files its publisher wrote."""
    config = recipe.model_copy(update={
        "run_dir": run_dir, "steps": steps, "max_staleness": 0, "max_minutes": None,
        "checkpoint_keep": steps + 1, "rl": recipe.rl.model_copy(update={"lr": lr})})
    threads = torch.get_num_threads()
    try:
        summary = train(config, show_progress=False)
    finally:
        torch.set_num_threads(threads)  # train() sets the trainer's thread count for the process
    assert summary["version"] == steps, summary["version"]
    checkpoints = [base] + [run_dir / "checkpoints" / f"v-{v:07d}" for v in range(1, steps + 1)]
    fp32 = [{n: p.detach() for n, p in load_checkpoint(c, dtype=torch.float32).model.named_parameters()}
            for c in checkpoints]
    transport = FilesystemTransport(run_dir / "weights")
    shipped = decode(transport.fetch(0, "snapshot"))
    delta_bytes = []
    for v, tensors in enumerate(fp32):
        if v:
            shipped = decode(transport.fetch(v, "delta"), shipped)
            delta_bytes.append(transport.blob_path(v, "delta").stat().st_size)
        assert shipped.digests == WeightState.of(tensors, v).digests, f"version {v}: published != checkpoint"
    bf16, bf16_pairs = measure_versions([{n: t.to(torch.bfloat16) for n, t in s.items()} for s in fp32])
    full, full_pairs = measure_versions(fp32)
    bytes_full = shipped.nbytes
    return {
        "base_checkpoint": str(base), "parameters": sum(t.numel() for t in fp32[0].values()), "lr": lr,
        "steps": steps, "group_size": config.rl.group_size, "groups_per_step": config.rl.groups_per_step,
        "train_minutes": summary["minutes"],
        "reward_mean": [m["train/reward_mean"] for m in summary["history"]],
        "unchanged_versions": sorted(set(range(1, steps + 1)) - {p["version"] for p in full_pairs}),
        "bf16": {**bf16, "pairs": bf16_pairs},
        "fp32": {**full, "pairs": full_pairs},
        "published_bytes_full": bytes_full,
        "published_bytes_snapshot": transport.blob_path(0, "snapshot").stat().st_size,
        "published_bytes_delta": delta_bytes,
        "published_ratio": statistics.median(bytes_full / b for b in delta_bytes),
    }


def rl_section(quick: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-delta-") as tmp:
        base, recipe = base_and_recipe(quick, Path(tmp))
        if quick:  # the smoke base never passes a task: malformed tool calls give the groups a signal
            recipe = recipe.model_copy(update={"rl": recipe.rl.model_copy(update={
                "group_size": 4, "malformed_penalty": 0.5})})
        steps = QUICK_RL_STEPS if quick else RL_STEPS
        out = {"rl_steps": rl_steps(base, recipe, steps, recipe.rl.lr, Path(tmp) / "train")}
        if not quick:
            out["rl_steps_low_lr"] = rl_steps(base, recipe, steps, LR, Path(tmp) / "train-low-lr")
    return out


SWEEP_KEYS = ("lr", "changed_fraction", "ratio", "ratio_int32_bf16", "ratio_xor_zstd", "entropy_bound_ratio",
              "entropy_bound_ratio_exponent", "fraction_of_entropy_bound")


def run(quick: bool = False) -> dict[str, Any]:
    tokens = token_stream()
    metrics: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    # (a) the default model: cheap, so a longer warm-up, a few pairs, and the lr sweep
    _, versions, default = measure_model(default_config(), tokens, warmup=3 if quick else 30,
                                         measured=1 if quick else 3, batch=8, seq=128)
    metrics.update({f"default_{k}": v for k, v in default.items()})
    if len(versions) >= 3:
        metrics.update({f"default_{k}": v for k, v in alternatives(*versions[-3:]).items()})
    sweep = [{k: default[k] for k in SWEEP_KEYS}]
    for lr in [] if quick else [3e-7, 3e-6, 1e-5]:
        _, _, s = measure_model(default_config(), tokens, warmup=30, measured=1, batch=8, seq=128, lr=lr)
        sweep.append({k: s[k] for k in SWEEP_KEYS})
    metrics["default_lr_sweep"] = sorted(sweep, key=lambda row: row["lr"])
    # (b) the ~100M model: the headline figures
    config = ModelConfig(**(QUICK_BIG if quick else BIG))
    model, versions, big = measure_model(config, tokens, warmup=1 if quick else 6, measured=2 if quick else 3,
                                         batch=4, seq=64 if quick else 128)
    metrics.update(big)
    metrics.update(alternatives(*versions[-3:]))
    metrics.update(swap_pause(model, versions, repeats=3 if quick else 5))
    # (c) real steps of our RL trainer
    metrics.update(rl_section(quick))
    return metrics
