"""The continued-pre-training corpus: agent episodes on synthetic train tasks, as token sequences.

Two kinds of document, both real agent-loop token sequences (the same prompt, tools, observations and
token layout the policy will see later):

    episode  a scripted policy drives the whole loop against the real sandbox, writing the task's
             reference solution (expert) or one of its novice variants (novice), running the tests,
             then submitting or (sometimes) fixing the novice bug first:
                 expert   write_file(reference) -> run_tests -> submit
                 novice   write_file(buggy) -> run_tests -> [write_file(reference) -> run_tests ->] submit
    write    the first turn only: the task prompt, then write_file(reference or novice variant). These
             are dense in supervised tokens and teach the mapping from English stages to code lines;
             they need no sandbox, so many more tasks fit in the same budget. A share of them
             (`question_fraction`) asks the user a clarifying question instead (ask_user), as agents in
             the wild sometimes do: the base policy then has the behaviour a naive reward can inflate.
    followup a second turn, as the simulated users ask for it: the task prompt, a first turn that did not
             do the job (a novice write_file whose tests fail, or an ask_user question), the user's
             follow-up exactly as the users send it (users.react and users.followup_messages: "The
             tests fail ..., so I reverted your change. Please fix solution.py.", or the answer to the
             question), then write_file of the reference. The loss is on the second turn only. Without
             these a base trained on first turns breaks nearly every follow-up it is served.

Solutions are written without the stub's docstring (it restates the instructions: tokens to generate
that no test checks). The loss mask marks the assistant tokens, so pre-training learns to act, not to
predict observations. The expert fraction sets how good the base model is: RL later sharpens it toward
the expert. Only the train split is used; held-out structures never appear, nor the reserved ones where
`reserve_structures` keeps them for RL, nor, with `exclude_heldout_parts`, a longer structure that holds a
held-out one as consecutive stages.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import random
import re
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from realtime_rl.config import AgentConfig, SandboxConfig
from realtime_rl.environments import SyntheticTask, WarmPool, generate_task, run_episode
from realtime_rl.environments.agent_loop import first_turn_messages
from realtime_rl.environments.policies import ScriptedPolicy
from realtime_rl.environments.synthetic import train_indices
from realtime_rl.environments.synthetic_ops import NAME_STYLES, OPS
from realtime_rl.environments.tasks import Task
from realtime_rl.environments.tools import QUESTION_TOOL, TOOL_SCHEMAS, Tools, Workspace
from realtime_rl.environments.users import EditOutcome, UserProfile, followup_messages, react, read_answer
from realtime_rl.model import Tokenizer, parse_assistant, render_messages

CORPUS_FORMAT = 5  # 5: numbers tokenized whole with their space; a docstring wrapped at a hyphen rejoined without one
"""Bumped whenever the documents change for the same config (the corpus cache key includes it)."""
RENAME_FRACTION = 0.5
"""Share of tasks whose function gets a random name (see `renamed`)."""
NAME_WORDS = tuple(op.word for op in OPS)
SCRIPT_AGENT = AgentConfig(max_turns=8, max_new_tokens=4096, summary_trigger_tokens=65_536,
                           max_context_tokens=131_072, max_summaries=0)
_DOCSTRING = re.compile(r'\n[ \t]+""".*?"""', re.S)
T = TypeVar("T")


@dataclass
class Document:
    token_ids: np.ndarray
    """int32 [T]."""
    loss_mask: np.ndarray
    """bool [T]: True on assistant (policy) tokens."""
    expert: bool


class CorpusWorkers:
    """Maps a function over contiguous chunks of a list in `processes` spawned processes and concatenates the
    results in order: the corpus is the same for any number of processes (each chunk's randomness is drawn
    before, in order). One process runs the function here, on the whole list. A phase that takes longer than
    timeout_s, or a process that dies, is an error (concurrent.futures' TimeoutError, BrokenProcessPool), and
    leaving the `with` block on an error kills the processes still running."""

    def __init__(self, processes: int = 1, timeout_s: float = 3600.0) -> None:
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self.processes, self.timeout_s = processes, timeout_s
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> CorpusWorkers:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self._pool is None:
            return
        if exc_type is not None:  # a timeout or a failure: the work is abandoned, so is a chunk still running
            for process in list(self._pool._processes.values()):  # the executor has no public way to kill them
                process.kill()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool = None

    def map(self, fn: Callable[..., list[T]], items: Sequence[Any], *args: Any) -> list[T]:
        if self.processes == 1 or len(items) < 2 * self.processes:
            return fn(items, *args)
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"))
        bounds = np.linspace(0, len(items), self.processes + 1).round().astype(int)
        futures = [self._pool.submit(fn, items[a:b], *args) for a, b in itertools.pairwise(bounds)]
        deadline = time.monotonic() + self.timeout_s
        return [x for future in futures for x in future.result(timeout=max(0.0, deadline - time.monotonic()))]


def _call(name: str, **arguments: str) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def without_docstring(source: str) -> str:
    """The module with the function's docstring removed (the generated solutions have exactly one)."""
    return _DOCSTRING.sub("", source, count=1)


def commented(source: str, missing_stage: int | None = None, instructions: str = "") -> str:
    """The module with its docstring turned into one comment per stage, each above the stage's line.

    The docstring of a generated solution lists the stages in the instructions' words (", then "
    between them, no stage phrase holds one). Writing each stage as a comment first makes every
    constant a short copy: instructions -> comment (the same words), comment -> code (the line below).
    A comment starts with a capital where the instructions write the step so (a numbered list), so
    that it is the instructions' text exactly. A novice variant that dropped a stage's line
    (`missing_stage`, 0-based) keeps its comment.
    """
    lines = source.splitlines()
    end = next(i for i in range(1, len(lines)) if lines[i].rstrip().endswith('"""'))
    docstring = "\n".join(line.strip() for line in lines[1:end + 1])
    # Lines join with a space, but for a wrap textwrap made after a hyphen ("whitespace-" / "separated").
    summary = re.sub(r"(?<=\w-)\n(?=\w)", "", docstring).replace("\n", " ").strip('"')
    steps = summary.rsplit("; return the resulting ", 1)[0].split(", then ")
    body = lines[end + 1:]
    if len(body) not in (len(steps), len(steps) - 1) or (len(body) < len(steps) and missing_stage is None):
        return without_docstring(source)
    out, code = [lines[0]], iter(body)
    flat = " ".join(instructions.split())
    for i, step in enumerate(steps):
        step = step[:1].lower() + step[1:]
        if step[:1].upper() + step[1:] in flat:
            step = step[:1].upper() + step[1:]
        out.append(f"    # {step}")
        if len(body) == len(steps) or i != missing_stage:
            out.append(next(code))
    return "\n".join(out) + "\n"


def _reference(task: Task) -> str:
    """The reference solution as the scripted expert writes it, with stage comments."""
    return commented(task.reference_solution()[task.solution_files[0]], instructions=task.instructions)


def _novice(task: Task, novice_file: str) -> str:
    """A novice variant as the scripted novice writes it, with stage comments (kept for a skipped step)."""
    bug = next((b for b in task.metadata.get("novice_bugs", []) if b["file"] == novice_file), {})
    missing = bug["stage"] - 1 if bug.get("kind") == "missing_step" else None
    return commented(task.read(novice_file), missing, task.instructions)


def _solution(task: Task, expert: bool, rng: random.Random) -> str:
    """What the scripted agent writes: the reference, or one of the novice variants, with stage comments."""
    if expert or not task.novice_files:
        return _reference(task)
    return _novice(task, rng.choice(task.novice_files))


def classify_solution(task: Task, content: str | None) -> str:
    """Which of the corpus's solutions `content` is, up to trailing whitespace: "reference" (what the expert
    writes), "novice:<bug kind>" (a novice variant, as `_solution` writes it), "other" (neither: the model's
    own code), or "none" when nothing was written. Tells a base model that fails because it plays the novice
    (which RL toward the expert removes) from one that fails because it cannot write the program."""
    if content is None:
        return "none"

    def norm(source: str) -> str:
        return "\n".join(line.rstrip() for line in source.strip().splitlines())

    written = norm(content)
    if written == norm(_reference(task)):
        return "reference"
    for bug in task.metadata.get("novice_bugs", []):
        if written == norm(_novice(task, bug["file"])):
            return f"novice:{bug['kind']}"
    return "other"


def stage_comments(source: str) -> list[str]:
    """The comment lines of a module, in order, without `#` and surrounding space."""
    return [line.strip()[1:].strip() for line in source.splitlines() if line.strip().startswith("#")]


def wrong_stage_comment(task: Task, content: str | None) -> int | None:
    """The first stage (1-based) whose comment in `content` is not the one the corpus writes for the task
    (the instructions' step, case aside), 0 when every stage's is, None when nothing was written. A
    base whose stage comments come out right but whose program fails cannot write the stage's code;
    one that writes another stage's comment ("keep only the numbers greater than 12" where the
    instructions say "less than") did not copy the instructions, and the code below it follows the comment."""
    if content is None:
        return None
    expected = [c.lower() for c in stage_comments(_reference(task))]
    written = [c.lower() for c in stage_comments(content)]
    return next((i + 1 for i, (a, b) in enumerate(zip(expected, written)) if a != b),
                0 if len(written) == len(expected) else min(len(written), len(expected)) + 1)


def episode_script(task: Task, expert: bool, fix_rate: float, rng: random.Random) -> list[str]:
    """The assistant turns of one expert or novice episode."""
    path = task.solution_files[0]
    reference = _solution(task, True, rng)
    if expert or not task.novice_files:
        return [_call("write_file", path=path, content=reference), _call("run_tests"), _call("submit")]
    script = [_call("write_file", path=path, content=_solution(task, False, rng)), _call("run_tests")]
    if rng.random() < fix_rate:
        script += [_call("write_file", path=path, content=reference), _call("run_tests")]
    return script + [_call("submit")]


@dataclass(frozen=True)
class MemoryTask(Task):
    """A generated task read from memory: the corpus needs tens of thousands, and writing each as a
    directory costs more than generating it."""

    files: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

    @classmethod
    def of(cls, synthetic: SyntheticTask) -> MemoryTask:
        listed = json.loads(synthetic.files[".meta/config.json"])["files"]
        return cls(task_id=synthetic.slug, path=Path(synthetic.slug),
                   instructions=synthetic.files[".docs/instructions.md"],
                   solution_files=tuple(listed["solution"]), test_files=tuple(listed["test"]),
                   example_files=tuple(listed["example"]), hidden_test_files=tuple(listed.get("hidden_test", [])),
                   novice_files=tuple(listed.get("novice", [])), metadata=synthetic.metadata,
                   cases_file=listed.get("cases"), files=synthetic.files)

    def read(self, rel: str) -> str:
        return self.files[rel]

    def workspace(self) -> dict[str, str]:
        return {rel: text for rel, text in sorted(self.files.items()) if "/" not in rel and not rel.startswith(".")}


def renamed(task: SyntheticTask, name: str) -> SyntheticTask:
    """The same task with its function (and module, and test files) called `name`.

    A generated function's name is a function of its program's structure, so a small model learns to
    recall names instead of reading them, and on held-out structures it recalls a training name. Tasks
    with random names (random words of the same vocabulary) make copying the name from the prompt the
    only way to get it right."""
    old = task.metadata["function"]
    identifier = re.compile(rf"(?<![\w.]){re.escape(old)}(?=\(|\.py\b|_test\b|_hidden_test\b| import\b|$)", re.M)
    title = re.compile(rf"^# {re.escape(old.replace('_', ' ').capitalize())}$", re.M)
    files = {}
    for rel, text in task.files.items():
        text = identifier.sub(name, text)
        if rel == ".docs/instructions.md":
            text = title.sub(f"# {name.replace('_', ' ').capitalize()}", text, count=1)
        files[identifier.sub(name, rel)] = text
    config = json.loads(files[".meta/config.json"])
    config["rtrl"]["function"] = name
    files[".meta/config.json"] = json.dumps(config, indent=2) + "\n"
    if ".meta/cases.json" in task.files:  # its names are JSON strings; inputs and expected values stay as they were
        cases = json.loads(task.files[".meta/cases.json"])
        tests = {identifier.sub(name, rel): listed for rel, listed in cases["tests"].items()}
        files[".meta/cases.json"] = json.dumps({**cases, "module": name, "function": name, "tests": tests}) + "\n"
    return SyntheticTask(task.slug, files, config["rtrl"])


def _difficulty_cycle(max_difficulty: int, difficulty_weights: Sequence[int] | None) -> list[int]:
    weights = difficulty_weights or (1,) * max_difficulty
    return [d for d, weight in enumerate(weights, start=1) for _ in range(weight)]


def tasks_per_difficulty(count: int, max_difficulty: int,
                         difficulty_weights: Sequence[int] | None = None) -> dict[int, int]:
    """How many of synthetic_tasks' first `count` tasks are of each difficulty (so indices 0..n - 1 of
    difficulty d are what a corpus of `count` documents generated, without reserve_structures)."""
    cycle = _difficulty_cycle(max_difficulty, difficulty_weights)
    full, rest = divmod(count, len(cycle))
    return {d: full * cycle.count(d) + cycle[:rest].count(d) for d in range(1, max_difficulty + 1)}


def task_picks(count: int, max_difficulty: int, seed: int, start: int = 0, reserve_structures: bool = False,
               difficulty_weights: Sequence[int] | None = None,
               exclude_heldout_parts: bool = False) -> Iterator[tuple[int, int, int]]:
    """(position, difficulty, train index) of synthetic_tasks' tasks start..start+count-1: which task each
    document is, cheap to compute in order (synthetic_tasks renders them)."""
    cycle = _difficulty_cycle(max_difficulty, difficulty_weights)
    indices = {d: train_indices(seed, d, skip_reserved=reserve_structures, skip_heldout_parts=exclude_heldout_parts)
               for d in range(1, max_difficulty + 1)}
    for i in range(start + count):
        difficulty = cycle[i % len(cycle)]
        index = next(indices[difficulty])
        if i >= start:
            yield i, difficulty, index


def make_tasks(picks: Sequence[tuple[int, int, int]], seed: int) -> list[MemoryTask]:
    """The tasks of task_picks' picks, in memory; a RENAME_FRACTION of them renamed at random (the draw is
    the position's own, so any slice of the picks renders as the whole list would)."""
    tasks = []
    for i, difficulty, index in picks:
        task = generate_task(index, "train", seed, difficulty=difficulty)
        rng = random.Random(f"rename/{seed}/{i}")
        if rng.random() < RENAME_FRACTION:
            words = rng.sample(NAME_WORDS, rng.randint(1, 3))
            task = renamed(task, rng.choice(NAME_STYLES).format("_".join(words)))
        tasks.append(MemoryTask.of(task))
    return tasks


def synthetic_tasks(count: int, max_difficulty: int, seed: int, start: int = 0,
                    reserve_structures: bool = False,
                    difficulty_weights: Sequence[int] | None = None,
                    exclude_heldout_parts: bool = False) -> Iterator[Task]:
    """Train-split tasks start..start+count-1 (difficulty cycles 1..max_difficulty, or takes
    difficulty_weights[d - 1] tasks of each difficulty d per cycle), in memory; a RENAME_FRACTION of them
    renamed at random. reserve_structures: skip the reserved structures' tasks (left for RL);
    exclude_heldout_parts: skip the tasks whose structure holds a held-out structure as consecutive stages
    (synthetic_index.holds_heldout_part; difficulty 3 and up); either cycles through a difficulty's other
    tasks when they run out."""
    for pick in task_picks(count, max_difficulty, seed, start, reserve_structures, difficulty_weights,
                           exclude_heldout_parts):
        yield from make_tasks([pick], seed)


def tokenizer_texts(tasks: list[Task], rng: random.Random) -> Iterator[str]:
    """Rendered conversations (with plausible observations) for training the tokenizer."""
    for task in tasks:
        expert = rng.random() < 0.5
        messages = first_turn_messages(task)
        for i, turn in enumerate(episode_script(task, expert, 0.5, rng)):
            messages.append({"role": "assistant", "content": turn})
            observation = "all tests passed: 3 passed, 0 failed, 0 errors" if expert else "tests failed: 1 passed, 2 failed"
            messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": observation})
        yield render_messages(messages, TOOL_SCHEMAS)
        yield task.reference_solution()[task.solution_files[0]] + "\n" + "\n".join(task.pristine_tests().values())


def build_documents(tasks: list[Task], tokenizer: Tokenizer, expert_fraction: float, fix_rate: float, seed: int,
                    workers: CorpusWorkers | None = None) -> list[Document]:
    """Run one scripted episode per task through the real loop and sandbox; keep its tokens and mask. The
    scripts are drawn here, in order; the episodes run in `workers` (each process with its own sandbox)."""
    rng = random.Random(seed)
    scripted = []
    for task in tasks:
        expert = rng.random() < expert_fraction
        scripted.append((task, expert, episode_script(task, expert, fix_rate, rng)))
    return (workers or CorpusWorkers(1)).map(_episode_documents, scripted, tokenizer)


def _episode_documents(scripted: Sequence[tuple[Task, bool, list[str]]], tokenizer: Tokenizer) -> list[Document]:
    docs = []
    with WarmPool(SandboxConfig(pool_size=1)) as pool:
        for task, expert, script in scripted:
            episode = run_episode(ScriptedPolicy(tokenizer, script), tokenizer, task, pool, SCRIPT_AGENT).episode
            for seg in episode.segments:
                docs.append(Document(seg.token_ids.astype(np.int32), seg.loss_mask.copy(), expert))
    return docs


QUESTIONS = (
    "Should {fn} handle an empty input?",
    "What should {fn} return when there is nothing to process?",
    "Is it fine to modify the input in {fn}, or should I copy it first?",
    "Can the input to {fn} contain negative numbers?",
    "Do you want me to keep the existing signature of {fn}?",
)
"""Clarifying questions of the kind agents ask before a risky edit (none is needed: the tasks are specified)."""


def clarifying_question(task: Task, rng: random.Random) -> str:
    return rng.choice(QUESTIONS).format(fn=task.metadata.get("function", "the function"))


def build_write_documents(tasks: list[Task], tokenizer: Tokenizer, expert_fraction: float,
                          seed: int, question_fraction: float = 0.0,
                          workers: CorpusWorkers | None = None) -> list[Document]:
    """One first-turn document per task: the loop's prompt, then write_file of the reference (expert) or a
    novice variant, or (question_fraction) an ask_user question, cut after the assistant's turn. No test
    runs, so no sandbox. The turns are drawn here, in order; `workers` tokenize them."""
    rng = random.Random(seed)
    turns = []
    for task in tasks:
        expert = rng.random() < expert_fraction
        if rng.random() < question_fraction:
            turn = _call("ask_user", question=clarifying_question(task, rng))
        else:
            turn = _call("write_file", path=task.solution_files[0], content=_solution(task, expert, rng))
        turns.append((task, expert, turn))
    return (workers or CorpusWorkers(1)).map(_write_documents, turns, tokenizer)


def _write_documents(turns: Sequence[tuple[Task, bool, str]], tokenizer: Tokenizer) -> list[Document]:
    docs = []
    for task, expert, turn in turns:
        episode = run_episode(ScriptedPolicy(tokenizer, [turn]), tokenizer, task, None,
                              SCRIPT_AGENT.model_copy(update={"max_turns": 1})).episode
        seg = episode.segments[0]
        end = int(np.flatnonzero(seg.loss_mask)[-1]) + 1
        docs.append(Document(seg.token_ids[:end].astype(np.int32), seg.loss_mask[:end].copy(), expert))
    return docs


def build_followup_documents(tasks: list[Task], tokenizer: Tokenizer, seed: int,
                             question_fraction: float = 0.0) -> list[Document]:
    """One second-turn document per task (see the module docstring): the prompt is rendered as the gateway
    renders the follow-up request (render_messages with the generation prompt), the target is the reference
    write_file and the stop token. A task without novice variants gets the question path."""
    rng = random.Random(seed)
    user = UserProfile(user_id="corpus", preference="none", patience=2, think_time_s=(0.0, 0.0),
                       persist_window_s=1.0, p_style_revert=0.0, p_malformed_complaint=1.0, followup_on_failure=True)
    docs = []
    for task in tasks:
        path = task.solution_files[0]
        if rng.random() < question_fraction or not task.novice_files:
            first = _call("ask_user", question=clarifying_question(task, rng))
        else:
            first = _call("write_file", path=path, content=_solution(task, False, rng))
        parsed = parse_assistant(first, TOOL_SCHEMAS)
        answer = read_answer(parsed.content or None, parsed.tool_calls)
        tools = Tools(Workspace(task.workspace()), task.test_files, None)
        results = {c.id: tools.call(c.function.name, c.function.arguments) for c in answer.tool_calls
                   if c.function.name != QUESTION_TOOL}
        outcome = EditOutcome(False, rng.randint(1, 3), 0, None) if answer.kind == "edit" else None
        reaction = react(user, answer, outcome, task, turns_left=1, rng=rng)
        assert reaction.reply is not None, "a user with turns left follows up a failed edit and a question"
        messages = first_turn_messages(task) + followup_messages(answer, results, reaction.reply)
        prompt = tokenizer.encode(render_messages(messages, TOOL_SCHEMAS, add_generation_prompt=True))
        target = tokenizer.encode(_call("write_file", path=path, content=_solution(task, True, rng)))
        target.append(tokenizer.im_end_id)
        mask = np.r_[np.zeros(len(prompt), bool), np.ones(len(target), bool)]
        docs.append(Document(np.array(prompt + target, dtype=np.int32), mask, True))
    return docs


def shared_prefix_length(docs: list[Document], limit: int) -> int:
    """Tokens every document starts with (the system prompt and tool schemas), at most `limit`, ending
    before the input that predicts a document's first masked token (the prefix runs without the LM head)."""
    first = docs[0].token_ids[:limit]
    n = len(first)
    for d in docs[1:]:
        m = min(n, len(d.token_ids))
        differ = np.flatnonzero(d.token_ids[:m] != first[:m])
        n = int(differ[0]) if len(differ) else m
    masked = [int(np.flatnonzero(d.loss_mask)[0]) - 1 for d in docs if d.loss_mask.any()]
    return max(0, min([n, *masked]))
