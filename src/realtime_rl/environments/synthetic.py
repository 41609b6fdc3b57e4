"""Synthetic coding tasks for the default model: short pipelines over lists, strings and numbers.

    task = generate_task(123, split="train", seed=0)     # deterministic; nothing touches the disk
    task.write(Path("tasks"))                            # tasks/syn-train-000123/ in the Exercism layout
    generate_tasks(Path("tasks"), count=1000, split="heldout", difficulty=2)

A task is one function whose body is 1-4 stages (difficulty = stages) from the table in
synthetic_ops.py, e.g. `filter:gt -> map:mul -> reduce:sum`; synthetic_index.py says which program
index i of a split is. Each task directory holds:

    .docs/instructions.md               templated English naming the function, signature and test file
    <module>.py                         the stub: signature, docstring, raise NotImplementedError
    <module>_test.py                    2-4 visible pytest cases
    .meta/example.py                    the reference solution
    .meta/<module>_hidden_test.py       more cases (empty input, negatives, ties), none of the visible ones
    .meta/cases.json                    every visible and hidden test as data, which grading uses (value
                                        grading: no expected value enters the sandbox)
    .meta/novice/<bug>.py               buggy solutions: off_by_one, wrong_comparison, missing_step,
                                        wrong_constant (those the program admits)
    .meta/config.json                   files, plus `rtrl` metadata (split, structure, novice bugs)

Expected values come from running the reference on candidate inputs. Every candidate mistake is run
too, and the visible cases are picked greedily to catch them (a missing step first); a novice file is
written only when some test catches it, preferring a mistake a visible test catches, and the metadata
says which tests do. A stage that no candidate input shows to matter is listed in
`rtrl.redundant_stages`; a program whose answer never changed is marked `rtrl.constant_output`.

What this does not do: no natural-language variety beyond two wordings per stage, no classes, I/O or
floats, and no guarantee that every stage matters for every choice of constants (see above).
"""

from __future__ import annotations

import functools
import json
import random
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from realtime_rl.environments.synthetic_index import (
    HELDOUT_FRACTION, RESERVED_FRACTION, SPLITS, TASK_SETS, Pick, Split, count_distinct_programs,
    count_distinct_tasks, holds_heldout_part, pick, pool_size, pool_task_index, reserved_structure, split_size,
    structure_split, task_set, train_indices,
)
from realtime_rl.environments.synthetic_ops import (
    ANNOTATION, INPUT_DESCRIPTION, LAYOUTS, NAME_STYLES, PARAMETER_NAMES, RESULT_DESCRIPTION, Op,
    structure_name,
)

__all__ = ["BUG_KINDS", "HELDOUT_FRACTION", "RESERVED_FRACTION", "SPLITS", "TASK_SETS", "SyntheticTask",
           "count_distinct_programs", "count_distinct_tasks", "generate_task", "generate_tasks", "holds_heldout_part",
           "pool_size", "pool_task_index", "reserved_structure", "split_size", "structure_split", "task_set",
           "train_indices"]

Value = int | str | list[int] | list[str]
BUG_KINDS = ("off_by_one", "wrong_comparison", "missing_step", "wrong_constant")
VISIBLE_CASES = {1: 2, 2: 3, 3: 4, 4: 4}
HIDDEN_CASES = 8
TYPICAL_INPUTS = 24
"""Random candidate inputs per task, besides the edge cases."""

# ---- candidate inputs -------------------------------------------------------------------------

TEXT_WORDS = ("apple", "Banana", "cat", "dog", "sea", "tree", "Sky", "data", "code", "bee", "Test", "stone",
              "Ant", "bread", "cloud", "door", "sun", "toast", "Moon", "level", "noon", "x9", "r2d2", "42",
              "hello!", "wow,", "ok", "Tea", "east", "ASAP", "cab", "Door", "b4", "salt", "idea", "7up",
              "add", "bird", "Crab", "dust", "sand", "tin", "Stop", "trend", "lion", "red", "A1", "2024",
              "elephant", "Computer", "sandwich", "bicycle", "Dinosaur", "strawberry", "teapot", "candle",
              "afternoon", "basket", "carpet", "doorbell", "sandcastle", "treehouse", "dragon", "castle",
              "cucumber", "cupboard", "daylight", "blueberry", "sunshine", "tangerine", "airplane",
              "document")
SMALL_INTS = range(-9, 16)
NAT_LIMITS = {"source:range1": 20, "source:range0": 20, "source:digits": 10**7, "source:divisors": 60}


def _typical_inputs(input_type: str, first: Op, depth: int, rng: random.Random) -> list[Value]:
    """Ordinary inputs: mixed-sign int lists and phrases, longer for deeper programs so that every stage
    has something left to act on."""
    if input_type == "ints":
        out = []
        for _ in range(TYPICAL_INPUTS):
            values = rng.choices(SMALL_INTS, k=rng.randint(2 + 2 * depth, 4 + 3 * depth))
            if rng.random() < 0.3:  # a repeated value, so de-duplication and ties matter
                values[rng.randrange(len(values))] = rng.choice(values)
            out.append(values)
        return out
    if input_type == "nat":
        limit = NAT_LIMITS[first.key]
        return [rng.randint(2, limit) if limit < 100 else rng.randint(10, 10 ** rng.randint(2, 7))
                for _ in range(TYPICAL_INPUTS)]
    separators = (" ", " ", " ", "  ")  # now and then a double space, which split() must absorb
    return [rng.choice(separators).join(rng.choices(TEXT_WORDS, k=rng.randint(1 + depth, 2 + 2 * depth)))
            for _ in range(TYPICAL_INPUTS)]


def _edge_inputs(input_type: str, first: Op, rng: random.Random) -> list[tuple[str, Value]]:
    """(label, input) cases the hidden tests always include: empty, tiny, all negative, ties, long."""
    if input_type == "ints":
        tie = rng.randint(-3, 9)
        return [("empty", []), ("single", [rng.randint(-5, 12)]),
                ("negatives", [-rng.randint(1, 9) for _ in range(4)]),
                ("ties", [tie, rng.randint(-5, 12), tie, tie, rng.randint(-5, 12)]),
                ("long", [rng.randint(-9, 20) for _ in range(14)])]
    if input_type == "nat":
        limit = NAT_LIMITS[first.key]
        return [("zero", 0), ("one", 1), ("large", limit if limit < 100 else 10_203_040)]
    return [("empty", ""), ("single_word", rng.choice(TEXT_WORDS)), ("spaces", "  Sea  and  SUN  "),
            ("ties", "noon noon Noon level 42 42"), ("long", " ".join(rng.choices(TEXT_WORDS, k=10)))]


# ---- programs as text -------------------------------------------------------------------------

@dataclass(frozen=True)
class _Line:
    """One stage as written: an expression template and its constants."""
    template: str
    constants: tuple[tuple[str, int | str], ...]

    def expression(self, var: str) -> str:
        context: dict[str, str] = {"v": var}
        for name, value in self.constants:
            context[name] = repr(value)
            if isinstance(value, int):
                context[f"{name}_plus"] = repr(value + 1)
        return self.template.format(**context)


class _Program:
    """A picked program with its surface: renders the solution module, the stub, tests and instructions."""

    def __init__(self, chosen: Pick):
        self.ops, self.constants, self.wording = chosen.ops, chosen.constants, chosen.wording
        self.input_type = self.ops[0].takes
        self.layout = LAYOUTS[chosen.layout]
        self.param = PARAMETER_NAMES[self.input_type][chosen.parameter]
        words = [op.word for op in self.ops if op.key != "split:words"] or ["words"]
        self.function = NAME_STYLES[chosen.name_style].format("_".join(words[-3:]))
        self.lines = tuple(_Line(op.code, c) for op, c in zip(self.ops, self.constants))
        self.steps = [self._phrase(i) for i in range(len(self.ops))]
        self.result = RESULT_DESCRIPTION[self.ops[-1].gives]
        self.signature = (f"{self.function}({self.param}: {ANNOTATION[self.input_type]}) -> "
                          f"{ANNOTATION[self.ops[-1].gives]}")
        summary = ", then ".join(self.steps) + f"; return the resulting {self.result}."
        self.docstring = textwrap.fill(summary[0].upper() + summary[1:], width=92, initial_indent='    """',
                                       subsequent_indent="    ") + '"""'

    def _phrase(self, i: int) -> str:
        context = {"p": f"`{self.param}`"}
        for name, value in self.constants[i]:
            context[name] = str(value) if isinstance(value, int) else f"`{value!r}`"
        return self.ops[i].phrases[self.wording].format(**context)

    def source(self, lines: tuple[_Line, ...]) -> str:
        """The module: signature, docstring, then `result = ...` per stage and `return` of the last."""
        statements, var = [], self.param
        for line in lines[:-1]:
            statements.append(f"result = {line.expression(var)}")
            var = "result"
        statements.append(f"return {lines[-1].expression(var)}" if lines else f"return {var}")
        return f"def {self.signature}:\n{self.docstring}\n" + "".join(f"    {s}\n" for s in statements)

    def stub(self) -> str:
        return f"def {self.signature}:\n{self.docstring}\n    raise NotImplementedError\n"

    def test_module(self, cases: list[tuple[str, Value, Any]]) -> str:
        out = [f"from {self.function} import {self.function}\n"]
        for label, value, expected in cases:
            out.append(f"\ndef test_{label}():\n    assert {self.function}({value!r}) == {expected!r}\n")
        return "\n".join(out)

    def instructions(self) -> str:
        given = f"{INPUT_DESCRIPTION[self.input_type]} `{self.param}`"
        intro = f"Write a function `{self.signature}` in `{self.function}.py`."
        if self.layout == "steps":
            listed = "\n".join(f"{i + 1}. {s[0].upper() + s[1:]}." for i, s in enumerate(self.steps))
            body = f"{intro} Given {given}, it should:\n\n{listed}\n\nIt returns the resulting {self.result}."
        else:
            flow = self.steps[0] if len(self.steps) == 1 else (
                "first " + ", then ".join(self.steps[:-1]) + f", and finally {self.steps[-1]}")
            body = textwrap.fill(f"{intro} Given {given}, it should {flow}. It returns the resulting "
                                 f"{self.result}.", 100, break_long_words=False, break_on_hyphens=False)
        title = self.function.replace("_", " ").capitalize()
        tests = f"The visible tests are in `{self.function}_test.py`; run them with `pytest`."
        return f"# {title}\n\n{body}\n\n{tests}\n"


# ---- running programs and their mistakes ------------------------------------------------------

_ERROR = object()
"""The outcome of a call that raised: equal to no expected value."""


@functools.lru_cache(maxsize=1 << 16)
def _stage_function(expression: str) -> Callable[[Any], Any]:
    return eval(f"lambda v: {expression}")  # our own generated expression, never outside input


def _call(function: Callable[[Any], Any], value: Any) -> Any:
    try:
        return function(value)
    except Exception:  # a buggy variant may crash (an index past the end): that fails its test
        return _ERROR


def _load_function(source: str, name: str) -> Callable[[Value], Any]:
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<{name}>", "exec"), namespace)  # our own generated module
    return namespace[name]


def _states(lines: tuple[_Line, ...], inputs: list[Value]) -> list[list[Any]]:
    """states[j][i]: inputs[i] after the first j stages."""
    states = [inputs]
    for line in lines:
        stage = _stage_function(line.expression("v"))
        states.append([_call(stage, value) if value is not _ERROR else _ERROR for value in states[-1]])
    return states


def _outputs(lines: tuple[_Line, ...], reference: tuple[_Line, ...], states: list[list[Any]]) -> list[Any]:
    """What `lines` returns on each input, starting from the reference's states where the two part."""
    shared = next((j for j, (a, b) in enumerate(zip(lines, reference)) if a != b),
                  min(len(lines), len(reference)))
    stages = [_stage_function(line.expression("v")) for line in lines[shared:]]
    out = []
    for value in states[shared]:
        for stage in stages:
            value = _call(stage, value) if value is not _ERROR else _ERROR
        out.append(value)
    return out


@dataclass(frozen=True)
class _Variant:
    """A candidate novice solution: the reference with one mistake."""
    kind: str
    stage: int
    lines: tuple[_Line, ...]
    description: str


def _variants(program: _Program, rng: random.Random) -> list[_Variant]:
    """Every candidate mistake: each bug kind the table admits, at each stage."""
    lines, out = program.lines, []
    for i, (op, line) in enumerate(zip(program.ops, lines)):
        step = f"step {i + 1} ({program.steps[i]})"
        where = "result" if i else program.param
        if op.takes == op.gives:
            out.append(_Variant("missing_step", i, lines[:i] + lines[i + 1:], f"skips {step}"))
        for kind, template in (("off_by_one", op.off_by_one), ("wrong_comparison", op.wrong_comparison),
                               ("missing_step", op.missing_step), ("wrong_constant", op.wrong_constant)):
            if template:
                wrong = _Line(template, line.constants)
                out.append(_Variant(kind, i, lines[:i] + (wrong,) + lines[i + 1:],
                                    f"in {step} writes `{wrong.expression(where)}`"))
        for p, (name, values) in enumerate(op.params):
            value = line.constants[p][1]
            # a constant one away is an off-by-one, not a misread constant
            others = [u for u in values if u != value and not (isinstance(u, int) and abs(u - value) < 2)]
            for other in rng.sample(others, min(2, len(others))):
                wrong = _Line(line.template, line.constants[:p] + ((name, other),) + line.constants[p + 1:])
                out.append(_Variant("wrong_constant", i, lines[:i] + (wrong,) + lines[i + 1:],
                                    f"in {step} uses {other!r} instead of {value!r}"))
    return out


def _choose_cases(candidates: list[int], catches: list[list[int]], weights: list[int], outputs: list[Any],
                  count: int, rng: random.Random, chosen: list[int]) -> list[int]:
    """Greedily pick `count` inputs among candidates that catch the most variants `chosen` does not,
    preferring inputs with a new expected output (so that no constant answer passes)."""
    caught = {v for i in chosen for v in catches[i]}
    candidates = [i for i in candidates if i not in chosen]
    rng.shuffle(candidates)
    picked: list[int] = []
    for _ in range(min(count, len(candidates))):
        seen_outputs = [outputs[i] for i in chosen + picked]

        def score(i: int) -> int:
            gain = sum(weights[v] for v in catches[i] if v not in caught)
            return gain + (3 if outputs[i] not in seen_outputs else 0)

        best = max(candidates, key=score)
        candidates.remove(best)
        picked.append(best)
        caught.update(catches[best])
    return picked


# ---- tasks ------------------------------------------------------------------------------------

@dataclass
class SyntheticTask:
    slug: str
    files: dict[str, str]
    """Relative path -> text: every file of the task directory."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """The `rtrl` object of .meta/config.json."""

    def write(self, root: Path) -> Path:
        """Write the task as root/<slug>/ and return that directory."""
        path = Path(root) / self.slug
        for rel, text in self.files.items():
            (path / rel).parent.mkdir(parents=True, exist_ok=True)
            (path / rel).write_text(text)
        return path


def _slug(index: int, split: Split, seed: int, difficulty: int | None) -> str:
    parts = ["syn", split] + ([f"s{seed}"] if seed else []) + ([f"d{difficulty}"] if difficulty else [])
    return "-".join(parts + [f"{index:06d}"])


def _candidate_inputs(program: _Program, rng: random.Random) -> tuple[list[tuple[str, Value]], int]:
    """(label, input) pairs, the typical ones first, then the edge cases; and how many are typical."""
    first, depth = program.ops[0], len(program.ops)
    pool = [("typical", value) for value in _typical_inputs(program.input_type, first, depth, rng)]
    typical = len(pool)
    seen = {repr(value) for _, value in pool}
    for label, value in _edge_inputs(program.input_type, first, rng):
        if repr(value) not in seen:
            seen.add(repr(value))
            pool.append((label, value))
    return pool, typical


def _choose_tests(depth: int, typical: int, outputs: list[Any], variants: list[_Variant],
                  caught_by: list[set[int]], rng: random.Random) -> tuple[list[int], list[int]]:
    """Indices of the visible cases (typical inputs catching the most mistakes, a missing step first)
    and of the hidden ones (every edge case, then typical inputs catching what is left)."""
    catches: list[list[int]] = [[] for _ in outputs]
    for v, inputs in enumerate(caught_by):
        for i in inputs:
            catches[i].append(v)
    weights = [4 if v.kind == "missing_step" else 1 for v in variants]
    typicals, edges = list(range(typical)), list(range(typical, len(outputs)))
    visible = _choose_cases(typicals, catches, weights, outputs, VISIBLE_CASES[depth], rng, [])
    if len({repr(outputs[i]) for i in visible}) == 1:  # the typical inputs all agree: show an edge case
        visible[-1:] = _choose_cases(edges, catches, weights, outputs, 1, rng, visible[:-1])
    edges = [i for i in edges if i not in visible]
    more = _choose_cases(typicals, catches, weights, outputs, max(0, HIDDEN_CASES - len(edges)), rng,
                         visible + edges)
    return visible, edges + more


def generate_task(index: int, split: Split = "train", seed: int = 0,
                  difficulty: int | None = None) -> SyntheticTask:
    """Task `index` of a split (of one difficulty, 1-4, if given): the same files for the same arguments,
    a different task for every index below split_size(split, difficulty)."""
    program = _Program(pick(index, split, seed, difficulty))
    rng = random.Random(f"{seed}/{split}/{difficulty}/{index}")
    pool, typical = _candidate_inputs(program, rng)
    reference_source = program.source(program.lines)
    reference = _load_function(reference_source, program.function)
    outputs = [reference(value) for _, value in pool]
    states = _states(program.lines, [value for _, value in pool])
    assert states[-1] == outputs, "the rendered reference and its stages disagree"
    variants = _variants(program, rng)
    caught_by = [{i for i, out in enumerate(_outputs(v.lines, program.lines, states)) if out != outputs[i]}
                 for v in variants]
    visible, hidden = _choose_tests(len(program.ops), typical, outputs, variants, caught_by, rng)

    module = program.function
    visible_cases = [(f"example_{n + 1}", pool[i][1], outputs[i]) for n, i in enumerate(visible)]
    hidden_cases = [(f"{pool[i][0]}_{n + 1}", pool[i][1], outputs[i]) for n, i in enumerate(hidden)]
    files = {
        ".docs/instructions.md": program.instructions(),
        f"{module}.py": program.stub(),
        f"{module}_test.py": program.test_module(visible_cases),
        ".meta/example.py": reference_source,
        f".meta/{module}_hidden_test.py": program.test_module(hidden_cases),
        ".meta/cases.json": json.dumps({"module": module, "function": module, "tests": {
            test_file: [{"name": label, "input": value, "expected": expected} for label, value, expected in cases]
            for test_file, cases in ((f"{module}_test.py", visible_cases),
                                     (f".meta/{module}_hidden_test.py", hidden_cases))}}) + "\n",
    }
    novice_bugs = []
    for kind in BUG_KINDS:
        caught = [(v, inputs) for v, inputs in zip(variants, caught_by)
                  if v.kind == kind and inputs & {*visible, *hidden}]
        if not caught:
            continue
        variant = rng.choice([v for v, inputs in caught if inputs & set(visible)] or [v for v, _ in caught])
        source = program.source(variant.lines)
        buggy = _load_function(source, module)
        failing = {i for i in visible + hidden if _call(buggy, pool[i][1]) != outputs[i]}
        assert failing, f"novice {kind} of {module} passes every test"
        files[f".meta/novice/{kind}.py"] = source
        novice_bugs.append({"kind": kind, "file": f".meta/novice/{kind}.py", "stage": variant.stage + 1,
                            "description": variant.description, "fails_visible": bool(failing & set(visible)),
                            "fails_hidden": bool(failing & set(hidden))})

    metadata = {
        "source": "synthetic", "split": split, "index": index, "seed": seed, "difficulty": len(program.ops),
        "structure": structure_name(program.ops), "function": module, "input_type": program.input_type,
        "constants": [dict(c) for c in program.constants], "novice_bugs": novice_bugs,
        "redundant_stages": sorted({v.stage + 1 for v, inputs in zip(variants, caught_by)
                                    if v.kind == "missing_step" and not inputs}),
        "constant_output": len({repr(out) for out in outputs}) == 1,
    }
    config = {"files": {"solution": [f"{module}.py"], "test": [f"{module}_test.py"],
                        "example": [".meta/example.py"], "hidden_test": [f".meta/{module}_hidden_test.py"],
                        "novice": [bug["file"] for bug in novice_bugs], "cases": ".meta/cases.json"},
              "rtrl": metadata}
    files[".meta/config.json"] = json.dumps(config, indent=2) + "\n"
    return SyntheticTask(_slug(index, split, seed, difficulty), files, metadata)


def generate_tasks(root: Path, count: int, split: Split = "train", seed: int = 0, start: int = 0,
                   difficulty: int | None = None) -> list[Path]:
    """Write tasks start .. start + count - 1 of a split under root; return their directories."""
    if count < 0 or start < 0:
        raise ValueError(f"count and start must be >= 0, got count={count}, start={start}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return [generate_task(i, split, seed, difficulty).write(root) for i in range(start, start + count)]
