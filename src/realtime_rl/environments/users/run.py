"""`rtrl simulate-users`: config.users simulated developers, one thread each, against a running gateway.

    summary = run_simulated_users(load_config(SimulateUsersConfig, path, overrides))

Users take sessions from one budget (config.sessions in total, or until config.duration_s passes, or
until `stop` is set) and pick a task at random each time. When the users are done, events still
waiting for their window (edit_persisted) are sent as they fall due, at most persist_window_s later;
those a `stop` cuts off are dropped and counted as censored. The summary is printed and returned:
sessions, completions, edits, kept, reverted, questions, malformed, dissatisfied, errors, requests/s.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from realtime_rl.config.users import SimulateUsersConfig
from realtime_rl.environments.sandbox import Sandbox
from realtime_rl.environments.synthetic import generate_tasks
from realtime_rl.environments.tasks import Task, generated_suite
from realtime_rl.environments.users.model import make_users
from realtime_rl.environments.users.session import (
    DelayedFeedback, FeedbackSender, SimulatedUser, Stats, gateway_client,
)


def load_user_tasks(config: SimulateUsersConfig) -> list[Task]:
    """The tasks in config.tasks_dir, generating config.task_count synthetic ones there if it holds none. Tasks
    generated here record their spec (.suite.json) and are generated again when it changes (a second run with
    another seed or difficulty used the first run's tasks); a folder of tasks from elsewhere is used as it is."""
    spec = {"count": config.task_count, "split": config.split, "seed": config.seed, "start": config.start,
            "difficulty": config.difficulty}
    return generated_suite(config.tasks_dir, spec, lambda folder: generate_tasks(
        folder, config.task_count, split=config.split, seed=config.seed, start=config.start,
        difficulty=config.difficulty), adopt_unrecorded=True)


class _Budget:
    """Sessions left to start, shared by the users."""

    def __init__(self, sessions: int | None, duration_s: float | None, stop: threading.Event) -> None:
        self.left = sessions
        self.deadline = None if duration_s is None else time.monotonic() + duration_s
        self.stop = stop
        self._lock = threading.Lock()

    def claim(self) -> bool:
        with self._lock:
            if self.stop.is_set() or (self.deadline is not None and time.monotonic() >= self.deadline):
                return False
            if self.left is not None:
                if self.left <= 0:
                    return False
                self.left -= 1
            return True


def _session_bound_s(config: SimulateUsersConfig) -> float:
    """The longest one session can take when every wait runs to its timeout."""
    request = config.request_timeout_s * (config.max_retries + 1)
    feedback = (config.feedback_timeout_s + 5) * (config.feedback_retries + 1)
    turn = request + 2 * config.think_time_s[1] + 3 * config.sandbox.wall_s + 2 * feedback
    return config.patience[1] * turn + feedback


def run_simulated_users(config: SimulateUsersConfig, console: Console | None = None, *,
                        http_client: httpx.Client | None = None, stop: threading.Event | None = None,
                        progress: bool = True) -> dict[str, Any]:
    """Run the users until the budget is spent; print and return the summary. `http_client` replaces the
    openai clients' own HTTP clients (tests pass FastAPI's TestClient); setting `stop` ends the run early;
    progress=False leaves out the progress bar (rich allows one live display: the demo keeps its own)."""
    console = console or Console()
    stop = stop or threading.Event()
    tasks = load_user_tasks(config)
    profiles = make_users(config)
    sandbox = Sandbox(config.sandbox)
    stats = Stats()
    feedback_client = gateway_client(config, http_client)
    delayed = DelayedFeedback(FeedbackSender(feedback_client, config.feedback_timeout_s, config.feedback_retries,
                                             stats))
    users = [SimulatedUser(p, config, sandbox, delayed, stats, stop, http_client) for p in profiles]
    budget = _Budget(config.sessions, config.duration_s, stop)
    failures: list[BaseException] = []
    console.print(f"{len(users)} simulated users -> {config.base_url} ({config.model}); {len(tasks)} tasks from "
                  f"{config.tasks_dir}; sandbox: {sandbox.isolation_label}")

    with Progress(console=console, transient=True, disable=not progress) as bar_display:
        bar = bar_display.add_task("sessions", total=config.sessions)

        def work(user: SimulatedUser) -> None:
            try:
                while budget.claim():
                    user.run_session(user.rng.choice(tasks))
                    bar_display.advance(bar)
            except BaseException as e:  # a bug, not a fault of the gateway: stop everyone and re-raise below
                failures.append(e)
                stop.set()

        start = time.monotonic()
        threads = [threading.Thread(target=work, args=(u,), name=u.profile.user_id, daemon=True) for u in users]
        for t in threads:
            t.start()
        try:  # each user's waits are bounded; this loop only keeps Ctrl-C responsive
            for t in threads:
                while t.is_alive():
                    t.join(0.5)
        except KeyboardInterrupt:
            stop.set()
        bound = _session_bound_s(config)
        for t in threads:
            t.join(bound)
            if t.is_alive():
                raise RuntimeError(f"simulated user {t.name} did not finish within {bound:.0f} s")
        elapsed = time.monotonic() - start
        censored = delayed.close(0.0 if stop.is_set() else config.persist_window_s + 1.0)
    if http_client is None:  # an injected client belongs to the caller
        for client in [feedback_client, *(u.client for u in users)]:
            client.close()
    if failures:
        raise failures[0]
    summary = summarize(stats, len(users), elapsed, censored)
    console.print(summary_table(summary))
    return summary


def summarize(stats: Stats, users: int, elapsed_s: float, censored: int) -> dict[str, Any]:
    c = stats.snapshot()
    sent = {k.removeprefix("sent/"): n for k, n in c.items() if k.startswith("sent/")}
    return {
        "users": users, "sessions": c["sessions"], "completions": c["completions"], "edits": c["answers/edit"],
        "edits_passed": c["edits_passed"], "kept": sent.get("edit_persisted", 0),
        "reverted": sent.get("edit_reverted", 0), "questions": c["answers/question"],
        "working": c["answers/working"], "malformed": c["answers/malformed"], "other": c["answers/other"],
        "dissatisfied": sent.get("followup_dissatisfied", 0),
        "errors": c["errors"] + c["feedback_lost"] + c["feedback_refused"],
        "requests_per_s": c["completions"] / elapsed_s if elapsed_s > 0 else 0.0,
        "events_sent": sum(sent.values()), "events_by_type": dict(sorted(sent.items())),
        "feedback_retries": c["feedback_retries"], "censored": censored, "elapsed_s": elapsed_s,
    }


def summary_table(summary: dict[str, Any]) -> Table:
    table = Table(title="simulated users")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in ("sessions", "completions", "edits", "kept", "reverted", "questions", "working", "malformed",
                "dissatisfied", "errors", "censored"):
        table.add_row(key, str(summary[key]))
    table.add_row("requests/s", f"{summary['requests_per_s']:.2f}")
    return table
