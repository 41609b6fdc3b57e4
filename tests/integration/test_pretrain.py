"""Continued pre-training: the loss falls on a tiny budget, and a run killed with SIGKILL resumes
from its last checkpoint to exactly the weights of an uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from realtime_rl.config import ModelConfig, PretrainConfig, TokenizerTrainConfig
from realtime_rl.train import pretrain, prepare_corpus
from realtime_rl.train.pretrain import batch_for_step, masked_next_token_loss

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")]

TINY_MODEL = ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32, tie_word_embeddings=False)


def tiny(run_dir, **overrides) -> PretrainConfig:
    base = dict(run_dir=run_dir, num_tasks=40, steps=12, batch_size=4, warmup_steps=2, log_every=3,
                checkpoint_every=3, model=TINY_MODEL, tokenizer=TokenizerTrainConfig(vocab_size=1024), threads=1)
    return PretrainConfig(**{**base, **overrides})


def test_corpus_is_real_episodes_with_assistant_masks(tmp_path):
    tokenizer, docs = prepare_corpus(tiny(tmp_path))
    assert len(docs) == 40 and {d.expert for d in docs} == {True, False}
    text = tokenizer.decode(docs[0].token_ids.tolist())
    assert text.startswith("<|im_start|>system") and "<tool_response>" in text
    masked = tokenizer.decode(docs[0].token_ids[docs[0].loss_mask].tolist())
    assert '"name": "write_file"' in masked and "<tool_response>" not in masked
    # Cached: a second call reads the same corpus back.
    _, again = prepare_corpus(tiny(tmp_path))
    assert all((a.token_ids == b.token_ids).all() for a, b in zip(docs, again))


def test_loss_falls(tmp_path):
    config = tiny(tmp_path, steps=30, lr=5e-3)
    tokenizer, docs = prepare_corpus(config)
    result = pretrain(config, show_progress=False)
    from realtime_rl.model import load_checkpoint

    trained = load_checkpoint(result["checkpoint"]).model
    fresh = load_checkpoint(result["checkpoint"]).model
    fresh.reset_parameters(seed=0)
    ids, mask = batch_for_step(docs, 10_000, 8, seed=1, pad_id=tokenizer.pad_token_id)
    with torch.no_grad():
        assert masked_next_token_loss(trained, ids, mask) < 0.7 * masked_next_token_loss(fresh, ids, mask)


def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    long = dict(steps=24, checkpoint_every=4, log_every=4)  # the kill lands long before the end
    pretrain(tiny(whole, **long), show_progress=False)
    # Test-run observations carry timings ("passed in 0.01s"), so two corpus builds can differ by a
    # token; a resumed run reads its cached corpus, so the second run starts from the same cache.
    killed.mkdir()
    for corpus in whole.glob("corpus-*"):
        shutil.copytree(corpus, killed / corpus.name)

    cmd = [sys.executable, "-m", "realtime_rl.cli", "pretrain"]
    for k, v in tiny(killed, **long).model_dump(mode="json").items():
        if isinstance(v, dict):
            cmd += [arg for kk, vv in v.items() if vv is not None for arg in ("--set", f"{k}.{kk}={json.dumps(vv)}")]
        elif v is not None:
            cmd += ["--set", f"{k}={json.dumps(v)}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (killed / "checkpoints" / "step-0000004").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert not (killed / "checkpoints" / "step-0000024").exists(), "the run finished before the kill"
    pretrain(tiny(killed, **long), show_progress=False)  # resumes from its newest checkpoint

    a = load_file(whole / "checkpoints" / "step-0000024" / "model.safetensors")
    b = load_file(killed / "checkpoints" / "step-0000024" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
