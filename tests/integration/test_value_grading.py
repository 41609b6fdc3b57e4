"""Grading by value: synthetic tasks are graded by calling the solution in the sandbox and comparing what it
returned on the host, where the expected values stay. The verdict and counts are the test run's for honest code
(and for code that crashes, exits or returns near misses), and a solution that forges the report of a test run,
which passes a test run, does not pass grading."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from realtime_rl.environments import load_task, load_tasks
from realtime_rl.environments.grading import grade, grading_files, solution_files
from realtime_rl.environments.sandbox import Sandbox, probe_isolation
from realtime_rl.environments.sandbox.inside import encode_value
from realtime_rl.environments.synthetic import generate_tasks


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    try:
        probe_isolation("auto")
    except RuntimeError as e:
        pytest.skip(f"no sandbox tier can run here: {e}")
    return Sandbox()


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    for d in (1, 2, 3):
        generate_tasks(root / f"d{d}", 2, split="heldout", seed=0, difficulty=d)
    return [t for d in (1, 2, 3) for t in load_tasks(root / f"d{d}")]


def counts(result):
    return result.passed, result.tests_passed, result.tests_failed, result.errors


def by_test_run(task):
    return dataclasses.replace(task, cases_file=None)


def test_grading_by_value_agrees_with_the_test_run(tasks, sandbox):
    """Reference, stub and every novice variant of tasks of difficulty 1-3, then solutions that fail to import,
    exit, raise SystemExit, return floats or tuples or print a lot: the same verdict and counts both ways."""
    for task in tasks:
        assert task.value_cases() is not None
        variants = [solution_files(task, "reference"), solution_files(task, "stub")]
        variants += [task.workspace() | {task.solution_files[0]: task.read(rel)} for rel in task.novice_files]
        got = [counts(grade(task, files, sandbox)) for files in variants]
        assert got == [counts(grade(by_test_run(task), files, sandbox)) for files in variants], task.task_id
        assert got[0][0] and not any(g[0] for g in got[1:])
    task = tasks[0]
    fn, reference = task.value_cases().function, task.read(task.example_files[0])
    wrap = f"{reference}\n_reference = {fn}\n\n\ndef {fn}(x):\n    result = _reference(x)\n"
    odd = {
        "syntax error": "def broken(:\n",
        "exit at import": "import sys\nsys.exit(0)\n",
        "os._exit at import": "import os\nos._exit(0)\n",
        "SystemExit in the call": f"import sys\n\n\ndef {fn}(x):\n    sys.exit(0)\n",
        "floats": wrap + "    return [float(v) for v in result] if isinstance(result, list) else float(result)\n",
        "a tuple": wrap + "    return tuple(result) if isinstance(result, list) else result\n",
        "prints a lot and mutates its input": wrap + "    print('x' * 100000)\n    x.clear()\n    return result\n",
    }
    for name, source in odd.items():
        files = task.workspace() | {task.solution_files[0]: source}
        assert counts(grade(task, files, sandbox)) == counts(grade(by_test_run(task), files, sandbox)), name


FORGE = '''
import json, os, struct


def _forge(report):
    data = json.dumps(report).encode()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:") and int(fd) > 2:
                os.write(int(fd), struct.pack(">Q", len(data)) + data)
        except OSError:
            pass
    os._exit(0)
'''


def test_a_forged_test_report_passes_a_test_run_but_not_grading_by_value(tasks, sandbox):
    """The known limit of a test run (tests and solution share a process): a solution that writes the counts
    of a passing run to the report pipe and exits passes it. Graded by value, the same forgery passes nothing,
    and one that finds the inputs of the calls and answers the visible cases from the visible test file (which
    the agent sees) still fails every hidden case."""
    task = tasks[3]
    module = task.solution_files[0]
    forged_counts = FORGE + '\n_forge({"passed": 12, "failed": 0, "errors": 0, "skipped": 0, "exit_code": 0})\n'
    files = task.workspace() | {module: forged_counts}
    grading, test_files = grading_files(task, files)
    assert sandbox.run_tests(grading, test_files).ok  # the gap the test run has
    assert grade(by_test_run(task), files, sandbox).passed
    assert not grade(task, files, sandbox).passed

    cases = task.value_cases()
    visible = {json.dumps(c.input): encode_value(c.expected, 64) for c in cases.cases if c.test_file in task.test_files}
    fallback = encode_value(cases.cases[0].expected, 64)
    answers = FORGE + f'''
import sys
_visible = {visible!r}


def {cases.function}(x):
    frame = sys._getframe(1)
    while "inputs" not in frame.f_locals:
        frame = frame.f_back
    _forge({{"results": [["value", _visible.get(text, {fallback!r})] for text in frame.f_locals["inputs"]]}})
'''
    result = grade(task, task.workspace() | {module: answers}, sandbox)
    hidden = len(cases.cases) - len(visible)
    assert not result.passed and result.tests_passed < len(cases.cases) and hidden > 0
    assert result.tests_passed >= len(visible)  # the forgery did reach the host: it is the hidden cases that fail

    nested = FORGE.replace("data = json.dumps(report).encode()", "data = report") + (
        '\n_forge(b"[" * 200000 + b"]" * 200000)\n')  # json.loads raises RecursionError on the host
    files = task.workspace() | {module: nested}
    for graded in (grade(task, files, sandbox), grade(by_test_run(task), files, sandbox)):
        assert not graded.passed and graded.tests_passed == 0


def test_a_runner_answering_fewer_calls_than_cases_passes_nothing():
    """grade_values does not trust a runner's count: one right answer for two cases is no answer."""
    from realtime_rl.environments.grading import grade_values
    from realtime_rl.environments.sandbox import CallReport, IsolationLevel, RunResult
    from realtime_rl.environments.tasks import ValueCase, ValueCases

    cases = ValueCases("m", "f", (ValueCase("m_test.py", "a", 1, 2), ValueCase("m_test.py", "b", 2, 99)))
    run = RunResult(0, "", "", False, False, 0.1, IsolationLevel.FULL, "test")
    two = ["int", 2]
    result = grade_values("t", cases, CallReport([("value", two)], None, "", run, False))
    assert not result.passed and result.tests_passed == 0
    both = grade_values("t", cases, CallReport([("value", two), ("value", two)], None, "", run, False))
    assert not both.passed and (both.tests_passed, both.tests_failed) == (1, 1)


def test_a_cases_file_is_checked_when_the_task_loads(tasks, tmp_path):
    """It must be one path under .meta/ (it holds the hidden tests' expected values), name a solution module and
    cover exactly the task's test files."""
    task_dir = shutil.copytree(tasks[0].path, tmp_path / "task")
    config_path = task_dir / ".meta" / "config.json"
    config = json.loads(config_path.read_text())
    cases = json.loads((task_dir / config["files"]["cases"]).read_text())
    (task_dir / "cases.json").write_text(json.dumps(cases))
    config_path.write_text(json.dumps({**config, "files": {**config["files"], "cases": "cases.json"}}))
    with pytest.raises(ValueError, match="under .meta/"):
        load_task(task_dir)
    config_path.write_text(json.dumps({**config, "files": {**config["files"], "cases": [config["files"]["cases"]]}}))
    with pytest.raises(ValueError, match="one path"):
        load_task(task_dir)
    config_path.write_text(json.dumps(config))
    for broken, match in [({**cases, "module": "other"}, "not a solution file"),
                          ({**cases, "tests": {**cases["tests"], "extra_test.py": []}}, "not the task's tests"),
                          ({**cases, "tests": {k: v for k, v in cases["tests"].items() if ".meta/" not in k}},
                           "not a cases file for this task")]:
        (task_dir / ".meta" / "cases.json").write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=match):
            load_task(task_dir)
