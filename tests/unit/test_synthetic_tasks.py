"""The synthetic task generator: deterministic, loadable, graded by real pytest, split by program shape."""

from __future__ import annotations

import builtins
import itertools
import keyword
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest

from realtime_rl.environments import load_task, load_tasks
from realtime_rl.environments.synthetic import (
    BUG_KINDS, HELDOUT_FRACTION, RESERVED_FRACTION, SPLITS, SyntheticTask, count_distinct_programs,
    count_distinct_tasks, generate_task, generate_tasks, holds_heldout_part, reserved_structure, split_size,
    structure_split, task_set, train_indices,
)
from realtime_rl.environments.synthetic_ops import structure_name, structures


def _sample(per_group: int) -> list[SyntheticTask]:
    """`per_group` tasks of each difficulty and split, with distinct function names (one pytest run
    imports them all, so their modules must not clash)."""
    tasks, names = [], set()
    for difficulty in (1, 2, 3, 4):
        for split in SPLITS:
            group = []
            for index in itertools.count():
                task = generate_task(index, split, seed=1, difficulty=difficulty)
                if task.metadata["function"] not in names:
                    names.add(task.metadata["function"])
                    group.append(task)
                if len(group) == per_group:
                    break
            tasks += group
    return tasks


def _pytest_failures(root: Path) -> dict[str, set[str]]:
    """Run every test under root in one pytest process: test module name -> names of failed tests.
    Modules that ran appear even when nothing failed."""
    report = root / "report.xml"
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # third-party plugins cost a second per run
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                    "--rootdir", str(root), str(root)], capture_output=True, text=True, timeout=120, env=env)
    failures: dict[str, set[str]] = defaultdict(set)
    for case in ET.parse(report).iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        failures[module]  # noqa: B018 - records that the module ran
        if case.find("failure") is not None or case.find("error") is not None:
            failures[module].add(case.get("name"))
    return failures


def _workspace(task, root: Path, solution: str) -> None:
    """The task's visible and hidden tests beside `solution` as the module, under root/<slug>/."""
    module = task.metadata["function"]
    out = root / task.slug
    out.mkdir(parents=True)
    (out / f"{module}.py").write_text(solution)
    (out / f"{module}_test.py").write_text(task.files[f"{module}_test.py"])
    (out / f"{module}_hidden_test.py").write_text(task.files[f".meta/{module}_hidden_test.py"])


def test_same_arguments_give_the_same_task_and_other_indices_other_tasks():
    a, b = generate_task(17, "train", seed=3), generate_task(17, "train", seed=3)
    assert a.files == b.files and a.metadata == b.metadata and a.slug == b.slug
    assert generate_task(18, "train", seed=3).files[".meta/example.py"] != a.files[".meta/example.py"]
    assert generate_task(17, "train", seed=4).files != a.files


def test_distinct_indices_give_distinct_tasks():
    seen = set()
    for index in range(2000):
        task = generate_task(index, "train", seed=0)
        seen.add((task.files[".docs/instructions.md"], task.files[".meta/example.py"]))
    assert len(seen) == 2000


def test_a_whole_difficulty_pool_is_enumerated_without_repeats():
    size = split_size("heldout", difficulty=1)
    assert 100 < size < 5000
    programs = {generate_task(i, "heldout", difficulty=1).files[".docs/instructions.md"] for i in range(size)}
    assert len(programs) == size
    with pytest.raises(ValueError, match="beyond"):
        generate_task(size, "heldout", difficulty=1)


def test_at_least_100000_distinct_tasks_and_programs():
    assert count_distinct_tasks() >= 100_000
    assert count_distinct_programs() >= 100_000  # distinct (structure, constants): distinct function bodies
    assert count_distinct_tasks() == split_size("train") + split_size("heldout")
    programs = set()
    for index in range(1500):
        meta = generate_task(index, "train", difficulty=4).metadata
        programs.add((meta["structure"], str(meta["constants"])))
    assert len(programs) > 1450  # the same program under another name or wording is rare at this depth


def test_no_structure_is_in_both_splits_and_the_held_out_share_is_as_configured():
    seen = {"train": set(), "heldout": set()}
    for split in seen:
        for index in range(1000):
            structure = generate_task(index, split, seed=2).metadata["structure"]
            assert structure_split(structure) == split
            seen[split].add(structure)
    assert not seen["train"] & seen["heldout"]
    names = [structure_name(ops) for ops in structures()]
    held_out = sum(structure_split(name) == "heldout" for name in names) / len(names)
    assert len(names) > 10_000
    assert abs(held_out - HELDOUT_FRACTION) < 0.03


def test_the_task_loader_reads_synthetic_tasks(tmp_path):
    paths = generate_tasks(tmp_path, count=8, split="heldout", seed=5, start=100)
    paths += generate_tasks(tmp_path, count=4, difficulty=3)
    assert [t.task_id for t in load_tasks(tmp_path)] == sorted(p.name for p in paths)
    for path in paths:
        task = load_task(path)
        module = task.metadata["function"]
        assert task.solution_files == (f"{module}.py",)
        assert task.test_files == (f"{module}_test.py",)
        assert task.hidden_test_files == (f".meta/{module}_hidden_test.py",)
        assert set(task.workspace()) == {f"{module}.py", f"{module}_test.py"}
        assert "NotImplementedError" in task.workspace()[f"{module}.py"]
        assert task.reference_solution()[f"{module}.py"] == task.read(".meta/example.py")
        assert list(task.hidden_tests()) == [f"{module}_hidden_test.py"]
        assert f"`{module}(" in task.instructions and f"`{module}_test.py`" in task.instructions
        assert task.metadata["source"] == "synthetic" and task.metadata["seed"] in (0, 5)
        assert len(task.novice_files) == len(task.metadata["novice_bugs"]) >= 1
        for bug in task.metadata["novice_bugs"]:
            assert bug["kind"] in BUG_KINDS and bug["file"] == f".meta/novice/{bug['kind']}.py"
            assert bug["fails_visible"] or bug["fails_hidden"]
            assert task.read(bug["file"]) != task.read(".meta/example.py")
    assert {load_task(p).metadata["difficulty"] for p in paths[8:]} == {3}
    assert paths[0].name == "syn-heldout-s5-000100" and paths[8].name == "syn-train-d3-000000"


def test_difficulty_is_the_number_of_stages_each_one_line_of_the_reference():
    for difficulty in (1, 2, 3, 4):
        for index in range(30):
            task = generate_task(index, difficulty=difficulty)
            meta = task.metadata
            assert meta["difficulty"] == difficulty == len(meta["structure"].split(" -> "))
            body = task.files[".meta/example.py"].split('"""')[-1].strip().splitlines()
            assert len(body) == difficulty and body[-1].strip().startswith("return ")


def test_references_pass_stubs_fail_and_every_novice_fails_under_pytest(tmp_path):
    tasks = _sample(per_group=5)
    assert len(tasks) == 40
    for task in tasks:
        module = task.metadata["function"]
        _workspace(task, tmp_path / "reference", task.files[".meta/example.py"])
        _workspace(task, tmp_path / "stub", task.files[f"{module}.py"])
        for bug in task.metadata["novice_bugs"]:
            _workspace(task, tmp_path / bug["kind"], task.files[bug["file"]])

    reference = _pytest_failures(tmp_path / "reference")
    stub = _pytest_failures(tmp_path / "stub")
    novices = {kind: _pytest_failures(tmp_path / kind) for kind in BUG_KINDS if (tmp_path / kind).exists()}
    bugs_seen = 0
    for task in tasks:
        module = task.metadata["function"]
        visible, hidden = f"{module}_test", f"{module}_hidden_test"
        assert visible in reference and hidden in reference, f"{task.slug}: tests did not run"
        assert not reference[visible] and not reference[hidden], f"{task.slug}: the reference fails"
        n_visible = task.files[f"{module}_test.py"].count("def test_")
        n_hidden = task.files[f".meta/{module}_hidden_test.py"].count("def test_")
        assert 2 <= n_visible <= 4 and n_hidden >= 6
        assert (len(stub[visible]), len(stub[hidden])) == (n_visible, n_hidden), f"{task.slug}: a stub passes"
        for bug in task.metadata["novice_bugs"]:
            failed = novices[bug["kind"]]
            assert failed[visible] or failed[hidden], f"{task.slug}: novice {bug['kind']} passes every test"
            assert bool(failed[visible]) == bug["fails_visible"]
            assert bool(failed[hidden]) == bug["fails_hidden"]
            bugs_seen += 1
    assert bugs_seen >= 2 * len(tasks)
    assert {bug["kind"] for task in tasks for bug in task.metadata["novice_bugs"]} == set(BUG_KINDS)


def test_hidden_tests_add_edge_cases_to_the_visible_ones():
    by_type = {}
    for index in range(12):
        task = generate_task(index, difficulty=2)
        by_type.setdefault(task.metadata["input_type"], task)
    assert set(by_type) == {"ints", "nat", "text"}
    for input_type, edge in (("ints", "([])"), ("nat", "(0)"), ("text", "('')")):
        task = by_type[input_type]
        module = task.metadata["function"]
        hidden, visible = task.files[f".meta/{module}_hidden_test.py"], task.files[f"{module}_test.py"]
        assert hidden.count("def test_") >= 6
        assert edge in hidden + visible
        calls = [line.split(" == ")[0] for line in visible.splitlines() if " == " in line]
        assert not any(call in hidden for call in calls)  # no visible case repeated


def test_function_names_never_shadow_a_module_builtin_or_keyword():
    names = set()
    for split in SPLITS:
        for difficulty in (1, 2):  # the shortest names are the risky ones
            names |= {generate_task(i, split, difficulty=difficulty).metadata["function"] for i in range(300)}
    assert len(names) > 100
    for name in names:
        assert name.isidentifier() and not keyword.iskeyword(name)
        assert name not in sys.stdlib_module_names and not hasattr(builtins, name)


@pytest.mark.parametrize("kwargs, message", [
    (dict(index=-1), "index"), (dict(index=0, split="test"), "split"),
    (dict(index=0, difficulty=0), "difficulty"), (dict(index=0, difficulty=5), "difficulty"),
    (dict(index=10**12), "beyond"),
])
def test_bad_arguments_are_refused(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        generate_task(**kwargs)
    with pytest.raises(ValueError, match="count"):
        generate_tasks(tmp_path, count=-1)


def test_reserved_structures_are_a_stable_share_of_train_and_a_task_set_of_their_own():
    names = [structure_name(ops) for ops in structures()]
    train = [name for name in names if structure_split(name) == "train"]
    reserved = [name for name in train if reserved_structure(name)]
    assert abs(len(reserved) / len(train) - RESERVED_FRACTION) < 0.03
    assert not any(reserved_structure(name) for name in names if structure_split(name) == "heldout")
    for difficulty in (1, 2):
        assert 0 < split_size("reserved", difficulty) < split_size("train", difficulty)
        for index in range(100):
            structure = generate_task(index, "reserved", seed=2, difficulty=difficulty).metadata["structure"]
            assert task_set(structure) == "reserved" and structure_split(structure) == "train"
    other = train_indices(seed=0, difficulty=1, skip_reserved=True)
    kept = split_size("train", 1) - split_size("reserved", 1)
    first = [next(other) for _ in range(kept + 2)]
    assert len(set(first[:kept])) == kept and first[kept:] == first[:2]  # every other task once, then again
    assert not any(reserved_structure(generate_task(i, "train", difficulty=1).metadata["structure"])
                   for i in first[:50])


def test_a_held_out_part_is_a_held_out_structure_of_two_or_more_consecutive_stages_short_of_the_whole():
    by_name = {structure_name(ops): ops for ops in structures()}
    pairs = {name for name, ops in by_name.items() if len(ops) == 2 and structure_split(name) == "heldout"}
    for ops in by_name.values():
        if len(ops) <= 2:
            assert not holds_heldout_part(ops)  # a held-out pair is held out, not a part of itself
        elif len(ops) == 3:
            assert holds_heldout_part(ops) == bool(pairs & {structure_name(ops[:2]), structure_name(ops[1:])})
    three = [ops for name, ops in by_name.items() if len(ops) == 3 and structure_split(name) == "train"]
    assert 0.1 < sum(map(holds_heldout_part, three)) / len(three) < 0.3  # 1,205 of 6,115


def test_train_indices_skip_structures_with_held_out_parts_and_leave_lower_difficulties_alone():
    for difficulty in (1, 2):
        plain = train_indices(seed=0, difficulty=difficulty, skip_heldout_parts=True)
        assert [next(plain) for _ in range(20)] == list(range(20))
    pairs_held_out = {structure_name(ops) for ops in structures()
                      if len(ops) == 2 and structure_split(structure_name(ops)) == "heldout"}
    kept = train_indices(seed=0, difficulty=3, skip_heldout_parts=True)
    first = [next(kept) for _ in range(60)]
    assert first == sorted(set(first)) and first[-1] > 59  # in order, some skipped
    for i in range(first[-1] + 1):
        ops = generate_task(i, "train", seed=0, difficulty=3).metadata["structure"].split(" -> ")
        pairs = [" -> ".join(ops[:2]), " -> ".join(ops[1:])]
        assert (i in first) == (not pairs_held_out & set(pairs))
    both = train_indices(seed=0, difficulty=3, skip_reserved=True, skip_heldout_parts=True)
    assert not any(reserved_structure(generate_task(i, "train", difficulty=3).metadata["structure"])
                   for i in [next(both) for _ in range(30)])


@pytest.mark.parametrize("sizes", [[5, 0, 2], [3, 3, 3], [1, 7, 4], [0, 0, 6]])
def test_deinterleave_inverts_the_round_robin(sizes):
    from realtime_rl.environments.synthetic_index import _deinterleave, _interleave

    for index in range(sum(sizes)):
        pool, place = _interleave(index, sizes)
        assert _deinterleave(pool, place, sizes) == index
    with pytest.raises(ValueError, match="beyond pool"):
        _deinterleave(2, sizes[2], sizes)


def test_pool_task_index_reaches_each_input_type_past_the_smallest_pool():
    """Past index 100,000 the index space gives difficulty 2 integer lists alone; pool_task_index reaches the
    text and naturals pools at any place."""
    from realtime_rl.environments.synthetic import pick, pool_size, pool_task_index

    assert {pick(i, "train", 0, 2).ops[0].takes for i in range(100_000, 100_030)} == {"ints"}
    for input_type in ("ints", "nat", "text"):
        last = pool_size("train", 2, input_type) - 1
        for place in (0, 1, last // 2, last):
            index = pool_task_index("train", 2, input_type, place)
            assert pick(index, "train", 0, 2).ops[0].takes == input_type
    with pytest.raises(ValueError, match="input_type"):
        pool_task_index("train", 2, "floats", 0)
