"""The `rtrl` command as a user runs it: a subprocess, real files, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

RTRL = [sys.executable, "-m", "realtime_rl.cli"]


def run(*args, timeout=300):
    return subprocess.run([*RTRL, *args], capture_output=True, text=True, timeout=timeout)


def bench_quick(name, tmp_path, *args):
    """`rtrl bench NAME --quick --json PATH [ARGS]`'s JSON, the command having succeeded."""
    out = tmp_path / f"{name}.json"
    proc = run("bench", name, "--quick", "--json", str(out), *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


@pytest.mark.slow
def test_demo_runs_the_real_time_loop_end_to_end(tmp_path):
    """`rtrl demo` at smoke size: a base model, the gateway, simulated users, two cycles of the loop."""
    sets = ['run_dir="{}"'.format(tmp_path), "pretrain.num_tasks=40", "pretrain.steps=4", "pretrain.batch_size=4",
            "pretrain.warmup_steps=1", "pretrain.tokenizer.vocab_size=600", "loop.cycles=2", "loop.cycle_period_s=10",
            "loop.min_trajectories=4", "loop.gate_tasks=4", "loop.canary_tasks=2", "loop.gate.margin=0.5",
            "loop.agent.max_new_tokens=32", "loop.ab.min_completions_per_arm=2", "loop.ab.min_edits_per_arm=1",
            "loop.rewards.persist_window_s=1", "loop.rewards.followup_window_s=0", "loop.rewards.horizon_s=20",
            "users.users=3", "users.max_tokens=32", "users.persist_window_s=1", "users.task_count=6",
            "users.think_time_s=[0.0, 0.2]"]
    proc = run("demo", *[a for s in sets for a in ("--set", s)], timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cycle by cycle" in proc.stdout and "report:" in proc.stdout
    assert "did the agent improve?" in proc.stdout or "no candidate was promoted" in proc.stdout
    cycles = [json.loads(line) for line in (tmp_path / "loop" / "cycles.jsonl").read_text().splitlines()]
    assert [c["cycle"] for c in cycles] == [1, 2] and cycles[0]["rewards"]["new_completions"] > 0
    assert "<svg" in (tmp_path / "loop" / "report.html").read_text() or cycles[0].get("train", {}).get("skipped")
    assert (tmp_path / "serve" / "events.sqlite").is_file()


@pytest.mark.slow
def test_bench_parity_writes_json(tmp_path):
    pytest.importorskip("transformers", reason="transformers is a dev dependency")
    result = bench_quick("parity", tmp_path)
    assert result["name"] == "parity" and "torch" in result["env"]
    m = result["metrics"]
    assert m["dense_max_abs_diff"] <= 1e-4 and m["moe_max_abs_diff"] <= 1e-4
    assert m["hf_loads_ours"] is True and m["we_load_hf"] is True


@pytest.mark.parametrize("args, message", [
    (["demo", "--set", "pretrain.model.num_experts=-1"], "pretrain.model.num_experts"),
    (["loop", "--set", "gate.margin=2"], "gate.margin"),
    (["simulate-users", "--set", "users=0"], "users"),
    (["demo", "--config", "missing.toml"], "config file not found"),
    (["demo", "--set", "oops"], "key=value"),
    (["bench", "parity", "--set", "rl.lr=1e-4"], "runs no RL recipe"),
    (["bench", "learn", "--set", "rl.lr_decay_steps=0"], "rl.lr_decay_steps"),  # before any base model is built
    # users who persist edits for less than the rules' window never keep one: every keep settled censored
    (["demo", "--set", "loop.rewards.persist_window_s=30"], "users.persist_window_s (15 s) is shorter"),
    (["simulate-users", "--set", 'tasks_dir="/etc/hostname"'], "/etc/hostname"),  # an OSError: was a traceback
])
def test_bad_input_exits_nonzero_with_one_line(args, message):
    proc = run(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("rtrl: error:")


def test_parsing_and_config_errors_import_no_torch():
    """`rtrl --help` and a bad config answer without loading torch (seconds of imports)."""
    code = ("import sys; from realtime_rl.cli import main\n"
            "assert main(['pretrain', '--set', 'steps=0']) == 2\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "steps" in proc.stderr


def test_unknown_benchmark_is_refused():
    proc = run("bench", "nope")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


@pytest.mark.slow
def test_bench_mismatch_meets_the_replay_target_on_cpu_fp32(tmp_path):
    m = bench_quick("mismatch", tmp_path)["metrics"]
    assert m["dtype"] == "float32" and m["tokens"] > 0
    assert m["k3_kl_replay"] <= 1e-6 and m["routing_disagreement_replay"] == 0.0
    assert m["max_abs_logprob_diff_replay"] < 1e-4


@pytest.mark.slow
def test_bench_engine_quick_writes_json(tmp_path):
    m = bench_quick("engine", tmp_path)["metrics"]
    rates = ("tokens_per_s", "eager_tokens_per_s_b32", "hf_tokens_per_s", "tokens_per_s_no_capture",
             "sampled_tokens_per_s")
    assert all(m[k] > 0 for k in rates) and m["swap_pause_ms"] > 0 and m["grpo_shared_s"] > 0
    assert m["shared_cascade_ms"] > 0 and m["shared_long_own_ms"] > 0 and m["shared_long_cascade_speedup"] > 0
    assert m["sampling_cost"] < 1 and m["capture_overhead"] < 1 and m["speedup_vs_hf"] > 0


@pytest.mark.slow
def test_bench_engine_in_bf16_measures_both_engines_and_skips_the_fp32_studies(tmp_path, monkeypatch):
    """RTRL_BENCH_DTYPE places both models as rollout.dtype places an engine (RTRL_BENCH_DEVICE likewise)."""
    monkeypatch.setenv("RTRL_BENCH_DTYPE", "bfloat16")
    m = bench_quick("engine", tmp_path)["metrics"]
    assert (m["device"], m["dtype"], m["compiled"]) == ("cpu", "bfloat16", True)
    assert m["tokens_per_s"] > 0 and m["hf_tokens_per_s"] > 0 and m["swap_pause_ms"] > 0
    assert "scattered_window_ms" not in m and "grpo_shared_s" not in m


@pytest.mark.slow
def test_bench_trainer_quick_times_both_steps_on_one_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("RTRL_BENCH_PROFILE", "1")
    result = bench_quick("trainer", tmp_path, "--set", "rl.micro_batch_tokens=100000")
    m = result["metrics"]
    assert result["overrides"] == ["rl.micro_batch_tokens=100000"]
    assert m["ours_micro_batch_tokens"] == 100000 and m["ours_micro_batches"] == 1  # the override took
    for side in ("ours", "trl"):  # one more step of each, profiled (on CPU: no kernel launches to count)
        profile = m[f"{side}_profile"]
        assert profile["aten_ops"] > 100 and profile["kernel_launches"] == 0 and profile["value_reads"] > 0
        assert len(profile["top_self_ms"]) == 15 and all(ms >= 0 for _, _, ms in profile["top_self_ms"])
    assert m["ours_step_s"] > 0 and m["trl_step_s"] > 0 and m["speedup_vs_trl"] == m["trl_step_s"] / m["ours_step_s"]
    assert 0 < m["trained_tokens"] < m["tokens"] <= m["padded_tokens_trl"]
    assert len(m["ours_step_s_all"]) == len(m["trl_step_s_all"]) == m["repeats"] + 1


@pytest.mark.slow
def test_bench_sandbox_quick_writes_json(tmp_path):
    m = bench_quick("sandbox", tmp_path)["metrics"]
    assert m["escapes_contained"] == m["escapes_total"] > 0 and not m["escapes_not_contained"]
    timings = ("cold_p50_ms", "cold_exec_p50_ms", "cold_light_p50_ms", "cold_calls_p50_ms",
               "cold_exec_big_parent_p50_ms", "warm_p50_ms")
    assert all(m[k] > 0 for k in timings) and m["runs_per_s"] > 0
