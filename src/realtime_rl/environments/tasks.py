"""Task directories in the Exercism layout, read as they are.

    <slug>/.docs/instructions.md          what to build (optional .docs/instructions.append.md)
    <slug>/<module>.py                    the stub the agent edits
    <slug>/<module>_test.py               the visible tests (pytest or unittest)
    <slug>/.meta/example.py               a reference solution
    <slug>/.meta/config.json              {"files": {"solution": [...], "test": [...], "example": [...]}}

Synthetic tasks (environments/synthetic.py) use the same layout plus optional keys in
`.meta/config.json`: `files.hidden_test` (tests only simulated users and graders see, under `.meta/`),
`files.novice` (buggy variants of the solution, under `.meta/`), `files.cases` (every test as data, for value
grading: see `ValueCases`) and an `rtrl` object with metadata (split, difficulty, structure). `load_tasks(path)`
reads one task or a folder of them.

A task's *workspace* is what the agent starts with: the stubs and the visible tests (and any other
plain file at the top level). `.meta/` and `.docs/` never enter a workspace.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any


@dataclass(frozen=True)
class ValueCase:
    """One test as data: `function(input) == expected`, with input and expected as JSON values."""

    test_file: str
    """The test file (as config.json lists it) whose test this is."""
    name: str
    input: Any
    expected: Any


@dataclass(frozen=True)
class ValueCases:
    """A task's tests as data (`.meta/cases.json`): each test of every visible and hidden test file calls one
    function of one module on one input and compares the result with `==`. Grading then runs only the calls in
    the sandbox and compares on the host, where the expected values stay.

        {"module": "clip_sum", "function": "clip_sum",
         "tests": {"clip_sum_test.py": [{"name": "example_1", "input": [1, 2], "expected": 3}, ...],
                   ".meta/clip_sum_hidden_test.py": [...]}}
    """

    module: str
    function: str
    cases: tuple[ValueCase, ...]


@dataclass(frozen=True)
class Task:
    task_id: str
    """The directory name (Exercism slug)."""
    path: Path
    instructions: str
    """instructions.md, plus instructions.append.md when present."""
    solution_files: tuple[str, ...]
    """Files the agent is meant to edit, relative to the task directory."""
    test_files: tuple[str, ...]
    """Visible tests, relative to the task directory."""
    example_files: tuple[str, ...]
    """Reference solutions; example_files[i] is the content for solution_files[i]."""
    hidden_test_files: tuple[str, ...] = ()
    """Tests under .meta/ that the agent never sees (synthetic tasks)."""
    novice_files: tuple[str, ...] = ()
    """Buggy variants of solution_files[0] under .meta/ (synthetic tasks)."""
    metadata: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    """The `rtrl` object of .meta/config.json (split, difficulty, ...), or {}."""
    cases_file: str | None = None
    """The tests as data under .meta/ (synthetic tasks), for value grading; None: grading runs the test files."""

    def read(self, rel: str) -> str:
        return (self.path / rel).read_text()

    def workspace(self) -> dict[str, str]:
        """The files the agent starts with: every top-level file (stubs, visible tests, helpers)."""
        return {p.name: p.read_text() for p in sorted(self.path.iterdir())
                if p.is_file() and not p.name.startswith(".")}

    def reference_solution(self) -> dict[str, str]:
        """solution file name -> reference content."""
        return {sol: self.read(ex) for sol, ex in zip(self.solution_files, self.example_files)}

    def pristine_tests(self) -> dict[str, str]:
        """Visible tests as the task ships them: what grading uses, whatever the agent did to its copies."""
        return {rel: self.read(rel) for rel in self.test_files}

    def hidden_tests(self) -> dict[str, str]:
        """Hidden tests under their own base names, ready to drop into a grading workspace."""
        return {Path(rel).name: self.read(rel) for rel in self.hidden_test_files}

    def value_cases(self, include_hidden: bool = True) -> ValueCases | None:
        """The tests of the visible (and hidden) test files as data, in the order a test run takes them (files
        by base name, tests in file order); None when the task has no cases file."""
        if self.cases_file is None:
            return None
        where = self.path / self.cases_file
        try:
            data = json.loads(self.read(self.cases_file))
            module, function, tests = data["module"], data["function"], data["tests"]
            files = [*self.test_files, *(self.hidden_test_files if include_hidden else ())]
            cases = tuple(ValueCase(rel, case["name"], case["input"], case["expected"])
                          for rel in sorted(files, key=lambda rel: Path(rel).name) for case in tests[rel])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: not a cases file for this task ({type(e).__name__}: {e})") from None
        if not (isinstance(module, str) and module.isidentifier() and isinstance(function, str)
                and function.isidentifier()):
            raise ValueError(f"{where}: module and function must be Python identifiers")
        if f"{module}.py" not in self.solution_files:
            raise ValueError(f"{where}: module {module!r} is not a solution file ({', '.join(self.solution_files)})")
        unlisted = set(tests) - {*self.test_files, *self.hidden_test_files}
        if unlisted:
            raise ValueError(f"{where}: cases for files that are not the task's tests: {', '.join(sorted(unlisted))}")
        if not cases:
            raise ValueError(f"{where}: no cases")
        return ValueCases(module, function, cases)


def is_task_dir(path: Path) -> bool:
    return (path / ".meta" / "config.json").is_file()


def load_task(path: str | Path) -> Task:
    path = Path(path)
    config_file = path / ".meta" / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path}: not a task directory (no .meta/config.json)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file}: invalid JSON: {e}") from None
    files = config.get("files") or {}
    for key in ("solution", "test", "example"):
        if not files.get(key):
            raise ValueError(f"{config_file}: files.{key} is missing or empty")
    if not isinstance(files.get("cases", ""), str):
        raise ValueError(f"{config_file}: files.cases must be one path (a string), got {files['cases']!r}")
    instructions_file = path / ".docs" / "instructions.md"
    if not instructions_file.is_file():
        raise ValueError(f"{path}: no .docs/instructions.md")
    instructions = instructions_file.read_text()
    append = path / ".docs" / "instructions.append.md"
    if append.is_file():
        instructions = instructions.rstrip("\n") + "\n\n" + append.read_text()
    task = Task(
        task_id=path.name,
        path=path,
        instructions=instructions,
        solution_files=tuple(files["solution"]),
        test_files=tuple(files["test"]),
        example_files=tuple(files["example"]),
        hidden_test_files=tuple(files.get("hidden_test", [])),
        novice_files=tuple(files.get("novice", [])),
        metadata=config.get("rtrl") or {},
        cases_file=files.get("cases"),
    )
    listed = [*task.solution_files, *task.test_files, *task.example_files, *task.hidden_test_files, *task.novice_files,
              *([task.cases_file] if task.cases_file is not None else [])]
    escaping = [rel for rel in listed if PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts]
    if escaping:
        raise ValueError(f"{path}: .meta/config.json lists files outside the task: {', '.join(escaping)}")
    hidden = [rel for rel in (*task.solution_files, *task.test_files) if "/" in rel or rel.startswith(".")]
    if hidden:  # the workspace holds the top-level files only: the agent could never see or run these
        raise ValueError(f"{path}: solution and test files must be top-level files of the task, got "
                         f"{', '.join(hidden)}")
    missing = [rel for rel in listed if not (path / rel).is_file()]
    if missing:
        raise ValueError(f"{path}: .meta/config.json lists files that do not exist: {', '.join(missing)}")
    top_level = {p.name for p in path.iterdir() if p.is_file()}
    clashes = sorted(top_level & {PurePosixPath(rel).name for rel in task.hidden_test_files})
    if clashes:  # grading drops hidden tests in by base name: one would replace a visible test or a solution
        raise ValueError(f"{path}: hidden tests named like a top-level file of the task: {', '.join(clashes)}; "
                         "rename them")
    if len(task.example_files) > len(task.solution_files):
        raise ValueError(f"{path}: more example files than solution files")
    if task.cases_file is not None:
        if PurePosixPath(task.cases_file).parts[0] != ".meta":  # it holds the hidden tests' expected values
            raise ValueError(f"{path}: files.cases must be under .meta/, got {task.cases_file}")
        task.value_cases()  # refuses a cases file that does not cover every test file
    return task


def load_tasks(path: str | Path) -> list[Task]:
    """One task directory, or every task directory directly inside `path`, sorted by id."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"task path not found or not a directory: {path}")
    if is_task_dir(path):
        return [load_task(path)]
    tasks = [load_task(p) for p in sorted(path.iterdir()) if p.is_dir() and is_task_dir(p)]
    if not tasks:
        raise ValueError(f"{path}: no task directories (folders with .meta/config.json)")
    return tasks


SUITE_RECORD = ".suite.json"


def generated_suite(root: str | Path, spec: dict[str, Any], generate: Callable[[Path], object], *,
                    adopt_unrecorded: bool = False) -> list[Task]:
    """Tasks that `generate(folder)` writes, kept in `root` with `spec` recorded (root/.suite.json) and
    generated again whenever the spec changes. They are written to a staging folder renamed into place, so a
    stop midway leaves no half suite. A root holding tasks but no record is generated again, or with
    adopt_unrecorded used as it is (a folder of tasks from elsewhere)."""
    root = Path(root)
    recorded = root / SUITE_RECORD
    if root.exists():
        known = json.loads(recorded.read_text()) if recorded.is_file() else None
        holds_tasks = is_task_dir(root) or any(is_task_dir(p) for p in root.iterdir())
        if known != spec and not (known is None and adopt_unrecorded and holds_tasks):
            shutil.rmtree(root)
    if not root.exists():
        staging = root.with_name(f".{root.name}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        generate(staging)
        (staging / SUITE_RECORD).write_text(json.dumps(spec))
        os.replace(staging, root)
    return load_tasks(root)
