"""The agent's tools, with OpenAI function-calling schemas, over an in-memory workspace.

    list_files()                                    every file with its line count
    read_file(path, start_line?, end_line?)         a file, or an inclusive 1-based line range of it
    write_file(path, content)                       create or replace a file
    edit_file(path, old, new)                       replace the one exact occurrence of `old`
    run_tests()                                     the visible tests, in the sandbox, on the workspace as it is
    ask_user(question)                              a clarifying question: ends the turn, control goes to the user
    submit()                                        the work is done: ends the episode

The workspace lives on the host as a dict of text files; code only ever runs in the sandbox, which
receives a copy. Tool failures (missing file, ambiguous edit, bad path) come back as an error
observation for the model, never as an exception. Grading is not a tool: it runs pristine tests in a
fresh sandbox after the episode (see grading.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Protocol

MAX_FILE_BYTES = 256 * 1024
MAX_FILES = 200
NAME_MAX = 255
"""The longest file or directory name Linux file systems take, in bytes."""
PYTEST_TIME = re.compile(r"^(=* ?(?:no tests ran|\d+ (?:passed|failed|errors?|skipped|x?failed|xpassed|warnings?|"
                         r"deselected)\b[^\n]*?)) in \d+(?:\.\d+)?s(?: \(\d+:\d\d:\d\d\))?(?=(?: =+)?$)", re.MULTILINE)
"""pytest's summary line's wall time ("3 failed in 0.02s", "== 1 passed in 61.20s (0:01:01) ==")."""


class TestReportLike(Protocol):
    passed: int
    failed: int
    errors: int
    ok: bool
    output: str


class TestRunner(Protocol):
    """What run_tests needs: the sandbox's Sandbox or WarmPool satisfy it. Grading a task with value cases also
    needs `run_calls` (Sandbox, GradeCache): grading.grade says so when it is missing."""

    def run_tests(self, files: Mapping[str, str | bytes], test_files: Sequence[str], *,
                  timeout_s: float | None = None) -> TestReportLike: ...


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


TOOL_SCHEMAS: list[dict[str, Any]] = [
    _fn("list_files", "List the files of the workspace.", {}, []),
    _fn("read_file", "Read a file, optionally only lines start_line..end_line (1-based, inclusive).", {
        "path": {"type": "string"}, "start_line": {"type": "integer"}, "end_line": {"type": "integer"}}, ["path"]),
    _fn("write_file", "Create or overwrite a file with the given content.", {
        "path": {"type": "string"}, "content": {"type": "string"}}, ["path", "content"]),
    _fn("edit_file", "Replace the single exact occurrence of `old` in a file with `new`.", {
        "path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}}, ["path", "old", "new"]),
    _fn("run_tests", "Run the visible tests against the workspace and show the results.", {}, []),
    _fn("ask_user", "Ask the user a clarifying question and wait for the answer.", {
        "question": {"type": "string"}}, ["question"]),
    _fn("submit", "Submit the work; the episode ends.", {}, []),
]
EDIT_TOOLS = frozenset({"write_file", "edit_file"})
"""The tools that change the user's code: what users accept, keep or revert."""
INSPECT_TOOLS = frozenset({"list_files", "read_file", "run_tests"})
"""Tools that look at the workspace and change nothing: an agent's harness runs them and asks for the next turn."""
QUESTION_TOOL = "ask_user"


@dataclass
class ToolOutcome:
    content: str
    """The observation shown to the model."""
    error: bool = False
    """The call was well-formed but failed (counted as a tool error in the episode)."""
    ends_episode: bool = False
    question: str | None = None
    tests_passed: bool | None = None
    """The verdict of a run_tests call that ran; None for every other call."""


class Workspace:
    """Text files by relative POSIX path. Paths are normalized; absolute paths, `..`, backslashes and NUL are
    refused (the sandbox could not write them: one in the workspace would break every later test run)."""

    def __init__(self, files: Mapping[str, str] | None = None) -> None:
        self.files: dict[str, str] = {}
        for path, content in (files or {}).items():
            self.files[self.normalize(path)] = content

    @staticmethod
    def normalize(path: str) -> str:
        if not isinstance(path, str) or not path.strip():
            raise ValueError("path must be a non-empty string")
        if "\\" in path or "\0" in path:  # what the sandbox refuses to write must not enter the workspace
            raise ValueError(f"path {path!r} must be a POSIX path: no backslash or NUL")
        p = PurePosixPath(path.strip())
        if p.is_absolute() or ".." in p.parts:
            raise ValueError(f"path {path!r} must be relative to the workspace and stay inside it")
        parts = [x for x in p.parts if x != "."]
        if not parts:
            raise ValueError(f"path {path!r} names the workspace itself, not a file")
        if any(len(x.encode()) > NAME_MAX for x in parts):
            raise ValueError(f"path {path!r} has a name longer than {NAME_MAX} bytes")
        return "/".join(parts)

    def clash(self, path: str) -> str | None:
        """The file that keeps a file at `path` (normalized) from being written: one at a parent of it
        (`a.py` for `a.py/x`), or one below it (`src/a.py` for `src`); None if there is none."""
        parents = ["/".join(path.split("/")[:i]) for i in range(1, path.count("/") + 1)]
        return next((p for p in parents if p in self.files), None) or next(
            (f for f in self.files if f.startswith(path + "/")), None)

    def snapshot(self) -> dict[str, str]:
        return dict(self.files)


class Tools:
    """Executes parsed tool calls against one workspace."""

    def __init__(self, workspace: Workspace, test_files: Sequence[str], runner: TestRunner | None,
                 test_timeout_s: float | None = None, max_output_chars: int = 4000) -> None:
        self.workspace = workspace
        self.test_files = list(test_files)
        self.runner = runner
        self.test_timeout_s = test_timeout_s
        self.max_output_chars = max_output_chars
        self.test_results: list[bool] = []
        """Whether each test run passed, in order."""

    @property
    def test_runs(self) -> int:
        return len(self.test_results)

    def call(self, name: str, arguments_json: str) -> ToolOutcome:
        args = json.loads(arguments_json)  # the parser produced it: always a JSON object
        method = getattr(self, f"_tool_{name}", None)
        if method is None:
            return ToolOutcome(f"error: unknown tool {name!r}", error=True)
        try:
            return method(**args)
        except TypeError as e:  # wrong or missing argument names, when no schema check caught them
            return ToolOutcome(f"error: bad arguments for {name}: {e}", error=True)
        except ValueError as e:
            return ToolOutcome(f"error: {e}", error=True)

    # Each tool: arguments as in TOOL_SCHEMAS.

    def _tool_list_files(self) -> ToolOutcome:
        lines = [f"{p} ({c.count(chr(10)) + (1 if c and not c.endswith(chr(10)) else 0)} lines)"
                 for p, c in sorted(self.workspace.files.items())]
        return ToolOutcome("\n".join(lines) or "(no files)")

    def _tool_read_file(self, path: str, start_line: int | None = None, end_line: int | None = None) -> ToolOutcome:
        path = self.workspace.normalize(path)
        if path not in self.workspace.files:
            return ToolOutcome(f"error: no such file: {path}", error=True)
        lines = self.workspace.files[path].splitlines(keepends=True)
        if start_line is None and end_line is None:
            return ToolOutcome(self._clip("".join(lines)))
        start = 1 if start_line is None else start_line
        end = len(lines) if end_line is None else end_line
        if not (isinstance(start, int) and isinstance(end, int)) or start < 1 or end < start:
            return ToolOutcome(f"error: bad line range {start_line}..{end_line} (1-based, inclusive)", error=True)
        return ToolOutcome(self._clip("".join(lines[start - 1:end])))

    def _tool_write_file(self, path: str, content: str) -> ToolOutcome:
        path = self.workspace.normalize(path)
        if not isinstance(content, str):
            return ToolOutcome("error: content must be a string", error=True)
        if len(content.encode()) > MAX_FILE_BYTES:
            return ToolOutcome(f"error: file larger than {MAX_FILE_BYTES} bytes", error=True)
        if path not in self.workspace.files and len(self.workspace.files) >= MAX_FILES:
            return ToolOutcome(f"error: the workspace holds at most {MAX_FILES} files", error=True)
        if (other := self.workspace.clash(path)) is not None:  # the sandbox could not write both: every later run
            return ToolOutcome(f"error: {path} and the file {other} cannot both exist", error=True)  # would fail
        self.workspace.files[path] = content
        return ToolOutcome(f"wrote {path} ({len(content.splitlines())} lines)")

    def _tool_edit_file(self, path: str, old: str, new: str) -> ToolOutcome:
        path = self.workspace.normalize(path)
        if path not in self.workspace.files:
            return ToolOutcome(f"error: no such file: {path}", error=True)
        if not isinstance(old, str) or not isinstance(new, str) or not old:
            return ToolOutcome("error: old must be a non-empty string and new a string", error=True)
        text = self.workspace.files[path]
        count = text.count(old)
        if count == 0:
            return ToolOutcome(f"error: the text to replace was not found in {path}", error=True)
        if count > 1:
            return ToolOutcome(f"error: the text to replace occurs {count} times in {path}; "
                               "include more context so it is unique", error=True)
        edited = text.replace(old, new, 1)
        if len(edited.encode()) > MAX_FILE_BYTES:  # as write_file: edits must not grow a file past it either
            return ToolOutcome(f"error: the edit makes {path} larger than {MAX_FILE_BYTES} bytes", error=True)
        self.workspace.files[path] = edited
        return ToolOutcome(f"edited {path}")

    def _tool_run_tests(self) -> ToolOutcome:
        if self.runner is None:
            return ToolOutcome("error: no test runner is available in this environment", error=True)
        report = self.runner.run_tests(self.workspace.snapshot(), self.test_files, timeout_s=self.test_timeout_s)
        self.test_results.append(report.ok)
        verdict = "all tests passed" if report.ok else "tests failed"
        head = f"{verdict}: {report.passed} passed, {report.failed} failed, {report.errors} errors"
        output = PYTEST_TIME.sub(r"\1", report.output)  # wall time: the same run must read the same to the policy
        return ToolOutcome(self._clip(f"{head}\n{output}".rstrip()), tests_passed=report.ok)

    def _tool_ask_user(self, question: str) -> ToolOutcome:
        return ToolOutcome("(waiting for the user)", ends_episode=True, question=str(question))

    def _tool_submit(self) -> ToolOutcome:
        return ToolOutcome("submitted", ends_episode=True)

    def _clip(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        return text[: self.max_output_chars] + f"\n... ({len(text) - self.max_output_chars} more characters)"
