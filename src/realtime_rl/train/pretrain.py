"""`rtrl pretrain`: continued pre-training of the default base model on generated agent episodes.

    result = pretrain(PretrainConfig())      # runs/pretrain/checkpoints/step-0000250, ..., final
    path = ensure_base_model(config)          # the final checkpoint, trained only if not built yet

One loop, top to bottom: build (or load the cached) tokenizer and corpus; build the model; for each
step sample a batch (deterministically from the step number, so a resumed run sees exactly the batches
an uninterrupted one would), masked next-token loss on the policy's tokens, AdamW with warmup and
cosine decay, gradient clipping; checkpoint every `checkpoint_every` steps as a Hugging Face directory
plus `trainer_state.pt` (optimizer, step) and `pretrain.json` (the config and its hash), written to a
temporary name and renamed.

Every document starts with the same system prompt and tool schemas (~700 tokens, most of an episode).
Each step computes that shared prefix's keys and values once, without gradient, and runs the batch's
suffixes on top of it (model/shared_prefix.py): the suffixes' logits are exactly those of the full
sequences, the prefix just passes no gradient (it carries no task information, so there is nothing in
it to learn to read differently). The LM head runs only where a token is trained. The suffixes are
sorted by length and cut where padding would cost more than another micro-batch (`micro_batches`: at most
MICRO_BATCH_TOKENS each, padded to its own longest), so little compute goes to padding.

Data parallel on the CPU cores (`processes`, one per CPU by default; train/data_parallel.py): each process takes a
`share` of the step's documents (about as many tokens each), computes their gradient, and the processes sum the
gradients before each takes the same AdamW step from the same state. Process 0 logs and checkpoints; the others
start from its weights and end with the run.

Not here: RL (rl.py), mixed precision on CPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from realtime_rl.config import PretrainConfig
from realtime_rl.model import Qwen3ForCausalLM, Tokenizer, load_checkpoint, save_checkpoint
from realtime_rl.model.checkpoint import numbered_checkpoints, publish_directory
from realtime_rl.model.shared_prefix import SharedPrefix
from realtime_rl.monitor import ConsoleSink, JsonlSink, MultiSink
from realtime_rl.train.corpus import (
    CORPUS_FORMAT, CorpusWorkers, Document, build_documents, build_followup_documents, build_write_documents,
    make_tasks, shared_prefix_length, task_picks, tokenizer_texts,
)
from realtime_rl.train.data_parallel import process_group, remove_stale_groups, same_start, share, sum_gradients
from realtime_rl.train.run_dir import remove_staging, run_dir_lock
from realtime_rl.train.packing import cheapest_cut
from realtime_rl.train.schedule import warmup_cosine

MICRO_BATCH_TOKENS = 4096
"""A step's batch, sorted by length, is cut into micro-batches of at most this many (padded) tokens."""
MICRO_BATCH_OVERHEAD_TOKENS = 150
"""What one more micro-batch is taken to cost, in padded tokens. On the default recipe's steps (2 CPU cores) any
value from 48 to 400 cut the forward and backward by 10-13% against cutting only at MICRO_BATCH_TOKENS (24%
padding); 100-250 were best and alike (benchmarks/BENCHMARKS.md, pretrain)."""
TOKENIZER_TASKS = 2000
"""Tasks whose rendered episodes train the tokenizer (more add no merges worth having)."""
CORPUS_FIELDS = ("seed", "num_tasks", "episode_fraction", "max_difficulty", "expert_fraction", "episode_expert_fraction",
                 "fix_rate", "question_fraction", "followup_fraction", "tokenizer", "reserve_structures",
                 "difficulty_weights", "exclude_heldout_parts")
RUN_ONLY_FIELDS = {"run_dir", "resume", "threads", "processes", "log_every", "checkpoint_every"}
"""Fields that do not change the weights a run ends with (threads and processes: up to the order of float sums)."""
MAX_AUTO_PROCESSES = 4
MAX_NONFINITE_STEPS = 10
"""Steps in a row with a non-finite gradient (each skipped) after which pre-training stops as diverged."""
logger = logging.getLogger(__name__)
"""`processes = None` runs one process per CPU, at most this many (a step's 16 documents, 4 each)."""
LATER_FIELDS = {"reserve_structures": False, "difficulty_weights": None, "exclude_heldout_parts": False}
"""Fields added after bases were cached, with the value that builds what came before them: hashed only at
another value, so those bases and corpora keep their hashes."""


def _hash(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _hashed_fields(config: PretrainConfig) -> dict[str, Any]:
    """The config as hashed: LATER_FIELDS left out at their earlier value."""
    return {k: v for k, v in config.model_dump(mode="json").items() if k not in LATER_FIELDS or v != LATER_FIELDS[k]}


def _corpus_key(config: PretrainConfig) -> str:
    fields = {k: v for k, v in _hashed_fields(config).items() if k in CORPUS_FIELDS}
    return _hash({**fields, "format": CORPUS_FORMAT})


def config_hash(config: PretrainConfig) -> str:
    """Identifies the model a config builds: every field except where and how verbosely it runs (and
    the corpus format)."""
    fields = {k: v for k, v in _hashed_fields(config).items() if k not in RUN_ONLY_FIELDS}
    return _hash({**fields, "corpus_format": CORPUS_FORMAT})


def prepare_corpus(config: PretrainConfig, processes: int = 1) -> tuple[Tokenizer, list[Document]]:
    """Tokenizer + documents (episodes, then first-turn, then follow-up documents), cached under
    run_dir/corpus-<hash of the corpus settings>; built in `processes` processes, the same for any number."""
    Path(config.run_dir).mkdir(parents=True, exist_ok=True)
    cache = Path(config.run_dir) / f"corpus-{_corpus_key(config)}"
    if (cache / "docs.npz").is_file() and (cache / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_dir(cache)
        data = np.load(cache / "docs.npz")
        docs = [Document(t, m, bool(e)) for t, m, e in zip(
            np.split(data["tokens"], data["offsets"][1:-1]), np.split(data["mask"], data["offsets"][1:-1]),
            data["expert"])]
        return tokenizer, docs
    rng = random.Random(config.seed)
    with CorpusWorkers(processes) as workers:
        picks = list(task_picks(config.num_tasks, config.max_difficulty, config.seed,
                                reserve_structures=config.reserve_structures,
                                difficulty_weights=config.difficulty_weights,
                                exclude_heldout_parts=config.exclude_heldout_parts))
        tasks = workers.map(make_tasks, picks, config.seed)
        episodes = max(1, round(config.episode_fraction * len(tasks))) if config.episode_fraction > 0 else 0
        tokenizer = Tokenizer.train(tokenizer_texts(tasks[:TOKENIZER_TASKS], rng),
                                    vocab_size=config.tokenizer.vocab_size)
        docs = build_documents(tasks[:episodes], tokenizer, config.episode_expert_fraction, config.fix_rate,
                               config.seed, workers)
        docs += build_write_documents(tasks[episodes:], tokenizer, config.expert_fraction, config.seed + 1,
                                      config.question_fraction, workers)
    followups = round(config.followup_fraction * (len(tasks) - episodes))
    docs += build_followup_documents(tasks[episodes:episodes + followups], tokenizer, config.seed + 2,
                                     config.question_fraction)
    staging = Path(tempfile.mkdtemp(dir=config.run_dir, prefix=".corpus-"))
    tokenizer.save(staging)
    lengths = np.array([len(d.token_ids) for d in docs])
    np.savez(staging / "docs.npz", tokens=np.concatenate([d.token_ids for d in docs]),
             mask=np.concatenate([d.loss_mask for d in docs]), expert=np.array([d.expert for d in docs]),
             offsets=np.concatenate([[0], np.cumsum(lengths)]))
    os.replace(staging, cache)
    return tokenizer, docs


def lr_at(step: int, config: PretrainConfig) -> float:
    decay_steps = config.steps - config.warmup_steps
    return warmup_cosine(step, config.lr, config.warmup_steps, decay_steps, config.min_lr_ratio)


def step_documents(docs: list[Document], step: int, batch_size: int, seed: int) -> list[int]:
    """The indices of a step's documents, shortest first: a function of (seed, step) only, so resumes replay it."""
    rng = np.random.default_rng([seed, step])
    picks = rng.choice(len(docs), size=batch_size, replace=len(docs) < batch_size)
    return sorted(picks.tolist(), key=lambda i: (len(docs[i].token_ids), i))


def batch_for_step(docs: list[Document], step: int, batch_size: int, seed: int, pad_id: int, prefix_len: int = 0,
                   rank: int = 0, world: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Micro-batches (ids [b, T], loss mask [b, T]) of the documents' tokens after `prefix_len`, for a step; of
    process `rank` of `world`, its `share` of them."""
    picks = step_documents(docs, step, batch_size, seed)
    if world > 1:
        owner = share([len(docs[i].token_ids) for i in picks], world)  # prefix included: each row's attention reads it
        picks = [i for i, r in zip(picks, owner) if r == rank]
    lengths = [len(docs[i].token_ids) - prefix_len for i in picks]
    chunks = [picks[a:b] for a, b in micro_batches(lengths)]
    out = []
    for chunk in chunks:
        T = max(len(docs[i].token_ids) for i in chunk) - prefix_len
        ids = torch.full((len(chunk), T), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), T), dtype=torch.bool)
        for b, i in enumerate(chunk):
            n = len(docs[i].token_ids) - prefix_len
            ids[b, :n] = torch.from_numpy(docs[i].token_ids[prefix_len:].astype(np.int64))
            mask[b, :n] = torch.from_numpy(docs[i].loss_mask[prefix_len:])
        out.append((ids, mask))
    return out


def micro_batches(lengths: list[int]) -> list[tuple[int, int]]:
    """A step's rows of ascending `lengths` cut into micro-batches [a, b): padding against
    MICRO_BATCH_OVERHEAD_TOKENS a micro-batch, at most MICRO_BATCH_TOKENS each unless one row."""
    return cheapest_cut(lengths, MICRO_BATCH_OVERHEAD_TOKENS, MICRO_BATCH_TOKENS)


@torch.no_grad()
def prefix_cache(model: Qwen3ForCausalLM, prefix_ids: torch.Tensor) -> SharedPrefix | None:
    """Keys and values of the shared prefix (one row, no gradient); None for an empty prefix."""
    if not len(prefix_ids):
        return None
    prefix = SharedPrefix()
    model.hidden_states(prefix_ids[None], shared_prefix=prefix)
    return prefix


def masked_next_token_loss(model: Qwen3ForCausalLM, ids_BT: torch.Tensor, mask_BT: torch.Tensor,
                           prefix: SharedPrefix | None = None, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of predicting each masked token from everything before it, the prefix included
    (mean, or sum for accumulating micro-batches)."""
    B, T = ids_BT.shape
    positions = None
    if prefix is not None:
        P = prefix.length or 0
        positions = torch.arange(P, P + T - 1).expand(B, T - 1)
    hidden_BTC, _ = model.hidden_states(ids_BT[:, :-1], positions, shared_prefix=prefix)
    target, keep = ids_BT[:, 1:], mask_BT[:, 1:]
    return F.cross_entropy(model.lm_head(hidden_BTC[keep]).float(), target[keep], reduction=reduction)


def latest_checkpoint(run_dir: Path, built_by: str | None = None) -> Path | None:
    """The newest checkpoint under run_dir; with built_by, the newest that a config of that hash built (a run
    started over with resume=false leaves the checkpoints of the config before it beside its own)."""
    ckpts = numbered_checkpoints(Path(run_dir) / "checkpoints", "step-")
    if built_by is not None:
        ckpts = [c for c in ckpts if _built_by(c) == built_by]
    return ckpts[-1] if ckpts else None


def _save(run_dir: Path, step: int, model: Qwen3ForCausalLM, tokenizer: Tokenizer,
          optimizer: torch.optim.Optimizer, config: PretrainConfig) -> Path:
    final = run_dir / "checkpoints" / f"step-{step:07d}"
    staging = Path(tempfile.mkdtemp(dir=run_dir, prefix=".ckpt-"))
    save_checkpoint(staging, model, tokenizer)
    torch.save({"step": step, "optimizer": optimizer.state_dict()}, staging / "trainer_state.pt")
    (staging / "pretrain.json").write_text(json.dumps(
        {"config_hash": config_hash(config), "step": step, "config": config.model_dump(mode="json")}, indent=2))
    return publish_directory(staging, final)


def _built_by(checkpoint: Path) -> str | None:
    meta = checkpoint / "pretrain.json"
    return json.loads(meta.read_text())["config_hash"] if meta.is_file() else None


def processes_for(config: PretrainConfig) -> tuple[int, int]:
    """(processes, torch threads per process) a run uses: the config's, else one process per CPU this process
    may use (at most MAX_AUTO_PROCESSES and batch_size) sharing them."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    processes = config.processes or max(1, min(cpus, MAX_AUTO_PROCESSES, config.batch_size))
    return processes, config.threads or max(1, cpus // processes)


def _model_and_optimizer(config: PretrainConfig, tokenizer: Tokenizer, resume_from: Path | None
                         ) -> tuple[Qwen3ForCausalLM, torch.optim.Optimizer, int]:
    """The model and AdamW, fresh from the seed or as the checkpoint left them, and the step to start at."""
    if resume_from is not None:
        model = load_checkpoint(resume_from, dtype=torch.float32).model
    else:
        torch.manual_seed(config.seed)
        vocab = -(-tokenizer.vocab_size // 64) * 64
        model = Qwen3ForCausalLM(config.model.model_copy(update={"vocab_size": vocab}))
        model.reset_parameters(seed=config.seed)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=config.lr, betas=(0.9, 0.95))
    if resume_from is None:
        return model, optimizer, 0
    state = torch.load(resume_from / "trainer_state.pt", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    return model, optimizer, state["step"]


def _train(config: PretrainConfig, tokenizer: Tokenizer, docs: list[Document], resume_from: Path | None,
           rank: int = 0, world: int = 1, show_progress: bool = False, t_start: float = 0.0) -> dict[str, Any]:
    """The step loop of process `rank` of `world`: its share of each step's gradient, summed over the processes;
    process 0 logs and checkpoints. Returns the last logged metrics (process 0's)."""
    run_dir = Path(config.run_dir)
    prefix_len = shared_prefix_length(docs, limit=4096)
    prefix_ids = torch.from_numpy(docs[0].token_ids[:prefix_len].astype(np.int64))
    model, optimizer, start_step = _model_and_optimizer(config, tokenizer, resume_from)
    params = list(model.parameters())
    if world > 1:
        same_start(params)
    lead = rank == 0
    sink = MultiSink()
    if lead:
        sink = MultiSink(JsonlSink(run_dir / "metrics.jsonl"), *([ConsoleSink()] if not show_progress else []))
    last: dict[str, Any] = {}
    columns = (TextColumn("pretrain"), BarColumn(), TextColumn("{task.completed}/{task.total} {task.fields[info]}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with contextlib.closing(sink), Progress(*columns, disable=not (show_progress and lead)) as progress:
        bar = progress.add_task("pretrain", total=config.steps, completed=start_step, info="")
        window_steps, window_tokens, window_loss, window_t0 = 0, 0, 0.0, time.perf_counter()
        nonfinite_in_a_row = 0
        for step in range(start_step, config.steps):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, config)
            rows = step_documents(docs, step, config.batch_size, config.seed)
            targets = sum(int(docs[i].loss_mask[prefix_len + 1:].sum()) for i in rows)
            micro = batch_for_step(docs, step, config.batch_size, config.seed, tokenizer.pad_token_id, prefix_len,
                                   rank, world)
            prefix = prefix_cache(model, prefix_ids)
            optimizer.zero_grad(set_to_none=True)
            step_loss = 0.0
            for ids, mask in micro:
                loss = masked_next_token_loss(model, ids, mask, prefix, reduction="sum") / targets
                loss.backward()
                step_loss += loss.item()
            if world > 1:
                step_loss = sum_gradients(params, step_loss)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
            if torch.isfinite(grad_norm):  # the same on every rank: the gradients were summed
                optimizer.step()
                nonfinite_in_a_row = 0
            else:  # one inf or NaN stepped into the weights made every later checkpoint NaN
                nonfinite_in_a_row += 1
                logger.warning("step %d: gradient norm %s; the update is skipped", step + 1, grad_norm.item())
                if nonfinite_in_a_row >= MAX_NONFINITE_STEPS:
                    raise RuntimeError(f"pre-training diverged: {nonfinite_in_a_row} steps in a row had a non-finite "
                                       f"gradient (step {step + 1}); lower lr or check the data")
            window_loss += step_loss
            window_steps += 1
            window_tokens += sum(len(docs[i].token_ids) - prefix_len for i in rows)
            if lead and ((step + 1) % config.log_every == 0 or step + 1 == config.steps):
                elapsed = time.perf_counter() - window_t0
                last = {"pretrain/loss": window_loss / window_steps, "pretrain/grad_norm": grad_norm.item(),
                        "pretrain/lr": lr_at(step, config), "pretrain/tokens_per_s": window_tokens / elapsed,
                        "pretrain/minutes": (time.perf_counter() - t_start) / 60}
                sink.log(last, step + 1)
                progress.update(bar, info=f"loss {last['pretrain/loss']:.3f}")
                window_steps, window_tokens, window_loss, window_t0 = 0, 0, 0.0, time.perf_counter()
            if lead and ((step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps):
                _save(run_dir, step + 1, model, tokenizer, optimizer, config)
            progress.update(bar, completed=step + 1)
    return last


def _process_main(rank: int, world: int, threads: int, config: PretrainConfig, resume_from: Path | None) -> None:
    """A data-parallel process other than 0: reads the cached corpus and trains its shares."""
    torch.set_num_threads(threads)
    tokenizer, docs = prepare_corpus(config)
    _train(config, tokenizer, docs, resume_from, rank, world)


BASE_MODEL_WAIT_S = 3 * 3600.0
"""How long `ensure_base_model` waits for another process building into the same run_dir (the default base
model takes 10-16 minutes on 2 cores; a larger recipe on a slow machine far longer)."""


def pretrain(config: PretrainConfig, show_progress: bool = True) -> dict[str, Any]:
    """Build (or resume) config's model under run_dir; one process at a time per run_dir (ValueError when
    another holds it)."""
    with run_dir_lock(config.run_dir, "`rtrl pretrain`"):
        return _pretrain_locked(config, show_progress)


def _pretrain_locked(config: PretrainConfig, show_progress: bool) -> dict[str, Any]:
    run_dir = Path(config.run_dir)
    remove_stale_groups(run_dir)
    remove_staging(run_dir)  # a checkpoint or corpus that a kill cut short
    world, threads = processes_for(config)
    caller_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _pretrain(config, world, threads, show_progress)
    finally:
        torch.set_num_threads(caller_threads)


def _pretrain(config: PretrainConfig, world: int, threads: int, show_progress: bool) -> dict[str, Any]:
    run_dir = Path(config.run_dir)
    t_start = time.perf_counter()
    resume_from = latest_checkpoint(run_dir, config_hash(config)) if config.resume else None
    if config.resume and resume_from is None and (other := latest_checkpoint(run_dir)) is not None:
        raise ValueError(f"{other} was built from another config (hash {_built_by(other)}, this one is "
                         f"{config_hash(config)}): use another run_dir, or set resume=false to start over")
    tokenizer, docs = prepare_corpus(config, world)  # built and cached here, before the other processes read it
    corpus_s = time.perf_counter() - t_start
    with process_group(run_dir, world, _process_main, (threads, config, resume_from)):
        last = _train(config, tokenizer, docs, resume_from, 0, world, show_progress, t_start)
    final = run_dir / "checkpoints" / f"step-{config.steps:07d}"  # this run's, whatever else run_dir holds
    return {"checkpoint": str(final), "steps": config.steps, "documents": len(docs),
            "prefix_tokens": shared_prefix_length(docs, limit=4096), "processes": world, "threads": threads,
            "corpus_s": corpus_s, "minutes": (time.perf_counter() - t_start) / 60, **last}


def ensure_base_model(config: PretrainConfig, show_progress: bool = True) -> Path:
    """The final checkpoint of `config` under its run_dir: reused when one built from an identical config
    (same config_hash) is there, trained (or resumed) otherwise."""
    final = Path(config.run_dir) / "checkpoints" / f"step-{config.steps:07d}"

    def built() -> bool:
        return final.is_dir() and _built_by(final) == config_hash(config)

    if built():
        return final
    # Another process may be building it (two `rtrl train` runs started together on a fresh machine):
    # wait for it, then use what it built.
    with run_dir_lock(config.run_dir, "`rtrl pretrain`", wait_s=BASE_MODEL_WAIT_S):
        return final if built() else Path(_pretrain_locked(config, show_progress)["checkpoint"])
