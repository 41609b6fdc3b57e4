"""How good a base model is: pass@1 on held-out synthetic tasks through the real agent loop.

    report = heldout_pass_at_1("runs/pretrain/checkpoints/step-0001250", num_tasks=120, max_difficulty=2)
    report["pass_at_1"], report["ci95"], report["by_difficulty"]

The tasks are `generate_task(i, "heldout", seed, difficulty=d)` for d in 1..max_difficulty (the same
number of each): program structures never generated for training. Each task is one episode driven by
the engine (continuous batching over many concurrent episodes) sampling at the temperature RL samples
at (1.0, top_p 1.0 by default), and is graded in a fresh sandbox with the pristine visible and the
hidden tests (evaluate.evaluate_checkpoint, the eval gate's runner). Each task has its own sampling seed,
the same for every checkpoint: a before/after comparison sees the same random numbers task by task, and
re-evaluating one checkpoint gives the same score (without seeds one base checkpoint scored 0.337, 0.352
and 0.403 on the same 600 tasks, more than the lifts it was measured against). The 95% interval is
Wilson's, over tasks.

`teacher_forced_misses(model, tokenizer, tasks)` says where a base model's writes go wrong without sampling:
each task's reference write fed through the model once, and the tokens whose argmax is another token.

Not here: pass@k for k > 1, real (Exercism) tasks; `rtrl eval` runs those.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from realtime_rl.config import AgentConfig
from realtime_rl.environments import Task, generate_task, load_task
from realtime_rl.evaluate import evaluate_checkpoint
from realtime_rl.train.corpus import build_write_documents, classify_solution, wrong_stage_comment

EVAL_AGENT = AgentConfig(max_turns=8, max_new_tokens=384, summary_trigger_tokens=3072, max_context_tokens=4096,
                         max_summaries=0)
"""Enough turns for write, test, fix, test, submit (and one more try); a runaway turn is cut at 384 tokens."""


def heldout_tasks(root: Path, num_tasks: int, max_difficulty: int, seed: int, split: str = "heldout",
                  start: int | Mapping[int, int] = 0) -> list[Task]:
    """num_tasks tasks of `split` written under root: indices start, start + 1, ... of each difficulty
    1..max_difficulty (start: one for all, or {difficulty: start}), as evenly as num_tasks allows (lower
    difficulties take the remainder)."""
    tasks = []
    for d in range(1, max_difficulty + 1):
        count = num_tasks // max_difficulty + (d <= num_tasks % max_difficulty)
        first = start if isinstance(start, int) else start.get(d, 0)
        tasks += [load_task(generate_task(i, split, seed, difficulty=d).write(root))
                  for i in range(first, first + count)]
    return tasks


def wilson_interval(passed: int, total: int, z: float = 1.96) -> tuple[float, float]:
    if total == 0:
        return 0.0, 1.0
    p = passed / total
    center = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return max(0.0, center - half), min(1.0, center + half)


def _comment_counts(wrong: list[int | None], outcomes: list[Any]) -> dict[str, Any]:
    """Episodes by their first write's stage comments: all right, first wrong at stage k, nothing written;
    and how many of the right ones passed."""
    right = [o.passed for w, o in zip(wrong, outcomes) if w == 0]
    return {"right": len(right), "right_passed": sum(right), "none": wrong.count(None),
            "wrong_at_stage": dict(sorted(Counter(w for w in wrong if w).items()))}


def heldout_pass_at_1(checkpoint: str | Path, num_tasks: int = 120, max_difficulty: int = 2, seed: int = 0,
                      top_p: float = 1.0, agent: AgentConfig = EVAL_AGENT,
                      concurrency: int = 16, threads: int | None = None, split: str = "heldout",
                      start: int | Mapping[int, int] = 0) -> dict[str, Any]:
    """Run one episode per held-out task with the checkpoint's model and grade it (visible + hidden tests).
    `split` and `start` pick other tasks (fresh train-split ones for a model trained on first turns only);
    episodes sample at agent.temperature.
    Task k samples with task_seed(seed, k) as the eval gate does, so two checkpoints evaluated with one seed
    pair up task by task on the same random numbers, and one checkpoint evaluated twice scores the same.

    Returns pass_at_1, passed, tasks, ci95 (Wilson), by_difficulty {d: pass_at_1}, by_input_type {d: {input type:
    [passed, tasks]}} (integer lists, naturals, text: difficulty-2 text fails most), ended_by counts, mean
    turns, malformed tool calls, failed submits (submitted and failed the tests), the wall time and
    per_task (one EpisodeOutcome dict per task: task_id, seed, passed, ended_by, turns, first_write (the
    text the first reply wrote), ..., with its structure and first_write_kind).
    first_write counts what the first reply wrote to the solution file (corpus.classify_solution: the
    reference, a novice variant, other code, none), first_write_failed the same over failed episodes: a base
    that fails as the novice can be sharpened toward the expert; one that writes "other" code cannot write the
    program. repairs counts the episodes whose first test run failed and, of those, the ones that passed in
    the end: how often the agent fixes its program after the tests say it is wrong (with agent.attempts > 1,
    in a later attempt). stage_comments counts the episodes whose first write's stage comments are the
    instructions' steps (`right`, and of those `right_passed`), the ones whose first wrong comment is at
    stage k (`wrong_at_stage`) and those that wrote nothing (corpus.wrong_stage_comment): most held-out
    failures of the default base start with another stage's comment. attempts counts the episodes by the
    attempts they made and passed_by_attempt the passed ones by the attempt that passed (the last).
    by_structure is {structure: [passed, tasks]} (most tasks first) and structure_mean_pass_at_1 the mean of
    its pass rates: the split's pools hold a structure once per constant choice, so a few structures with many
    constants fill most of the tasks (218 of the first 300 held-out difficulty-1 tasks are text:prefix or
    filter:lt, of 10 structures) and pass_at_1 leans on them.
    """
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tasks = heldout_tasks(Path(tmp), num_tasks, max_difficulty, seed, split, start)
        outcomes = evaluate_checkpoint(checkpoint, tasks, seed=seed, agent_config=agent, threads=threads,
                                       concurrency=concurrency, top_p=top_p)
        by_id = {t.task_id: t for t in tasks}
        first_write = [classify_solution(by_id[o.task_id], o.first_write) for o in outcomes]
        comment = [wrong_stage_comment(by_id[o.task_id], o.first_write) for o in outcomes]
    by_difficulty: dict[int, list[bool]] = {}
    by_structure: dict[str, list[int]] = {}
    by_input_type: dict[int, dict[str, list[int]]] = {}
    for o in outcomes:
        meta = by_id[o.task_id].metadata
        by_difficulty.setdefault(meta["difficulty"], []).append(o.passed)
        kind = by_input_type.setdefault(meta["difficulty"], {}).setdefault(meta["input_type"], [0, 0])
        kind[0] += o.passed
        kind[1] += 1
        counts = by_structure.setdefault(by_id[o.task_id].metadata["structure"], [0, 0])
        counts[0] += o.passed
        counts[1] += 1
    passed = sum(o.passed for o in outcomes)
    failed_first_run = [o for o in outcomes if o.test_results and not o.test_results[0]]
    return {
        "pass_at_1": passed / len(outcomes),
        "passed": passed,
        "tasks": len(outcomes),
        "ci95": wilson_interval(passed, len(outcomes)),
        "by_difficulty": {d: sum(v) / len(v) for d, v in sorted(by_difficulty.items())},
        "by_input_type": {d: dict(sorted(v.items())) for d, v in sorted(by_input_type.items())},
        "ended_by": dict(Counter(o.ended_by for o in outcomes)),
        "mean_turns": sum(o.turns for o in outcomes) / len(outcomes),
        "malformed_tool_calls": sum(o.malformed_tool_calls for o in outcomes),
        "failed_submits": sum(o.ended_by == "submit" and not o.passed for o in outcomes),
        "repairs": {"first_test_run_failed": len(failed_first_run),
                    "passed_after_it": sum(o.passed for o in failed_first_run)},
        "attempts": dict(sorted(Counter(o.attempts for o in outcomes).items())),
        "passed_by_attempt": dict(sorted(Counter(o.attempts for o in outcomes if o.passed).items())),
        "first_write": dict(Counter(kind.split(":")[0] for kind in first_write)),
        "first_write_failed": dict(Counter(k.split(":")[0] for k, o in zip(first_write, outcomes) if not o.passed)),
        "stage_comments": _comment_counts(comment, outcomes),
        "structures": len(by_structure),
        "structure_mean_pass_at_1": sum(p / n for p, n in by_structure.values()) / len(by_structure),
        "by_structure": dict(sorted(by_structure.items(), key=lambda kv: -kv[1][1])),
        "minutes": (time.perf_counter() - t0) / 60,
        "per_task": [{**asdict(o), "first_write_kind": kind, "wrong_stage_comment": wrong,
                      "structure": by_id[o.task_id].metadata["structure"]}
                     for o, kind, wrong in zip(outcomes, first_write, comment)],
    }


MISS_KINDS = ("comment_digit", "comment_word", "code_digit", "code_word", "call")


def _miss_kind(written: str, token: str) -> str:
    """Where a policy token of a write sits, given the assistant text before it: a stage comment, the code (the
    file's content, as the tool call's JSON escapes it), or the call around it; and whether it holds a digit."""
    start = written.find('"content": "')
    if start < 0:
        return "call"
    line = written[start:].rsplit("\\n", 1)[-1]
    where = "comment" if line.lstrip().startswith("#") else "code"
    return f"{where}_{'digit' if any(ch.isdigit() for ch in token) else 'word'}"


def teacher_forced_misses(model: Any, tokenizer: Any, tasks: list[Task]) -> dict[str, Any]:
    """Each task's first-turn reference document (corpus.build_write_documents, expert: the prompt, then
    write_file of the commented reference) through `model` once; a policy token is missed where the argmax of
    the logits before it is another token. No sampling, so it tells a model that cannot copy a constant or a
    step's words from one that samples badly: a miss in a stage comment is a step or constant not copied from
    the instructions, one in the code a stage written wrong under its comment.

    Returns tasks, perfect (tasks with no miss), with_miss {kind: tasks with at least one miss of that kind,
    for kind in MISS_KINDS}, only_digit_misses (tasks whose misses all hold digits) and per_task [{task_id,
    misses: [{kind, target, predicted, line}]}] (line: the written line up to the miss)."""
    import torch

    docs = build_write_documents(tasks, tokenizer, expert_fraction=1.0, seed=0)
    per_task, with_miss, perfect, only_digits = [], Counter(), 0, 0
    for task, doc in zip(tasks, docs):
        with torch.no_grad():
            logits = model(torch.as_tensor(doc.token_ids, dtype=torch.long)[None]).logits_BTV[0]
        predicted = logits.argmax(-1).tolist()
        ids = doc.token_ids.tolist()
        positions = [int(p) for p in doc.loss_mask.nonzero()[0]]
        misses = []
        for p in positions:
            if predicted[p - 1] == ids[p]:
                continue
            written = tokenizer.decode(ids[positions[0]:p])
            target = tokenizer.decode([ids[p]])
            misses.append({"kind": _miss_kind(written, target), "target": target,
                           "predicted": tokenizer.decode([predicted[p - 1]]),
                           "line": written.rsplit("\\n", 1)[-1][-80:]})
        kinds = {m["kind"] for m in misses}
        with_miss.update(kinds)
        perfect += not misses
        only_digits += bool(misses) and all(k.endswith("_digit") for k in kinds)
        per_task.append({"task_id": task.task_id, "misses": misses})
    return {"tasks": len(tasks), "perfect": perfect, "with_miss": {k: with_miss[k] for k in MISS_KINDS},
            "only_digit_misses": only_digits, "per_task": per_task}
