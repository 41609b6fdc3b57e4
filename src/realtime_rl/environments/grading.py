"""Grading: the agent's files with pristine tests, in a fresh sandbox, never tests the agent touched.

The grading workspace is the agent's final workspace minus every file named like a test the task
ships, plus the task's pristine visible tests and (unless asked not to) its hidden tests. A task
passes when every one of those tests passes and at least one ran.

A task whose tests are also data (`Task.value_cases`: every synthetic task) is graded by value instead: the
sandbox imports the solution and calls its function on each test's input, and the host compares what came
back with the expected values, which never enter the sandbox. Tests and solution share one process in a test
run, so code under test can forge the run's report (sandbox/__init__.py); by value, forging still needs every
hidden answer (in the FULL tier: the WEAK tier without a separate uid can read the host's task directory). The
verdict is the test run's for honest code (the same calls in the same order, Python's `==` on the returned value,
rebuilt on the host from tagged JSON by `decode_value`: no code and no parser of Python runs on the host), except
code that tests an input with `is` (a test file's literal may be interned, a decoded input is not) or returns a
type other than the builtins that equals the expected value (a Fraction, a Decimal).

`GradeCache` wraps the grading runner so that identical grading workspaces run once: a fresh sandbox with
pristine tests makes the verdict a function of the files (for tests that depend neither on the clock nor
on unseeded randomness, as the synthetic tasks' do not), and at T = 1 a small policy
often writes the very same solution several times in one GRPO group (13 distinct final workspaces in 32
episodes of one measured batch). Concurrent requests for the same files wait for the first; a run that
timed out is never reused.
"""

from __future__ import annotations

import binascii
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from realtime_rl.config.components import MAX_WALL_S
from realtime_rl.environments.sandbox.results import CallReport
from realtime_rl.environments.sandbox.sandbox import MAX_VALUE_DEPTH
from realtime_rl.environments.tasks import Task, ValueCases
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
    """Grade `files` (e.g. an agent's final workspace) against the task's pristine tests: by value where the
    task has its tests as data (then `sandbox` must have `run_calls`: Sandbox, GradeCache), else a test run."""
    cases = task.value_cases(include_hidden)
    if cases is not None:
        test_names = {*task.test_files, *(Path(rel).name for rel in task.hidden_test_files)}
        workspace = {path: content for path, content in files.items() if path not in test_names}  # no expected value
        report = calls_of(sandbox)(workspace, cases.module, cases.function,
                                   [json.dumps(case.input) for case in cases.cases], timeout_s=timeout_s)
        return grade_values(task.task_id, cases, report)
    grading, test_files = grading_files(task, files, include_hidden)
    tests: TestReportLike = sandbox.run_tests(grading, test_files, timeout_s=timeout_s)
    return GradeResult(task.task_id, bool(tests.ok), tests.passed, tests.failed, tests.errors, tests.output,
                       bool(getattr(tests, "timed_out", False)))


def calls_of(runner: object) -> Callable[..., CallReport]:
    """The runner's run_calls (Sandbox, GradeCache around one); a WarmPool has none and never grades."""
    run_calls = getattr(runner, "run_calls", None)
    if run_calls is None:
        raise TypeError(f"grading by value needs a runner with run_calls (a Sandbox, or a GradeCache around one), "
                        f"got {type(runner).__name__}")
    return run_calls


def grade_settled(task: Task, files: Mapping[str, str], sandbox: TestRunner, include_hidden: bool = True,
                  timeout_s: float | None = None) -> GradeResult:
    """`grade`, once more if it timed out: a run starved by a loaded machine must not count as a failed solution
    (trained as one, or cached in an evaluation later candidates are compared with); one that loops times out
    twice. A GradeCache keeps no timed-out run, so the second is a run."""
    result = grade(task, files, sandbox, include_hidden, timeout_s)
    return grade(task, files, sandbox, include_hidden, timeout_s) if result.timed_out else result


def grade_values(task_id: str, cases: ValueCases, report: CallReport) -> GradeResult:
    """Compare what each call returned with its expected value, counting as a test run would: a call that
    raised or returned another value fails its test; a function that cannot be imported is an error per test
    file (pytest's collection error); a run that answered nothing (a crash, an exit, a timeout) counts nothing, and
    so does an answer that is not one per call (a runner that is not Sandbox's)."""
    if report.results is not None and len(report.results) != len(cases.cases):
        report = replace(report, results=None, import_error=None)
    if report.results is None:
        if report.import_error is not None:
            files = len({case.test_file for case in cases.cases})
            why = f"cannot import {cases.function} from {cases.module}: {report.import_error}"
            return GradeResult(task_id, False, 0, 0, files, f"ERROR {why}\n" + report.output, False)
        why = ("timed out" if report.timed_out else
               f"ended (exit status {report.run.exit_code}) without a readable answer for every call")
        return GradeResult(task_id, False, 0, 0, 0, f"[grading] the run {why}\n" + report.output,
                           report.timed_out)
    passed = failed = 0
    lines = []
    for case, (kind, payload) in zip(cases.cases, report.results):
        value = decode_value(payload) if kind == "value" else NOT_A_VALUE
        if value is not NOT_A_VALUE and value == case.expected:
            passed += 1
            continue
        failed += 1
        got = (f"raised {payload}" if kind == "error" else "returned a malformed value" if value is NOT_A_VALUE
               else f"returned {repr(value)[:200]}")
        lines.append(f"FAILED {case.test_file}::{case.name}: {cases.function}({case.input!r}) {got}, "
                     f"expected {case.expected!r}")
    lines.append(f"{passed} passed, {failed} failed (graded by value)")
    return GradeResult(task_id, failed == 0 and passed >= 1, passed, failed, 0, "\n".join(lines) + "\n" + report.output,
                       False)


NOT_A_VALUE = object()
"""What a malformed tagged value decodes to: equal to no expected value."""
_TYPES = {"bool": bool, "int": int, "float": float, "str": str}
_COLLECTIONS: dict[str, Callable[[list], Any]] = {"tuple": tuple, "list": list, "set": set, "frozenset": frozenset}


def decode_value(node: Any) -> Any:
    """Rebuild a returned value from its tagged JSON (sandbox/inside.py, encode_value); NOT_A_VALUE when the
    node is malformed (the code under test can write the report)."""
    try:
        return _decode(node, 0)
    except (ValueError, TypeError, KeyError, IndexError, RecursionError, binascii.Error):
        return NOT_A_VALUE


def _decode(node: Any, depth: int) -> Any:
    if depth > MAX_VALUE_DEPTH or not (isinstance(node, list) and len(node) == 2 and isinstance(node[0], str)):
        raise ValueError("not a tagged value")
    kind, payload = node
    if kind == "none" and payload is None:
        return None
    if kind in _TYPES and type(payload) is _TYPES[kind]:
        return payload
    if kind in _COLLECTIONS and isinstance(payload, list):
        return _COLLECTIONS[kind]([_decode(item, depth + 1) for item in payload])
    if kind == "dict" and isinstance(payload, list):
        return {_decode(k, depth + 1): _decode(v, depth + 1) for k, v in payload}
    if kind == "complex" and isinstance(payload, list) and len(payload) == 2:
        return complex(float(payload[0]), float(payload[1]))
    if kind == "bytes" and isinstance(payload, str):
        return binascii.a2b_base64(payload)
    raise ValueError(f"not a tagged value: {kind!r}")


def solution_files(task: Task, which: str) -> dict[str, str]:
    """The task's workspace with the reference solution ("reference") or the untouched stubs ("stub")."""
    files = task.workspace()
    if which == "reference":
        files.update(task.reference_solution())
    elif which != "stub":
        raise ValueError(f"solutions must be 'reference' or 'stub', got {which!r}")
    return files


DEFAULT_WAIT_S = MAX_WALL_S
"""How long a request waits for an identical one in flight with no timeout of its own (the sandbox's wall_s
bounds that run, and is at most this)."""
WAIT_MARGIN_S = 30.0


class GradeCache:
    """A TestRunner that runs each distinct (files, tests, timeout) or (files, calls, timeout) once and replays the
    report; thread-safe. `run_calls` needs a runner that has it.

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
        return self._once(_content_key(files, ("tests", sorted(test_files), timeout_s)),
                          lambda: self.runner.run_tests(files, test_files, timeout_s=timeout_s), timeout_s)

    def run_calls(self, files: Mapping[str, str | bytes], module: str, function: str, inputs: Sequence[str], *,
                  timeout_s: float | None = None) -> CallReport:
        run_calls = calls_of(self.runner)
        return self._once(_content_key(files, ("calls", module, function, list(inputs), timeout_s)),
                          lambda: run_calls(files, module, function, inputs, timeout_s=timeout_s), timeout_s)

    def _once(self, key: str, run: Callable[[], Any], timeout_s: float | None) -> Any:
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
            try:  # the owner resolves it within its runner's timeout; this bound is for a runner that does not
                report = pending.result(timeout=(timeout_s or DEFAULT_WAIT_S) + WAIT_MARGIN_S)
                if not getattr(report, "timed_out", False):
                    return report
            except Exception:
                pass  # the owner's run failed or never ended: this request runs on its own
            return run()
        try:
            report = run()
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


def _content_key(files: Mapping[str, str | bytes], what: tuple) -> str:
    h = hashlib.sha256(repr(what).encode())
    for path in sorted(files):
        content = files[path]
        data = content.encode() if isinstance(content, str) else bytes(content)
        h.update(b"%d:%s\0%d:" % (len(path.encode()), path.encode(), len(data)))
        h.update(data)
    return h.hexdigest()
