"""`rtrl pretrain`: continued pre-training of the default base model on generated agent episodes.

    result = pretrain(PretrainConfig())      # runs/pretrain/checkpoints/step-000250, ..., final

One loop, top to bottom: build (or load the cached) tokenizer and corpus; build the model; for each
step sample a batch (deterministically from the step number, so a resumed run sees exactly the batches
an uninterrupted one would), masked next-token loss on the policy's tokens, AdamW with warmup and
cosine decay, gradient clipping; checkpoint every `checkpoint_every` steps as a Hugging Face directory
plus `trainer_state.pt` (optimizer, step), written to a temporary name and renamed.

Not here: RL (rl.py), data parallelism, mixed precision on CPU.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from realtime_rl.config import PretrainConfig, SandboxConfig
from realtime_rl.environments import WarmPool
from realtime_rl.model import Qwen3ForCausalLM, Tokenizer, load_checkpoint, save_checkpoint
from realtime_rl.monitor import ConsoleSink, JsonlSink, MultiSink
from realtime_rl.train.corpus import Document, build_documents, synthetic_tasks, tokenizer_texts


def _corpus_key(config: PretrainConfig) -> str:
    fields = {k: getattr(config, k) for k in ("seed", "num_tasks", "max_difficulty", "expert_fraction", "fix_rate")}
    fields["tokenizer"] = config.tokenizer.model_dump()
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def prepare_corpus(config: PretrainConfig) -> tuple[Tokenizer, list[Document]]:
    """Tokenizer + documents, cached under run_dir/corpus-<hash of the corpus settings>."""
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
    with tempfile.TemporaryDirectory() as tmp:
        tasks = list(synthetic_tasks(Path(tmp), config.num_tasks, config.max_difficulty, config.seed))
        tokenizer = Tokenizer.train(tokenizer_texts(tasks, rng), vocab_size=config.tokenizer.vocab_size)
        with WarmPool(SandboxConfig(pool_size=2)) as pool:
            docs = build_documents(tasks, tokenizer, pool, config.expert_fraction, config.fix_rate, config.seed)
    staging = Path(tempfile.mkdtemp(dir=config.run_dir, prefix=".corpus-"))
    tokenizer.save(staging)
    lengths = np.array([len(d.token_ids) for d in docs])
    np.savez(staging / "docs.npz", tokens=np.concatenate([d.token_ids for d in docs]),
             mask=np.concatenate([d.loss_mask for d in docs]), expert=np.array([d.expert for d in docs]),
             offsets=np.concatenate([[0], np.cumsum(lengths)]))
    os.replace(staging, cache)
    return tokenizer, docs


def lr_at(step: int, config: PretrainConfig) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


def batch_for_step(docs: list[Document], step: int, batch_size: int, seed: int, pad_id: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, T], loss mask [B, T]) for a step: a function of (seed, step) only, so resumes replay it."""
    rng = np.random.default_rng([seed, step])
    picks = rng.choice(len(docs), size=batch_size, replace=len(docs) < batch_size)
    T = max(len(docs[i].token_ids) for i in picks)
    ids = torch.full((batch_size, T), pad_id, dtype=torch.long)
    mask = torch.zeros((batch_size, T), dtype=torch.bool)
    for b, i in enumerate(picks):
        n = len(docs[i].token_ids)
        ids[b, :n] = torch.from_numpy(docs[i].token_ids.astype(np.int64))
        mask[b, :n] = torch.from_numpy(docs[i].loss_mask)
    return ids, mask


def masked_next_token_loss(model: Qwen3ForCausalLM, ids_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting each masked token from its prefix."""
    logits = model(ids_BT[:, :-1]).logits_BTV
    target, keep = ids_BT[:, 1:], mask_BT[:, 1:]
    return F.cross_entropy(logits[keep].float(), target[keep])


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = sorted((run_dir / "checkpoints").glob("step-*"))
    return ckpts[-1] if ckpts else None


def _save(run_dir: Path, step: int, model: Qwen3ForCausalLM, tokenizer: Tokenizer,
          optimizer: torch.optim.Optimizer) -> Path:
    final = run_dir / "checkpoints" / f"step-{step:07d}"
    staging = Path(tempfile.mkdtemp(dir=run_dir, prefix=".ckpt-"))
    save_checkpoint(staging, model, tokenizer)
    torch.save({"step": step, "optimizer": optimizer.state_dict()}, staging / "trainer_state.pt")
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    return final


def pretrain(config: PretrainConfig, show_progress: bool = True) -> dict[str, Any]:
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if config.threads:
        torch.set_num_threads(config.threads)
    t_start = time.perf_counter()
    tokenizer, docs = prepare_corpus(config)
    corpus_s = time.perf_counter() - t_start

    start_step = 0
    resume_from = latest_checkpoint(run_dir) if config.resume else None
    if resume_from is not None:
        model = load_checkpoint(resume_from, dtype=torch.float32).model
        state = torch.load(resume_from / "trainer_state.pt", weights_only=True)
        start_step = state["step"]
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
    if resume_from is not None:
        optimizer.load_state_dict(state["optimizer"])

    sink = MultiSink(JsonlSink(run_dir / "metrics.jsonl"), *([ConsoleSink()] if not show_progress else []))
    last: dict[str, Any] = {}
    columns = (TextColumn("pretrain"), BarColumn(), TextColumn("{task.completed}/{task.total} {task.fields[info]}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, disable=not show_progress) as progress:
        bar = progress.add_task("pretrain", total=config.steps, completed=start_step, info="")
        window_tokens, window_t0 = 0, time.perf_counter()
        for step in range(start_step, config.steps):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, config)
            ids, mask = batch_for_step(docs, step, config.batch_size, config.seed, tokenizer.pad_token_id)
            loss = masked_next_token_loss(model, ids, mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            window_tokens += ids.numel()
            if (step + 1) % config.log_every == 0 or step + 1 == config.steps:
                elapsed = time.perf_counter() - window_t0
                last = {"pretrain/loss": loss.item(), "pretrain/grad_norm": grad_norm.item(),
                        "pretrain/lr": lr_at(step, config), "pretrain/tokens_per_s": window_tokens / elapsed}
                sink.log(last, step + 1)
                progress.update(bar, info=f"loss {loss.item():.3f}")
                window_tokens, window_t0 = 0, time.perf_counter()
            if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps:
                _save(run_dir, step + 1, model, tokenizer, optimizer)
            progress.update(bar, completed=step + 1)
    sink.close()
    final = latest_checkpoint(run_dir)
    return {"checkpoint": str(final), "steps": config.steps, "documents": len(docs),
            "corpus_s": corpus_s, "minutes": (time.perf_counter() - t_start) / 60, **last}
