"""One simulated user against a real gateway: the official `openai` client for completions, POST /v1/feedback
for events, the sandbox for tests.

    delayed = DelayedFeedback(FeedbackSender(gateway_client(config), 10.0, 5, stats))   # sends events when due
    user = SimulatedUser(profile, config, sandbox, delayed, stats, stop)   # its own openai client and sender
    user.run_session(task)                                 # first turn as the agent loop prompts it, then react

A session's first request is the agent loop's first turn for the task (SYSTEM_PROMPT, task_prompt(task),
the tool specs), with `user`, `metadata` {task_id, difficulty, session_id} and an X-Session-Id header, so
the prompt tokens the gateway records are the loop's first-turn context. Each answer is applied to the
task's workspace with the agent's own tools, graded with the task's visible and hidden tests (grading.grade_settled,
a fresh sandbox), and reacted to (model.react). Events carry client-chosen ids made once, so a retry after a
503 or a dropped connection resends the same ids and the gateway stores each event once. Events due later
(edit_persisted after the window, a later revert) wait in DelayedFeedback, so the user moves on meanwhile.

Not here: threads, budgets and the summary (run.py).
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import random
import threading
import time
import uuid
from collections import Counter
from typing import Any

import httpx
import openai

from realtime_rl.config.users import SimulateUsersConfig
from realtime_rl.environments.agent_loop import first_turn_messages
from realtime_rl.environments.grading import grade_settled
from realtime_rl.environments.tasks import Task
from realtime_rl.environments.tools import (
    EDIT_TOOLS, QUESTION_TOOL, TOOL_SCHEMAS, TestRunner, ToolOutcome, Tools, Workspace,
)
from realtime_rl.environments.users.model import (
    Answer, EditOutcome, PlannedEvent, UserProfile, react, read_answer, style_violation,
)
from realtime_rl.types import FunctionCall, ToolCall

log = logging.getLogger(__name__)
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
MAX_BACKOFF_S = 5.0


class Stats:
    """Thread-safe counters shared by every user of a run."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self.counts)


def wire_event(event: PlannedEvent, *, user: str, session_id: str, completion_id: str | None,
               attributes: dict[str, str | int | float | bool], occurred_at: float) -> dict[str, Any]:
    """The POST /v1/feedback body of one event (OpenTelemetry keys), with a fresh client-chosen id."""
    body: dict[str, Any] = {
        "log.record.uid": uuid.uuid4().hex, "event.name": event.type, "gen_ai.response.id": completion_id,
        "gen_ai.conversation.id": session_id, "choice_index": 0 if completion_id else None,
        "window_s": event.window_s, "gen_ai.tool.name": event.tool_name, "error.type": event.error_type,
        "user.id": user, "timestamp": occurred_at, "attributes": attributes,
    }
    return {k: v for k, v in body.items() if v is not None}


class FeedbackSender:
    """POST /v1/feedback through an openai client's HTTP, with bounded retries of the same body on 429/5xx
    and connection errors (the client's own retries are off, so every attempt is counted here)."""

    def __init__(self, client: openai.OpenAI, timeout_s: float, retries: int, stats: Stats,
                 backoff_s: float = 0.2) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.retries = retries
        self.stats = stats
        self.backoff_s = backoff_s

    @property
    def longest_send_s(self) -> float:
        """The longest one send can take: every attempt timing out, with the backoff sleeps between them."""
        return self.timeout_s * (self.retries + 1) + self.retries * MAX_BACKOFF_S

    def send(self, events: list[dict[str, Any]]) -> bool:
        """Send events as one atomic batch; True once acknowledged (stored now or before, by a retry)."""
        if not events:
            return True
        body = events[0] if len(events) == 1 else {"events": events}
        why = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.stats.add("feedback_retries")
            wait = self.backoff_s * 2 ** attempt
            try:
                self.client.post("/feedback", cast_to=httpx.Response, body=body,
                                 options={"timeout": self.timeout_s, "max_retries": 0})
            except openai.APIStatusError as e:
                if e.status_code not in RETRY_STATUS:  # 4xx: the gateway refuses these events; a retry cannot help
                    log.warning("feedback refused (%d): %s", e.status_code, e.message[:500])
                    self.stats.add("feedback_refused", len(events))
                    return False
                why, wait = f"HTTP {e.status_code}", _retry_after(e.response) or wait
            except openai.APIConnectionError as e:  # refused, reset, timed out: resend the same ids
                why = f"{type(e).__name__}: {e}"
            else:
                for e in events:
                    self.stats.add(f"sent/{e['event.name']}")
                return True
            if attempt < self.retries:
                time.sleep(min(wait, MAX_BACKOFF_S))
        log.warning("feedback not acknowledged after %d attempts (%s)", self.retries + 1, why)
        self.stats.add("feedback_lost", len(events))
        return False


def _retry_after(response: Any) -> float | None:
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


class DelayedFeedback:
    """Events that fall due later, sent in due order from one thread."""

    def __init__(self, sender: FeedbackSender) -> None:
        self.sender = sender
        self._heap: list[tuple[float, int, dict[str, Any]]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="delayed-feedback", daemon=True)
        self._thread.start()

    def schedule(self, due: float, event: dict[str, Any]) -> None:
        with self._cond:
            if self._closing:
                raise RuntimeError("DelayedFeedback is closed")
            heapq.heappush(self._heap, (due, next(self._order), event))
            self._cond.notify()

    def close(self, wait_s: float) -> int:
        """Send what falls due within `wait_s`, drop the rest; return how many events were dropped (censored)."""
        deadline = time.time() + wait_s
        with self._cond:
            self._closing = True
            dropped = [e for e in self._heap if e[0] > deadline]
            self._heap = [e for e in self._heap if e[0] <= deadline]
            heapq.heapify(self._heap)
            self._cond.notify()
        self._thread.join(wait_s + self.sender.longest_send_s + 5)
        if self._thread.is_alive():  # a gateway that hangs: what has not gone out yet is censored, not an error
            with self._cond:
                dropped += self._heap
                self._heap = []
            log.warning("feedback still being sent %.0f s after close; %d due events are counted as censored",
                        wait_s + self.sender.longest_send_s + 5, len(dropped))
        return len(dropped)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.time():
                    if self._closing and not self._heap:
                        return
                    self._cond.wait(None if not self._heap else max(0.0, self._heap[0][0] - time.time()))
                _, _, event = heapq.heappop(self._heap)
            self.sender.send([event])


def gateway_client(config: SimulateUsersConfig, http_client: httpx.Client | None = None) -> openai.OpenAI:
    """The official client for the gateway; `http_client` (FastAPI's TestClient in tests) replaces its own."""
    return openai.OpenAI(base_url=f"{config.base_url}/v1", api_key=config.api_key, http_client=http_client,
                         timeout=config.request_timeout_s, max_retries=config.max_retries)


class SimulatedUser:
    """One developer: an openai client of its own, its profile and its random stream."""

    def __init__(self, profile: UserProfile, config: SimulateUsersConfig, sandbox: TestRunner,
                 delayed: DelayedFeedback, stats: Stats, stop: threading.Event,
                 http_client: httpx.Client | None = None) -> None:
        self.profile = profile
        self.config = config
        self.sandbox = sandbox
        self.delayed = delayed
        self.stats = stats
        self.stop = stop
        self.rng = random.Random(f"{config.seed}/{profile.user_id}")
        self.client = gateway_client(config, http_client)
        self.sender = FeedbackSender(self.client, config.feedback_timeout_s, config.feedback_retries, stats)

    def think(self) -> None:
        self.stop.wait(self.rng.uniform(*self.profile.think_time_s))

    def request(self, task: Task, session_id: str, messages: list[dict[str, Any]]) -> tuple[str, Answer]:
        """One completion, as the agent loop would prompt it; (completion id, choice 0 read)."""
        extra = {} if self.config.max_tokens is None else {"max_tokens": self.config.max_tokens}
        resp = self.client.chat.completions.create(
            model=self.config.model, messages=messages, tools=TOOL_SCHEMAS, user=self.profile.user_id,
            metadata={"task_id": task.task_id, "difficulty": str(task.metadata.get("difficulty", 0)),
                      "session_id": session_id},
            extra_headers={"X-Session-Id": session_id}, temperature=self.config.temperature, **extra)
        self.stats.add("completions")
        message = resp.choices[0].message
        calls = [ToolCall(id=c.id, function=FunctionCall(name=c.function.name, arguments=c.function.arguments))
                 for c in message.tool_calls or []]
        return resp.id, read_answer(message.content, calls)

    def run_session(self, task: Task) -> list[str]:
        """One session on `task`; returns the verdict of each answer (see model.react)."""
        user = self.profile.user_id
        session_id = f"{user}-{uuid.uuid4().hex[:16]}"
        attributes: dict[str, str | int | float | bool] = {
            "difficulty": int(task.metadata.get("difficulty", 0)), "task_id": task.task_id}
        workspace = Workspace(task.workspace())
        tools = Tools(workspace, task.test_files, self.sandbox, self.config.sandbox.wall_s)
        messages = first_turn_messages(task)
        verdicts: list[str] = []
        self.stats.add("sessions")
        for turn in range(self.profile.patience):
            if self.stop.is_set():
                break
            self.think()
            try:
                completion_id, answer = self.request(task, session_id, messages)
            except openai.APIError as e:  # refused, overloaded past retries, timed out: this session is over
                log.warning("%s: completion failed: %s", user, e)
                self.stats.add("errors")
                break
            self.stats.add(f"answers/{answer.kind}")
            self.think()
            before = workspace.snapshot()
            results = self._apply(tools, answer)
            outcome = self._check_edit(task, workspace, answer) if answer.kind == "edit" else None
            reaction = react(self.profile, answer, outcome, task, self.profile.patience - turn - 1, self.rng)
            verdicts.append(reaction.verdict)
            self._send(reaction.events, user, session_id, completion_id, attributes)
            if reaction.revert:
                workspace.files = before
            if reaction.reply is None and not reaction.continues:
                break
            messages += followup_messages(answer, results, reaction.reply)
        now = time.time()
        self.sender.send([wire_event(PlannedEvent("session_end"), user=user, session_id=session_id,
                                     completion_id=None, attributes=attributes, occurred_at=now)])
        return verdicts

    def _apply(self, tools: Tools, answer: Answer) -> dict[str, ToolOutcome]:
        """Run the answer's tool calls in order, as the agent's harness would (ask_user is answered later)."""
        results = {}
        for call in answer.tool_calls:
            if call.function.name == QUESTION_TOOL:
                continue
            try:
                results[call.id] = tools.call(call.function.name, call.function.arguments)
            except ValueError as e:  # arguments that are not a JSON object: the gateway should never send them
                results[call.id] = ToolOutcome(f"error: {e}", error=True)
        return results

    def _check_edit(self, task: Task, workspace: Workspace, answer: Answer) -> EditOutcome:
        """Grade the edited workspace (visible + hidden tests, fresh sandbox) and check the user's style on
        the files the edit touched."""
        result = grade_settled(task, workspace.snapshot(), self.sandbox, include_hidden=True,  # a starved run
                               timeout_s=self.config.sandbox.wall_s)  # is no reverted edit
        tests = set(task.test_files)
        touched = set()
        for call in answer.tool_calls:
            if call.function.name in EDIT_TOOLS:
                path = _path_of(call)
                if path in workspace.files and path.endswith(".py") and path not in tests:
                    touched.add(path)
        style = style_violation(self.profile.preference, {p: workspace.files[p] for p in touched})
        self.stats.add("edits_passed" if result.passed else "edits_failed")
        if style is not None:
            self.stats.add("style_violations")
        return EditOutcome(result.passed, result.tests_failed, result.errors, style)

    def _send(self, events: list[PlannedEvent], user: str, session_id: str, completion_id: str,
              attributes: dict[str, str | int | float | bool]) -> None:
        now = time.time()
        wire = [(e.delay_s, wire_event(e, user=user, session_id=session_id, completion_id=completion_id,
                                       attributes=attributes, occurred_at=now + e.delay_s)) for e in events]
        self.sender.send([w for delay, w in wire if delay <= 0])
        for delay, w in wire:
            if delay > 0:
                self.delayed.schedule(now + delay, w)


def followup_messages(answer: Answer, results: dict[str, ToolOutcome],
                      reply: str | None) -> list[dict[str, Any]]:
    """What a user appends to the conversation to ask for the next completion: the assistant's message, a tool
    message per call, and the user's reply (as the answer to ask_user when the assistant asked, none after a
    "working" answer, else as a user message). The pre-training corpus builds its follow-up documents with it
    (train/corpus.py)."""
    assistant: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.tool_calls:
        assistant["tool_calls"] = [c.model_dump() for c in answer.tool_calls]
    elif not answer.content:
        assistant["content"] = ""
    out = [assistant]
    for call in answer.tool_calls:
        content = reply if call.function.name == QUESTION_TOOL else results[call.id].content
        out.append({"role": "tool", "tool_call_id": call.id, "content": content})
    if answer.kind not in ("question", "working"):
        out.append({"role": "user", "content": reply})
    return out


def _path_of(call: ToolCall) -> str:
    try:
        return Workspace.normalize(json.loads(call.function.arguments).get("path", ""))
    except (ValueError, AttributeError):
        return ""
