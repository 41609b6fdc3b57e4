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
