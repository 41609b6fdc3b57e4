"""Grading that timed out runs once more (a starved run is not a failed solution): evaluate_policy's, and the
rollout workers' (grade_settled), whose episodes train on it."""

from __future__ import annotations

from types import SimpleNamespace

import realtime_rl.environments.grading as grading
import realtime_rl.evaluate.harness as harness
from realtime_rl.config import AgentConfig
from realtime_rl.environments.grading import GradeResult
from realtime_rl.types import Episode


def test_a_grading_that_timed_out_runs_once_more_and_a_second_timeout_stands(monkeypatch):
    tasks = [SimpleNamespace(task_id="starved"), SimpleNamespace(task_id="loops")]
    calls: dict[str, int] = {}

    def grade(task, files, grader, include_hidden, timeout_s):
        calls[task.task_id] = calls.get(task.task_id, 0) + 1
        timed_out = task.task_id == "loops" or calls[task.task_id] == 1
        return GradeResult(task.task_id, not timed_out, int(not timed_out), 0, 0, "", timed_out=timed_out)

    def run_episode(policy, tokenizer, task, runner, agent):
        episode = Episode(f"e-{task.task_id}", task.task_id, [], "submit", 1, 0, 0, 0)
        return SimpleNamespace(episode=episode, workspace=SimpleNamespace(snapshot=dict))

    monkeypatch.setattr(grading, "grade", grade)
    monkeypatch.setattr(harness, "run_episode", run_episode)
    report = harness.evaluate_policy(tasks, lambda i: None, None, None, None, AgentConfig())
    passed = {r.task_id: r.grades[0].passed for r in report.results}
    assert passed == {"starved": True, "loops": False} and calls == {"starved": 2, "loops": 2}


def test_whatever_trains_grades_through_the_settled_grading():
    """Rollout workers, simulated users' edits and the vs-trl reward: none grades once."""
    from realtime_rl.bench import vs_trl
    from realtime_rl.environments.users import session
    from realtime_rl.rollout import worker

    for module in (worker, session, vs_trl):
        assert module.grade_settled is grading.grade_settled and not hasattr(module, "grade"), module.__name__
