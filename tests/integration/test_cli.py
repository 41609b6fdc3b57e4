"""The `rtrl` command as a user runs it: a subprocess, real files, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

RTRL = [sys.executable, "-m", "realtime_rl.cli"]


def run(*args, timeout=300):
    return subprocess.run([*RTRL, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path):
    proc = run("demo", "--set", f'run_dir="{tmp_path}"', "--set", "train_tasks=24", "--set", "pretrain_steps=6",
               "--set", "eval_tasks=2", "--set", "max_turns=2", "--set", "max_new_tokens=48")
    assert proc.returncode == 0, proc.stderr
    assert "what ran" in proc.stdout and "Not yet" in proc.stdout
    m = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["metrics"]
    assert m["tasks/heldout"] == 2 and m["pretrain/documents"] == 24
    assert 0.0 <= m["agent/pass_at_1"] <= 1.0 and m["agent/tokens"] > 0
    assert m["rl/max_abs_logprob_diff_replay"] < 1e-4
    assert m["serve/swap_pause_ms"] > 0
    assert (tmp_path / "pretrain" / "checkpoints" / "step-0000006" / "model.safetensors").is_file()


@pytest.mark.slow
def test_bench_parity_writes_json(tmp_path):
    pytest.importorskip("transformers", reason="transformers is a dev dependency")
    out = tmp_path / "parity.json"
    proc = run("bench", "parity", "--json", str(out), "--quick")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["name"] == "parity" and "torch" in result["env"]
    m = result["metrics"]
    assert m["dense_max_abs_diff"] <= 1e-4 and m["moe_max_abs_diff"] <= 1e-4
    assert m["hf_loads_ours"] is True and m["we_load_hf"] is True


@pytest.mark.parametrize("args, message", [
    (["demo", "--set", "model.num_experts=-1"], "model.num_experts"),
    (["demo", "--config", "missing.toml"], "config file not found"),
    (["demo", "--set", "oops"], "key=value"),
])
def test_bad_input_exits_nonzero_with_one_line(args, message):
    proc = run(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("rtrl: error:")


def test_unknown_benchmark_is_refused():
    proc = run("bench", "nope")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


@pytest.mark.slow
def test_bench_mismatch_meets_the_replay_target_on_cpu_fp32(tmp_path):
    out = tmp_path / "mismatch.json"
    proc = run("bench", "mismatch", "--quick", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    m = json.loads(out.read_text())["metrics"]
    assert m["dtype"] == "float32" and m["tokens"] > 0
    assert m["k3_kl_replay"] <= 1e-6 and m["routing_disagreement_replay"] == 0.0
    assert m["max_abs_logprob_diff_replay"] < 1e-4
