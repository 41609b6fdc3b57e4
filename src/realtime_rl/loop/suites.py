"""The gate's held-out suites and the versions' evaluations on them, cached (once per version).

    tasks = suite(run_dir / "gate-tasks", count, difficulties, split, seed, start)   # generated once
    key = eval_key(gate_tasks, canary_tasks, agent, seed)                            # what an evaluation depends on
    gate, canary = cached_outcomes(run_dir / "evals" / f"v-000003-{key}.json", evaluate)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from realtime_rl.config import AgentConfig
from realtime_rl.environments import Task, generate_tasks
from realtime_rl.environments.tasks import generated_suite
from realtime_rl.evaluate import EpisodeOutcome
from realtime_rl.rewards import Interaction

EVAL_SCHEMA = 2
"""Version of the cached evaluation outcomes (2: each carries its first reply's action)."""
Outcomes = tuple[list[EpisodeOutcome], list[EpisodeOutcome]]


def suite(root: Path, count: int, difficulties: Sequence[int], split: str, seed: int, start: int) -> list[Task]:
    """`count` tasks cycling through `difficulties`, generated once; regenerated when their spec changes."""
    if not count:
        shutil.rmtree(root, ignore_errors=True)
        return []
    levels = list(difficulties)
    spec = {"count": count, "difficulties": levels, "split": split, "seed": seed, "start": start}

    def generate(folder: Path) -> None:
        for i, d in enumerate(levels):
            n = count // len(levels) + (i < count % len(levels))
            generate_tasks(folder, n, split=split, seed=seed, start=start, difficulty=d)

    return generated_suite(root, spec, generate)


def eval_key(gate_tasks: Sequence[Task], canary_tasks: Sequence[Task], agent: AgentConfig, seed: int) -> str:
    """What a cached evaluation depends on besides the version: the suites, the agent, the seed, and the
    outcome schema (EVAL_SCHEMA: caches written before outcomes carried their first reply's action are
    recomputed rather than guessed)."""
    spec = {"schema": EVAL_SCHEMA, "gate": [t.task_id for t in gate_tasks],
            "canary": [t.task_id for t in canary_tasks], "agent": agent.model_dump(mode="json"), "seed": seed}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def cached_outcomes(cache: Path, evaluate: Callable[[], Outcomes]) -> Outcomes:
    """The gate and canary outcomes in `cache`, or `evaluate()`'s, written there first."""
    if cache.is_file():
        data = json.loads(cache.read_text())
        return [EpisodeOutcome(**o) for o in data["gate"]], [EpisodeOutcome(**o) for o in data["canary"]]
    gate, canary = evaluate()
    cache.parent.mkdir(exist_ok=True)
    staging = cache.with_name(f".{cache.name}.tmp")  # a stop mid-write leaves no truncated cache behind
    staging.write_text(json.dumps({"gate": [asdict(o) for o in gate], "canary": [asdict(o) for o in canary]}))
    os.replace(staging, cache)
    return gate, canary


def interaction(outcome: EpisodeOutcome, difficulty: str | None) -> Interaction:
    """An evaluation episode as the monitors see live traffic: its first reply classified as if served."""
    return Interaction(outcome.action, outcome.malformed_tool_calls, outcome.tokens, difficulty, None)


def dodged(outcome: EpisodeOutcome) -> bool:
    """What a hack canary counts: the policy did not try (asked, or broke its tool call)."""
    return outcome.action in ("question", "malformed")
