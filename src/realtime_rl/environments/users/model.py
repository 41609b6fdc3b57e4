"""What a simulated user is, how it reads an answer, and what it does about it: pure functions, no I/O.

    users = make_users(config)                                   # stable ids, style preference, patience
    answer = read_answer(content, tool_calls)                   # edit | question | working | malformed | other
    outcome = EditOutcome(passed, failed, errors, style_violation(user.preference, touched_files))
    reaction = react(user, answer, outcome, task, turns_left, rng)
    reaction.events                                             # feedback to send now or after a delay
    reaction.reply                                              # the user's next message; None ends the session

The reactions, by answer:
- an edit (write_file / edit_file) that passes the visible and hidden tests and keeps the user's style:
  edit_accepted now, edit_persisted after the persist window;
- an edit that passes but breaks the style preference: edit_accepted, then with probability
  p_style_revert an edit_reverted within the window (else edit_persisted after it);
- an edit that fails: edit_accepted, edit_reverted, followup_dissatisfied, and (while patience lasts and
  followup_on_failure) a follow-up saying the tests fail;
- ask_user: followup_neutral, and the user answers the question (the next completion is treated alike);
- only tools that inspect (list_files, read_file, run_tests): no event; the user's harness sends their results
  back and asks for the next completion, as an agent product does (the system prompt asks the agent to read
  the task and run the tests), without a user message; once patience is spent, followup_dissatisfied (the
  agent only ever looked);
- a malformed tool call (the gateway answered it as content): tool_call_error per broken call, and with
  probability p_malformed_complaint a followup_dissatisfied with a follow-up asking to retry;
- anything else: followup_dissatisfied and a follow-up asking for the change.

Not here: HTTP, the sandbox, time (session.py), threads (run.py).
"""

from __future__ import annotations

import ast
import random
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from realtime_rl.config.users import SimulateUsersConfig, StylePreference
from realtime_rl.environments.tasks import Task
from realtime_rl.environments.tools import EDIT_TOOLS, INSPECT_TOOLS, QUESTION_TOOL, TOOL_SCHEMAS
from realtime_rl.model.chat import parse_assistant
from realtime_rl.types import ToolCall, ToolCallError

AnswerKind = Literal["edit", "question", "working", "malformed", "other"]
Verdict = Literal["kept", "reverted", "failed", "question", "working", "malformed", "other"]
NEUTRAL_ANSWER = "No further constraints: follow the instructions and make the visible tests pass."
_TOOL_NAME = re.compile(r'"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"')


@dataclass(frozen=True)
class UserProfile:
    user_id: str
    """Stable across runs with the same seed (A/B arms and per-user adaptation key on it)."""
    preference: StylePreference
    """What the user wants of code besides passing tests; checked by `style_violation`."""
    patience: int
    """Completions the user requests in one session before giving up."""
    think_time_s: tuple[float, float]
    persist_window_s: float
    p_style_revert: float
    p_malformed_complaint: float
    followup_on_failure: bool


def make_users(config: SimulateUsersConfig) -> list[UserProfile]:
    """config.users profiles, deterministic in config.seed."""
    rng = random.Random(f"users/{config.seed}")
    preferences, weights = zip(*config.style_mix.items())
    prefix = "sim-user-" if config.seed == 0 else f"sim-user-s{config.seed}-"
    return [UserProfile(
        user_id=f"{prefix}{i:03d}", preference=rng.choices(preferences, weights)[0],
        patience=rng.randint(*config.patience), think_time_s=config.think_time_s,
        persist_window_s=config.persist_window_s, p_style_revert=config.p_style_revert,
        p_malformed_complaint=config.p_malformed_complaint, followup_on_failure=config.followup_on_failure,
    ) for i in range(config.users)]


# ---------------------------------------------------------------------------------------------- answers


@dataclass
class Answer:
    kind: AnswerKind
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    """Well-formed calls, as the gateway returned them (finish_reason "tool_calls")."""
    errors: list[ToolCallError] = field(default_factory=list)
    """Malformed calls the user's harness found in the content."""


def read_answer(content: str | None, tool_calls: list[ToolCall] | None) -> Answer:
    """Classify choice 0 of a completion. The gateway returns well-formed calls as `tool_calls` and a
    message with any malformed call as plain content; the harness parses that content to report the error."""
    if tool_calls:
        names = {c.function.name for c in tool_calls}
        kind: AnswerKind = ("edit" if names & EDIT_TOOLS else "question" if QUESTION_TOOL in names
                            else "working" if names <= INSPECT_TOOLS else "other")
        return Answer(kind, content, list(tool_calls))
    errors = parse_assistant(content or "", TOOL_SCHEMAS).errors
    return Answer("malformed" if errors else "other", content, errors=errors)


def broken_tool_name(error: ToolCallError) -> str | None:
    """The tool a malformed call meant, when its text names one."""
    match = _TOOL_NAME.search(error.raw)
    return match.group(1) if match else None


# ---------------------------------------------------------------------------------------------- style


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _unannotated(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = fn.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []),
              *([a.kwarg] if a.kwarg else [])]
    missing = [p.arg for p in params if p.annotation is None and p.arg not in ("self", "cls")]
    return missing + (["return"] if fn.returns is None else [])


_PARSE_LOCK = threading.Lock()
"""CPython 3.11 keeps one recursion counter for the AST constructor per interpreter, so two threads parsing at once
can fail with "SystemError: AST constructor recursion depth mismatch" (it stopped a learn bench's rollout worker
when grading read values back with ast.literal_eval); simulated users run in threads."""


def style_violation(preference: StylePreference, files: Mapping[str, str]) -> str | None:
    """Why the code in `files` breaks the preference, or None. Code that does not parse is not judged on
    style (its tests fail anyway)."""
    if preference == "none":
        return None
    for path, source in sorted(files.items()):
        try:
            with _PARSE_LOCK:
                tree = ast.parse(source)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        for fn in _functions(tree):
            if preference == "type_hints" and _unannotated(fn):
                return f"{path}: {fn.name} lacks type hints for {', '.join(_unannotated(fn))}"
            if preference == "docstring" and ast.get_docstring(fn) is None:
                return f"{path}: {fn.name} has no docstring"
        if preference == "no_print":
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                    return f"{path}: line {node.lineno} calls print"
    return None


# ---------------------------------------------------------------------------------------------- reactions


@dataclass(frozen=True)
class EditOutcome:
    """What the user found after applying an edit: the grade (visible + hidden tests) and the style check."""

    passed: bool
    tests_failed: int = 0
    errors: int = 0
    style_violation: str | None = None


@dataclass(frozen=True)
class PlannedEvent:
    """A feedback event about the completion just read, `delay_s` seconds from now."""

    type: str
    delay_s: float = 0.0
    window_s: float | None = None
    tool_name: str | None = None
    error_type: str | None = None


@dataclass
class Reaction:
    verdict: Verdict
    events: list[PlannedEvent]
    reply: str | None
    """The user's next message in the session (the answer to ask_user, else a follow-up); None: the session ends,
    unless `continues`."""
    revert: bool = False
    """The user undid the edit: the workspace goes back to what it was before it."""
    continues: bool = False
    """The harness asks for the next completion with the tool results and no user message (a "working" answer)."""


def react(user: UserProfile, answer: Answer, outcome: EditOutcome | None, task: Task, turns_left: int,
          rng: random.Random) -> Reaction:
    """The user's reaction to one answer. `turns_left`: completions the user will still ask for in this
    session (0: no follow-up). `rng` is drawn only for the coin flips the path needs."""
    solution = task.solution_files[0]
    can_reply = turns_left > 0
    window = user.persist_window_s
    if answer.kind == "edit":
        if outcome is None:
            raise ValueError("an edit answer needs the EditOutcome of applying and testing it")
        accepted = PlannedEvent("edit_accepted")
        if outcome.passed and (outcome.style_violation is None or rng.random() >= user.p_style_revert):
            return Reaction("kept", [accepted, PlannedEvent("edit_persisted", delay_s=window, window_s=window)], None)
        if outcome.passed:  # works, but not how this user writes code: undone before the window closes
            after = rng.uniform(0.2, 0.8) * window
            return Reaction("reverted", [accepted, PlannedEvent("edit_reverted", delay_s=after, window_s=after)],
                            None, revert=True)
        reply = None
        if can_reply and user.followup_on_failure:
            reply = (f"The tests fail ({outcome.tests_failed} failed, {outcome.errors} errors), so I reverted "
                     f"your change. Please fix {solution}.")
        events = [accepted, PlannedEvent("edit_reverted"), PlannedEvent("followup_dissatisfied")]
        return Reaction("failed", events, reply, revert=True)
    if answer.kind == "question":
        return Reaction("question", [PlannedEvent("followup_neutral")], NEUTRAL_ANSWER if can_reply else None)
    if answer.kind == "working":  # the user gives up when the agent is still only looking at the end of patience
        return Reaction("working", [] if can_reply else [PlannedEvent("followup_dissatisfied")], None,
                        continues=can_reply)
    if answer.kind == "malformed":
        events = [PlannedEvent("tool_call_error", tool_name=broken_tool_name(e), error_type=e.kind)
                  for e in answer.errors]
        if rng.random() >= user.p_malformed_complaint:
            return Reaction("malformed", events, None)
        reply = f"Your tool call was broken ({answer.errors[0].message}). Try again." if can_reply else None
        return Reaction("malformed", [*events, PlannedEvent("followup_dissatisfied")], reply)
    reply = f"That is not what I asked for: edit {solution} so that the tests pass." if can_reply else None
    return Reaction("other", [PlannedEvent("followup_dissatisfied")], reply)
