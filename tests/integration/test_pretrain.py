"""Continued pre-training: the loss falls on a tiny budget, a run killed with SIGKILL resumes from its
last checkpoint to exactly the weights of an uninterrupted run, ensure_base_model reuses a model built
from the same config, and the held-out eval runs a checkpoint through the agent loop."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from realtime_rl.config import AgentConfig, ModelConfig, PretrainConfig, TokenizerTrainConfig
from realtime_rl.train import pretrain, prepare_corpus
from realtime_rl.train.base_eval import heldout_pass_at_1
from realtime_rl.train.pretrain import batch_for_step, ensure_base_model, masked_next_token_loss

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")]

TINY_MODEL = ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32, tie_word_embeddings=False)


def tiny(run_dir, **overrides) -> PretrainConfig:
    base = dict(run_dir=run_dir, num_tasks=40, steps=12, batch_size=4, warmup_steps=2, log_every=3,
                checkpoint_every=3, model=TINY_MODEL, tokenizer=TokenizerTrainConfig(vocab_size=1024), threads=1,
                processes=1)
    return PretrainConfig(**{**base, **overrides})


def test_corpus_is_real_episodes_with_assistant_masks(tmp_path):
    tokenizer, docs = prepare_corpus(tiny(tmp_path, num_tasks=50, episode_fraction=0.8))
    assert len(docs) == 50 and {d.expert for d in docs} == {True, False}
    text = tokenizer.decode(docs[0].token_ids.tolist())
    assert text.startswith("<|im_start|>system") and "<tool_response>" in text
    masked = tokenizer.decode(docs[0].token_ids[docs[0].loss_mask].tolist())
    assert '"name": "write_file"' in masked and "<tool_response>" not in masked
    assert '"name": "submit"' in masked and '\\"\\"\\"' not in masked  # solutions carry no docstring
    novice_fixed = [d for d in docs[:40] if not d.expert and tokenizer.decode(d.token_ids.tolist()).count("write_file") > 2]
    assert novice_fixed, "some novice episodes fix their bug after the failing test run"
    first_turns = docs[40:]  # the other tasks' documents: the prompt, then one write_file turn
    assert all("<tool_response>" not in tokenizer.decode(d.token_ids.tolist()) for d in first_turns)
    # Cached: a second call reads the same corpus back.
    _, again = prepare_corpus(tiny(tmp_path, num_tasks=50, episode_fraction=0.8))
    assert all((a.token_ids == b.token_ids).all() for a, b in zip(docs, again))


def test_a_corpus_built_in_two_processes_is_the_one_built_in_one(tmp_path):
    one = prepare_corpus(tiny(tmp_path / "one", num_tasks=40, episode_fraction=0.5), processes=1)
    two = prepare_corpus(tiny(tmp_path / "two", num_tasks=40, episode_fraction=0.5), processes=2)
    assert one[0].hf.to_str() == two[0].hf.to_str()
    assert len(one[1]) == len(two[1]) == 40
    for a, b in zip(one[1], two[1], strict=True):
        assert np.array_equal(a.token_ids, b.token_ids) and np.array_equal(a.loss_mask, b.loss_mask)
        assert a.expert == b.expert


def test_loss_falls(tmp_path):
    config = tiny(tmp_path, steps=30, lr=5e-3)
    tokenizer, docs = prepare_corpus(config)
    result = pretrain(config, show_progress=False)
    from realtime_rl.model import load_checkpoint

    trained = load_checkpoint(result["checkpoint"]).model
    fresh = load_checkpoint(result["checkpoint"]).model
    fresh.reset_parameters(seed=0)
    micro = batch_for_step(docs, 10_000, 8, seed=1, pad_id=tokenizer.pad_token_id)
    targets = sum(int(mask[:, 1:].sum()) for _, mask in micro)

    def loss(model):
        return sum(masked_next_token_loss(model, ids, mask, reduction="sum") for ids, mask in micro) / targets

    with torch.no_grad():
        assert loss(trained) < 0.7 * loss(fresh)


def test_a_non_finite_gradient_skips_its_update_and_a_run_of_them_stops_as_diverged(tmp_path, monkeypatch):
    """One inf or NaN gradient stepped into the weights made every later checkpoint NaN (and the default base
    handed to RL with it)."""
    module = importlib.import_module("realtime_rl.train.pretrain")  # the package's `pretrain` is the function

    real, calls = module.masked_next_token_loss, []

    def sometimes_nan(*args, **kwargs):
        calls.append(1)
        loss = real(*args, **kwargs)
        return loss * float("nan") if poisoned(len(calls)) else loss

    monkeypatch.setattr(module, "masked_next_token_loss", sometimes_nan)
    poisoned = lambda n: n in (3, 4)  # noqa: E731 (a step or two in the middle)
    result = pretrain(tiny(tmp_path / "once"), show_progress=False)
    weights = load_file(Path(result["checkpoint"]) / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())
    poisoned = lambda n: True  # noqa: E731
    with pytest.raises(RuntimeError, match="diverged: 10 steps in a row"):
        pretrain(tiny(tmp_path / "always"), show_progress=False)


@pytest.mark.parametrize("processes", [1, 2])
def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path, processes):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    long = dict(steps=24, checkpoint_every=4, log_every=4, processes=processes)  # the kill lands long before the end
    pretrain(tiny(whole, **long), show_progress=False)
    # A corpus build runs real sandboxed tests, whose outcome can hinge on load (a timeout); a resumed
    # run reads its cached corpus, so the second run starts from the same cache.
    killed.mkdir()
    for corpus in whole.glob("corpus-*"):
        shutil.copytree(corpus, killed / corpus.name)

    proc = subprocess.Popen(_cli(tiny(killed, **long)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for(killed / "checkpoints" / "step-0000004", proc)
    workers = _data_parallel_workers(proc.pid)
    assert len(workers) == processes - 1
    os.kill(proc.pid, signal.SIGKILL)  # process 0
    proc.wait(10)
    assert not (killed / "checkpoints" / "step-0000024").exists(), "the run finished before the kill"
    deadline = time.monotonic() + 30
    while any(_running(pid) for pid in workers):  # the others exit with it
        assert time.monotonic() < deadline, "a data-parallel process outlived process 0"
        time.sleep(0.1)
    for cut_short in (".ckpt-x1", ".corpus-x2"):  # what a kill during a save leaves: a whole copy each
        (killed / cut_short).mkdir()
        (killed / cut_short / "model.safetensors").write_bytes(b"\0" * 1024)
    pretrain(tiny(killed, **long), show_progress=False)  # resumes from its newest checkpoint
    assert not list(killed.glob(".group-*")), "the killed run's rendezvous is cleared"
    assert not list(killed.glob(".ckpt-*")) and not list(killed.glob(".corpus-*")), "cut-short saves are removed"

    a = load_file(whole / "checkpoints" / "step-0000024" / "model.safetensors")
    b = load_file(killed / "checkpoints" / "step-0000024" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_data_parallel_process_that_dies_stops_the_run_and_is_named(tmp_path):
    proc = subprocess.Popen(_cli(tiny(tmp_path, steps=5000, checkpoint_every=2, processes=2)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for(tmp_path / "checkpoints" / "step-0000002", proc)
    (worker,) = _data_parallel_workers(proc.pid)
    os.kill(worker, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)  # at its next gradient sum, not at the collective timeout
    assert proc.returncode != 0 and "data-parallel-1 (exit code -9) failed" in err
    assert not (tmp_path / "checkpoints" / "step-0005000").exists()
    assert not list(tmp_path.glob(".group-*"))


def test_two_processes_train_the_weights_one_does(tmp_path):
    """Data parallel: each process's share of a step, gradients summed: one process's run up to float order."""
    one, two = tmp_path / "one", tmp_path / "two"
    steps = dict(steps=6, checkpoint_every=6, log_every=1)
    single = pretrain(tiny(one, **steps), show_progress=False)
    two.mkdir()
    for corpus in one.glob("corpus-*"):  # the same documents (a corpus build runs real, load-sensitive tests)
        shutil.copytree(corpus, two / corpus.name)
    caller_threads = torch.get_num_threads()
    double = pretrain(tiny(two, processes=2, **steps), show_progress=False)
    assert torch.get_num_threads() == caller_threads  # a run's threads=1 is its own
    assert (single["processes"], double["processes"]) == (1, 2)
    assert double["pretrain/loss"] == pytest.approx(single["pretrain/loss"], rel=1e-4)
    a = load_file(one / "checkpoints" / "step-0000006" / "model.safetensors")
    b = load_file(two / "checkpoints" / "step-0000006" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-3, atol=1e-5) for k in a)
    logged = [json.loads(line)["step"] for line in (two / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5, 6]  # process 0 alone logs
    assert not list(two.glob(".group-*")), "the rendezvous file is removed"


def test_ensure_base_model_reuses_a_model_built_from_the_same_config(tmp_path):
    config = tiny(tmp_path, steps=6, checkpoint_every=6)
    first = ensure_base_model(config, show_progress=False)
    assert first == tmp_path / "checkpoints" / "step-0000006"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = ensure_base_model(config.model_copy(update={"log_every": 1, "threads": 2}), show_progress=False)
    assert again == first and (first / "model.safetensors").stat().st_mtime_ns == stamp  # not retrained
    with pytest.raises(ValueError, match="another config"):
        ensure_base_model(config.model_copy(update={"steps": 9}), show_progress=False)
    # Started over (resume=false) with fewer steps: the run's own checkpoint comes back, not the newest one
    # in run_dir (the 6-step model's), and each config then resumes or reuses only its own.
    shorter = config.model_copy(update={"steps": 3, "checkpoint_every": 3, "resume": False})
    assert ensure_base_model(shorter, show_progress=False) == tmp_path / "checkpoints" / "step-0000003"
    resumed = ensure_base_model(shorter.model_copy(update={"resume": True}), show_progress=False)
    assert resumed.name == "step-0000003"
    assert ensure_base_model(config, show_progress=False) == first


def test_a_second_build_into_the_same_run_dir_waits_or_is_refused(tmp_path):
    """Two processes needing the default base model at once (a demo and `rtrl train` on a fresh machine):
    `ensure_base_model` waits for the one building it and uses its model; a second `rtrl pretrain` is refused
    at once. Without the lock the second crashed on the first's corpus (Directory not empty)."""
    config = tiny(tmp_path, steps=8, checkpoint_every=4)
    proc = subprocess.Popen(_cli(config), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for(tmp_path / ".lock", proc)
    time.sleep(0.5)  # the CLI holds the lock from before the corpus build
    assert proc.poll() is None, "the build ended before the second process came"
    with pytest.raises(ValueError, match="in use by another `rtrl pretrain`"):
        pretrain(config, show_progress=False)
    final = ensure_base_model(config, show_progress=False)
    assert proc.wait(60) == 0
    assert final == tmp_path / "checkpoints" / "step-0000008"
    built = json.loads((final / "pretrain.json").read_text())
    assert built["step"] == 8 and len(list(tmp_path.glob("corpus-*"))) == 1


def test_heldout_eval_runs_a_checkpoint_through_the_agent_loop(tmp_path):
    checkpoint = ensure_base_model(tiny(tmp_path, steps=6, checkpoint_every=6), show_progress=False)
    agent = AgentConfig(max_turns=2, max_new_tokens=24, summary_trigger_tokens=3072, max_context_tokens=4096,
                        max_summaries=0)
    report = heldout_pass_at_1(checkpoint, num_tasks=4, max_difficulty=2, agent=agent, concurrency=4)
    assert report["tasks"] == 4 and set(report["by_difficulty"]) == {1, 2}
    kinds = report["by_input_type"]
    assert set(kinds) == {1, 2} and sum(n for d in kinds.values() for _, n in d.values()) == 4
    assert sum(p for d in kinds.values() for p, _ in d.values()) == report["passed"]
    assert sum(report["ended_by"].values()) == 4 and 1 <= report["mean_turns"] <= 2
    assert report["failed_submits"] <= min(report["ended_by"].get("submit", 0), 4 - report["passed"])
    repairs = report["repairs"]
    assert repairs["passed_after_it"] <= repairs["first_test_run_failed"] <= 4
    assert repairs["first_test_run_failed"] == sum(bool(t["test_results"]) and not t["test_results"][0]
                                                   for t in report["per_task"])
    assert 0.0 <= report["ci95"][0] <= report["pass_at_1"] <= report["ci95"][1] <= 1.0
    assert all(t["task_id"].startswith("syn-heldout-") for t in report["per_task"])
    # Each task has its own seed, the same every time: a checkpoint evaluated again plays the same episodes,
    # so a before/after comparison differs only where the weights do.
    assert len({t["seed"] for t in report["per_task"]}) == 4
    again = heldout_pass_at_1(checkpoint, num_tasks=4, max_difficulty=2, agent=agent, concurrency=2)
    assert again["per_task"] == report["per_task"]
    # What each first reply wrote, and the structures behind the tasks.
    assert sum(report["first_write"].values()) == 4
    assert set(report["first_write"]) <= {"reference", "novice", "other", "none"}
    assert sum(report["first_write_failed"].values()) == 4 - report["passed"]
    for t in report["per_task"]:  # each task keeps what it wrote beside its kind, to read where it failed
        assert (t["first_write"] is None) == (t["first_write_kind"] == "none")
    comments = report["stage_comments"]
    assert comments["right"] + comments["none"] + sum(comments["wrong_at_stage"].values()) == 4
    assert comments["none"] == report["first_write"].get("none", 0)
    assert comments["right_passed"] <= comments["right"]
    assert comments["right"] >= report["first_write"].get("reference", 0)  # the reference's are right
    assert sum(n for _, n in report["by_structure"].values()) == 4
    assert sum(p for p, _ in report["by_structure"].values()) == report["passed"]
    assert report["structures"] == len(report["by_structure"]) and 0 <= report["structure_mean_pass_at_1"] <= 1
    assert all(t["structure"] in report["by_structure"] for t in report["per_task"])


def _cli(config: PretrainConfig) -> list[str]:
    """`rtrl pretrain` with every field of config set on the command line."""
    cmd = [sys.executable, "-m", "realtime_rl.cli", "pretrain"]
    for k, v in config.model_dump(mode="json").items():
        if isinstance(v, dict):
            cmd += [arg for kk, vv in v.items() if vv is not None for arg in ("--set", f"{k}.{kk}={json.dumps(vv)}")]
        elif v is not None:
            cmd += ["--set", f"{k}={json.dumps(v)}"]
    return cmd


def _wait_for(path, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, f"{path.name} did not appear"
        time.sleep(0.05)


def _data_parallel_workers(pid: int) -> list[int]:
    """The spawned data-parallel processes of process `pid` (not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if not children.exists():
        pytest.skip("this kernel lists no child processes in /proc")
    kids = [int(k) for k in children.read_text().split()]
    return [k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
