"""Grading: the agent's files with pristine tests, in a fresh sandbox, never tests the agent touched.

The grading workspace is the agent's final workspace minus every file named like a test the task
ships, plus the task's pristine visible tests and (unless asked not to) its hidden tests. A task
passes when every one of those tests passes and at least one ran.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from realtime_rl.environments.tasks import Task
from realtime_rl.environments.tools import TestReportLike, TestRunner


@dataclass
class GradeResult:
    task_id: str
    passed: bool
    tests_passed: int
    tests_failed: int
    errors: int
    output: str
    timed_out: bool = False


def grading_files(task: Task, files: Mapping[str, str], include_hidden: bool = True) -> tuple[dict[str, str], list[str]]:
    """(files to put in the sandbox, test files to run)."""
    tests = task.pristine_tests()
    if include_hidden:
        tests.update(task.hidden_tests())
    out = {path: content for path, content in files.items() if path not in tests}
    out.update(tests)
    return out, sorted(tests)


def grade(task: Task, files: Mapping[str, str], sandbox: TestRunner, include_hidden: bool = True,
          timeout_s: float | None = None) -> GradeResult:
    """Grade `files` (e.g. an agent's final workspace) against the task's pristine tests."""
    grading, test_files = grading_files(task, files, include_hidden)
    report: TestReportLike = sandbox.run_tests(grading, test_files, timeout_s=timeout_s)
    return GradeResult(task.task_id, bool(report.ok), report.passed, report.failed, report.errors, report.output,
                       bool(getattr(report, "timed_out", False)))


def solution_files(task: Task, which: str) -> dict[str, str]:
    """The task's workspace with the reference solution ("reference") or the untouched stubs ("stub")."""
    files = task.workspace()
    if which == "reference":
        files.update(task.reference_solution())
    elif which != "stub":
        raise ValueError(f"solutions must be 'reference' or 'stub', got {which!r}")
    return files
