"""The continued-pre-training corpus: agent episodes on synthetic train tasks, as token sequences.

Each document is a real episode: a scripted policy drives the real agent loop (the same prompt,
tools, observations and token layout the policy will see later) against the real sandbox, writing
either the task's reference solution (expert) or one of its novice variants (novice), running the
tests, and then submitting or (sometimes) fixing the novice bug first:

    expert   write_file(reference) -> run_tests -> submit
    novice   write_file(buggy) -> run_tests -> [write_file(reference) -> run_tests ->] submit

The loss mask marks the assistant tokens, so pre-training learns to act, not to predict observations.
The expert fraction sets how good the base model is: RL later sharpens it toward the expert.
Only the train split is used; held-out structures never appear.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from realtime_rl.config import AgentConfig
from realtime_rl.environments import WarmPool, generate_task, load_task, run_episode
from realtime_rl.environments.agent_loop import SYSTEM_PROMPT, task_prompt
from realtime_rl.environments.policies import ScriptedPolicy
from realtime_rl.environments.tasks import Task
from realtime_rl.environments.tools import TOOL_SCHEMAS
from realtime_rl.model import Tokenizer, render_messages


@dataclass
class Document:
    token_ids: np.ndarray
    """int32 [T]."""
    loss_mask: np.ndarray
    """bool [T]: True on assistant (policy) tokens."""
    expert: bool


def _call(name: str, **arguments: str) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def episode_script(task: Task, expert: bool, fix_rate: float, rng: random.Random) -> list[str]:
    """The assistant turns of one expert or novice episode."""
    path = task.solution_files[0]
    reference = task.reference_solution()[path]
    if expert or not task.novice_files:
        return [_call("write_file", path=path, content=reference), _call("run_tests"), _call("submit")]
    buggy = task.read(rng.choice(task.novice_files))
    script = [_call("write_file", path=path, content=buggy), _call("run_tests")]
    if rng.random() < fix_rate:
        script += [_call("write_file", path=path, content=reference), _call("run_tests")]
    return script + [_call("submit")]


def synthetic_tasks(root: Path, count: int, max_difficulty: int, seed: int, start: int = 0) -> Iterator[Task]:
    """Train-split tasks written under root (difficulty cycles 1..max_difficulty), loaded back."""
    for i in range(start, start + count):
        difficulty = 1 + i % max_difficulty
        path = generate_task(i // max_difficulty, "train", seed, difficulty=difficulty).write(root)
        yield load_task(path)


def tokenizer_texts(tasks: list[Task], rng: random.Random) -> Iterator[str]:
    """Rendered conversations (with plausible observations) for training the tokenizer."""
    for task in tasks:
        expert = rng.random() < 0.5
        messages: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT},
                                {"role": "user", "content": task_prompt(task)}]
        for i, turn in enumerate(episode_script(task, expert, 0.5, rng)):
            messages.append({"role": "assistant", "content": turn})
            observation = "all tests passed: 3 passed, 0 failed, 0 errors" if expert else "tests failed: 1 passed, 2 failed"
            messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": observation})
        yield render_messages(messages, TOOL_SCHEMAS)
        yield task.reference_solution()[task.solution_files[0]] + "\n" + "\n".join(task.pristine_tests().values())


def build_documents(tasks: list[Task], tokenizer: Tokenizer, pool: WarmPool, expert_fraction: float,
                    fix_rate: float, seed: int) -> list[Document]:
    """Run one scripted episode per task through the real loop and sandbox; keep its tokens and mask."""
    rng = random.Random(seed)
    agent = AgentConfig(max_turns=8, max_new_tokens=4096, summary_trigger_tokens=65_536,
                        max_context_tokens=131_072, max_summaries=0)
    docs = []
    for task in tasks:
        expert = rng.random() < expert_fraction
        policy = ScriptedPolicy(tokenizer, episode_script(task, expert, fix_rate, rng))
        episode = run_episode(policy, tokenizer, task, pool, agent).episode
        for seg in episode.segments:
            docs.append(Document(seg.token_ids.astype(np.int32), seg.loss_mask.copy(), expert))
    return docs
