"""The agent's tools over a workspace: every failure is an observation, never an exception."""

from __future__ import annotations

import json

import pytest

from realtime_rl.environments.tools import TOOL_SCHEMAS, Tools, Workspace


def tools(files=None):
    return Tools(Workspace(files or {"a.py": "x = 1\ny = 2\nx = 1\n", "pkg/b.py": "print('b')\n"}), ["a_test.py"], None)


def call(t, name, **args):
    return t.call(name, json.dumps(args))


def test_schemas_are_openai_function_definitions():
    names = [s["function"]["name"] for s in TOOL_SCHEMAS]
    assert names == ["list_files", "read_file", "write_file", "edit_file", "run_tests", "ask_user", "submit"]
    for s in TOOL_SCHEMAS:
        assert s["type"] == "function" and s["function"]["parameters"]["type"] == "object"


def test_list_and_read():
    t = tools()
    assert call(t, "list_files").content == "a.py (3 lines)\npkg/b.py (1 lines)"
    assert call(t, "read_file", path="a.py").content == "x = 1\ny = 2\nx = 1\n"
    assert call(t, "read_file", path="./a.py", start_line=2, end_line=3).content == "y = 2\nx = 1\n"
    assert call(t, "read_file", path="a.py", start_line=3).content == "x = 1\n"


@pytest.mark.parametrize("args, fragment", [
    (dict(path="nope.py"), "no such file"),
    (dict(path="../etc/passwd"), "stay inside"),
    (dict(path="/etc/passwd"), "stay inside"),
    (dict(path="a.py", start_line=0), "bad line range"),
    (dict(path="a.py", start_line=3, end_line=2), "bad line range"),
])
def test_read_errors_are_observations(args, fragment):
    out = call(tools(), "read_file", **args)
    assert out.error and fragment in out.content


def test_write_and_edit():
    t = tools()
    assert not call(t, "write_file", path="new/c.py", content="def f():\n    return 1\n").error
    assert t.workspace.files["new/c.py"].startswith("def f")
    assert not call(t, "edit_file", path="new/c.py", old="return 1", new="return 2").error
    assert "return 2" in t.workspace.files["new/c.py"]


@pytest.mark.parametrize("path", ["notes\\x.txt", "a\x00.py"])
def test_a_path_the_sandbox_could_not_write_is_refused_and_never_enters_the_workspace(path):
    t = tools()
    out = call(t, "write_file", path=path, content="x = 1\n")
    assert out.error and "POSIX path" in out.content
    assert sorted(t.workspace.files) == ["a.py", "pkg/b.py"]


@pytest.mark.parametrize("path, other", [("a.py/x", "a.py"), ("pkg", "pkg/b.py"), ("pkg/b.py/c/d", "pkg/b.py")])
def test_a_file_at_or_under_another_file_is_refused(path, other):
    """The sandbox cannot create a file under a file, nor a file where a directory is: once in the workspace,
    every later test run and the grading failed, and no tool could delete it."""
    t = tools()
    out = call(t, "write_file", path=path, content="1")
    assert out.error and f"the file {other} cannot both exist" in out.content
    assert sorted(t.workspace.files) == ["a.py", "pkg/b.py"]


def test_a_name_longer_than_the_file_system_takes_is_refused():
    t = tools()
    out = call(t, "write_file", path="d/" + "n" * 256, content="1")
    assert out.error and "longer than 255 bytes" in out.content and sorted(t.workspace.files) == ["a.py", "pkg/b.py"]
    assert not call(t, "write_file", path="n" * 255, content="1").error


def test_a_test_run_reads_the_same_whatever_its_wall_time():
    """pytest's summary line carries the run's seconds: the same run read differently to a seeded policy."""
    class Runner:
        def __init__(self, seconds):
            self.seconds = seconds

        def run_tests(self, files, test_files, timeout_s=None):
            output = f"F.\nFAILED a_test.py::test_x - assert 1 in 2\n1 failed, 1 passed in {self.seconds}\n"
            return type("Report", (), dict(ok=False, passed=1, failed=1, errors=0, output=output))()

    fast, slow = (Tools(Workspace({"a.py": ""}), ["a_test.py"], Runner(s)).call("run_tests", "{}").content
                  for s in ("0.02s", "13.71s (0:00:13)"))
    assert fast == slow and fast.endswith("1 failed, 1 passed") and "assert 1 in 2" in fast


def test_edit_fails_clearly_when_absent_or_ambiguous():
    t = tools()
    absent = call(t, "edit_file", path="a.py", old="z = 3", new="z = 4")
    assert absent.error and "not found" in absent.content
    ambiguous = call(t, "edit_file", path="a.py", old="x = 1", new="x = 5")
    assert ambiguous.error and "occurs 2 times" in ambiguous.content
    assert t.workspace.files["a.py"] == "x = 1\ny = 2\nx = 1\n"  # nothing changed


def test_edits_cannot_grow_a_file_past_the_size_write_file_allows():
    from realtime_rl.environments.tools import MAX_FILE_BYTES

    t = tools()
    assert not call(t, "write_file", path="big.py", content="x" * (MAX_FILE_BYTES - 10) + "\nEND\n").error
    out = call(t, "edit_file", path="big.py", old="END", new="y" * 100)
    assert out.error and f"larger than {MAX_FILE_BYTES} bytes" in out.content
    assert t.workspace.files["big.py"].endswith("\nEND\n")  # nothing changed


def test_wrong_argument_names_and_missing_runner_are_observations():
    t = tools()
    out = call(t, "write_file", path="a.py", text="oops")
    assert out.error and "bad arguments" in out.content
    out = call(t, "run_tests")
    assert out.error and "no test runner" in out.content


def test_ending_tools():
    assert call(tools(), "submit").ends_episode
    asked = call(tools(), "ask_user", question="Which file?")
    assert asked.ends_episode and asked.question == "Which file?"


def test_output_is_truncated_for_the_model():
    t = Tools(Workspace({"big.txt": "x" * 10_000}), [], None, max_output_chars=100)
    out = call(t, "read_file", path="big.txt").content
    assert len(out) < 200 and "more characters" in out
