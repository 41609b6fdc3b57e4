"""Grading: the agent's files with pristine tests, in a fresh sandbox, never tests the agent touched.

The grading workspace is the agent's final workspace minus every file named like a test the task
ships, plus the task's pristine visible tests and (unless asked not to) its hidden tests. A task
passes when every one of those tests passes and at least one ran.

`GradeCache` wraps the grading runner so that identical grading workspaces run once: a fresh sandbox with
pristine tests makes the verdict a function of the files (for tests that depend neither on the clock nor
on unseeded randomness, as the synthetic tasks' do not), and at T = 1 a small policy
often writes the very same solution several times in one GRPO group (13 distinct final workspaces in 32
episodes of one measured batch). Concurrent requests for the same files wait for the first; a run that
timed out is never reused.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
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


class GradeCache:
    """A TestRunner that runs each distinct (files, tests, timeout) once and replays the report; thread-safe.

    Keeps the last `max_entries` reports. `runs` and `hits` count what it did.
    """

    def __init__(self, runner: TestRunner, max_entries: int = 4096) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.runner, self.max_entries = runner, max_entries
        self._reports: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.runs = self.hits = 0

    def run_tests(self, files: Mapping[str, str | bytes], test_files: Sequence[str], *,
                  timeout_s: float | None = None) -> TestReportLike:
        key = _content_key(files, test_files, timeout_s)
        with self._lock:
            pending = self._reports.get(key)
            if pending is None:
                pending = self._reports[key] = Future()
                while len(self._reports) > self.max_entries:
                    self._reports.popitem(last=False)
                self.runs += 1
                owner = True
            else:
                self._reports.move_to_end(key)
                self.hits += 1
                owner = False
        if not owner:
            try:
                report = pending.result()  # the owner always resolves it (its runner's timeout)
                if not getattr(report, "timed_out", False):
                    return report
            except Exception:
                pass  # the owner's run failed: this request runs on its own
            return self.runner.run_tests(files, test_files, timeout_s=timeout_s)
        try:
            report = self.runner.run_tests(files, test_files, timeout_s=timeout_s)
        except BaseException as e:
            with self._lock:
                self._reports.pop(key, None)
            pending.set_exception(e)
            raise
        pending.set_result(report)
        if getattr(report, "timed_out", False):
            with self._lock:
                if self._reports.get(key) is pending:
                    del self._reports[key]
        return report


def _content_key(files: Mapping[str, str | bytes], test_files: Sequence[str], timeout_s: float | None) -> str:
    h = hashlib.sha256(repr((sorted(test_files), timeout_s)).encode())
    for path in sorted(files):
        content = files[path]
        data = content.encode() if isinstance(content, str) else bytes(content)
        h.update(b"%d:%s\0%d:" % (len(path.encode()), path.encode(), len(data)))
        h.update(data)
    return h.hexdigest()
