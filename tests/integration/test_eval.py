"""`rtrl eval` grades the real Exercism tasks exactly: every reference passes, every stub fails."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.conftest import EXERCISM

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
    pytest.mark.skipif(not EXERCISM.is_dir(), reason=f"task data not found at {EXERCISM}"),
]


def rtrl_eval(tmp_path, *args):
    out = tmp_path / "eval.json"
    proc = subprocess.run([sys.executable, "-m", "realtime_rl.cli", "eval", "--tasks", str(EXERCISM),
                           "--json", str(out), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def test_every_reference_solution_passes(tmp_path):
    report = rtrl_eval(tmp_path, "--solutions", "reference")
    failing = [t["task_id"] for t in report["per_task"] if t["passed"] != 1]
    assert failing == []
    assert report["tasks"] == 24 and report["passed"] == 24 and report["pass_at_1"] == 1.0
    assert report["failed"] == 0 and report["errors"] == 0


# ledger is Exercism's refactoring exercise: its "stub" is a working, messy implementation, so its
# tests pass as shipped (they do under plain pytest on the host too). Every other stub must fail.
REFACTORING_EXERCISES = {"ledger"}


def test_every_stub_fails(tmp_path):
    report = rtrl_eval(tmp_path, "--solutions", "stub")
    passing = {t["task_id"] for t in report["per_task"] if t["passed"]}
    assert passing == REFACTORING_EXERCISES
    assert report["tasks"] == 24 and report["passed"] == len(REFACTORING_EXERCISES)
    assert report["failed"] + report["errors"] == 24 - len(REFACTORING_EXERCISES)


def test_a_checkpoint_runs_through_the_agent_loop(tmp_path, tokenizer):
    from realtime_rl.model import Qwen3ForCausalLM, save_checkpoint
    from tests.conftest import tiny_config

    model = Qwen3ForCausalLM(tiny_config(moe=True, vocab_size=tokenizer.vocab_size))
    save_checkpoint(tmp_path / "ckpt", model, tokenizer)
    report = rtrl_eval(tmp_path, "--checkpoint", str(tmp_path / "ckpt"), "--samples", "2", "--limit", "2",
                       "--set", "agent.max_turns=2", "--set", "agent.max_new_tokens=16")
    assert report["tasks"] == 2 and report["samples"] == 2
    for task in report["per_task"]:
        assert task["samples"] == 2 and len(task["episodes"]) == 2
        assert all(1 <= e["turns"] <= 2 for e in task["episodes"])
    # An untrained model does not solve Exercism tasks; the harness must not say otherwise.
    assert report["pass_at_1"] == 0.0


def test_synthetic_tasks_grade_exactly(tmp_path):
    """Reference passes (visible + hidden tests), stubs fail, and a novice variant fails through the harness."""
    from realtime_rl.environments import load_tasks
    from realtime_rl.environments.grading import grade
    from realtime_rl.environments.sandbox import Sandbox
    from realtime_rl.environments.synthetic import generate_tasks
    from realtime_rl.evaluate import evaluate_solutions

    generate_tasks(tmp_path / "tasks", 12, split="heldout", seed=0)
    tasks = load_tasks(tmp_path / "tasks")
    sandbox = Sandbox()
    reference = evaluate_solutions(tasks, "reference", sandbox, workers=2).to_json()
    assert reference["passed"] == 12
    stubs = evaluate_solutions(tasks, "stub", sandbox, workers=2).to_json()
    assert stubs["passed"] == 0
    for task in tasks[:4]:
        files = task.workspace() | {task.solution_files[0]: task.read(task.novice_files[0])}
        assert not grade(task, files, sandbox).passed


@pytest.mark.parametrize("runner", ["light", "pytest"])
def test_a_solution_that_skips_the_tests_it_cannot_pass_is_not_graded_as_passing(runner):
    """Skipping (unittest.SkipTest, pytest.skip) is not passing: the reward must not pay a partial solution."""
    from realtime_rl.config import SandboxConfig
    from realtime_rl.environments import load_task
    from realtime_rl.environments.grading import grade
    from realtime_rl.environments.sandbox import Sandbox, WarmPool

    task = load_task(EXERCISM / "two-fer")
    files = task.workspace() | {"two_fer.py": (
        "import unittest\n\n\ndef two_fer(name='you'):\n    if name != 'you':\n"
        "        raise unittest.SkipTest('not handled')\n    return 'One for you, one for me.'\n")}
    result = grade(task, files, Sandbox(SandboxConfig(test_runner=runner)))
    assert not result.passed and result.tests_passed >= 1
    with WarmPool(SandboxConfig(pool_size=1)) as pool:
        report = pool.run_tests(files, list(task.test_files))
    assert not report.ok and report.skipped >= 1


def test_a_task_whose_tests_the_workspace_cannot_hold_is_refused_when_loaded(tmp_path):
    from realtime_rl.environments import load_task

    task_dir = tmp_path / "two-fer"
    shutil.copytree(EXERCISM / "two-fer", task_dir)
    config_path = task_dir / ".meta" / "config.json"
    config = json.loads(config_path.read_text())
    (task_dir / "tests").mkdir()
    (task_dir / "two_fer_test.py").rename(task_dir / "tests" / "two_fer_test.py")
    config_path.write_text(json.dumps(config | {"files": config["files"] | {"test": ["tests/two_fer_test.py"]}}))
    with pytest.raises(ValueError, match="must be top-level files of the task, got tests/two_fer_test.py"):
        load_task(task_dir)
    config_path.write_text(json.dumps(config | {"files": config["files"] | {"test": ["../elsewhere_test.py"]}}))
    with pytest.raises(ValueError, match="outside the task: ../elsewhere_test.py"):
        load_task(task_dir)
    # A hidden test named like the visible one: grading dropped it in by base name, over the visible test.
    (task_dir / "tests" / "two_fer_test.py").rename(task_dir / "two_fer_test.py")
    (task_dir / ".meta" / "two_fer_test.py").write_text("def test_hidden():\n    pass\n")
    config_path.write_text(json.dumps(config | {"files": config["files"] | {"hidden_test": [".meta/two_fer_test.py"]}}))
    with pytest.raises(ValueError, match="hidden tests named like a top-level file of the task: two_fer_test.py"):
        load_task(task_dir)
