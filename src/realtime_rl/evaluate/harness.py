"""The eval harness: grade reference solutions or stubs, or run a policy through the agent loop.

    report = evaluate_solutions(tasks, "reference", sandbox, workers=2)
    report = evaluate_policy(tasks, make_policy, tokenizer, pool, sandbox, agent_config, samples=4)
    report.to_json()   # tasks, passed, failed, errors, pass_at_1, pass_at_k, per_task

Tasks run in parallel (threads: every test run is its own sandboxed process). A task "errors" when its
grading produced no verdict (timeout, or no test could even be collected), and "fails" when tests ran
and at least one failed. pass@k is the unbiased estimator of Chen et al. (2021) over n samples per task.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from realtime_rl.config import AgentConfig, EvalConfig
from realtime_rl.environments import Task
from realtime_rl.environments.agent_loop import Policy, run_episode
from realtime_rl.environments.grading import GradeResult, grade, grade_settled, solution_files
from realtime_rl.environments.tools import TestRunner
from realtime_rl.model.tokenizer import Tokenizer
from realtime_rl.types import Episode


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples (drawn from n with c correct) passes."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class TaskResult:
    task_id: str
    grades: list[GradeResult]
    episodes: list[dict[str, Any]] = field(default_factory=list)

    @property
    def num_passed(self) -> int:
        return sum(g.passed for g in self.grades)

    @property
    def errored(self) -> bool:
        return all(g.timed_out or (g.tests_passed + g.tests_failed == 0 and not g.passed) for g in self.grades)


@dataclass
class EvalReport:
    results: list[TaskResult]
    k: int

    def to_json(self) -> dict[str, Any]:
        n_tasks = len(self.results)
        errors = sum(r.errored for r in self.results)
        passed = sum(r.num_passed == len(r.grades) for r in self.results)
        p1 = [pass_at_k(len(r.grades), r.num_passed, 1) for r in self.results]
        pk = [pass_at_k(len(r.grades), r.num_passed, self.k) for r in self.results]
        return {
            "tasks": n_tasks,
            "passed": passed,
            "failed": n_tasks - passed - errors,
            "errors": errors,
            "samples": self.k,
            "pass_at_1": sum(p1) / max(n_tasks, 1),
            f"pass_at_{self.k}": sum(pk) / max(n_tasks, 1),
            "per_task": [
                {"task_id": r.task_id, "passed": r.num_passed, "samples": len(r.grades), "errored": r.errored,
                 "grades": [{k: v for k, v in asdict(g).items() if k != "output"} | {"output": g.output[-2000:]}
                            for g in r.grades],
                 "episodes": r.episodes}
                for r in self.results
            ],
        }


def evaluate_solutions(tasks: Sequence[Task], which: str, sandbox: TestRunner, workers: int = 2,
                       include_hidden: bool = True, timeout_s: float | None = None) -> EvalReport:
    """Grade every task's reference solution ("reference") or untouched stub ("stub")."""
    def one(task: Task) -> TaskResult:
        return TaskResult(task.task_id, [grade(task, solution_files(task, which), sandbox, include_hidden, timeout_s)])

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return EvalReport(list(pool.map(one, tasks)), k=1)


def episode_summary(episode: Episode) -> dict[str, Any]:
    return {"episode_id": episode.episode_id, "ended_by": episode.ended_by, "turns": episode.num_turns,
            "tool_calls": episode.num_tool_calls, "malformed_tool_calls": episode.malformed_tool_calls,
            "tool_errors": episode.tool_errors, "tokens": episode.num_tokens,
            "summaries": len(episode.summary_lengths), "passed": episode.passed,
            "first_reply": episode.metadata.get("first_reply"),
            "test_results": episode.metadata.get("test_results", []),
            "attempts": episode.metadata.get("attempts", 1)}


def evaluate_policy(
    tasks: Sequence[Task],
    make_policy: Callable[[int], Policy],
    tokenizer: Tokenizer,
    runner: TestRunner,
    grader: TestRunner,
    agent: AgentConfig,
    samples: int = 1,
    workers: int = 1,
    include_hidden: bool = True,
) -> EvalReport:
    """Run `samples` episodes per task and grade each in a fresh sandbox. The policy of sample i of task k is
    make_policy(k * samples + i): each episode gets its own index, for its own seed (task_seed). A grading that
    timed out is run once more: a run starved by a loaded machine (the gate shares it with serving) must not
    count as a failed solution in an evaluation the loop caches and compares every later candidate with; a
    solution that really loops times out twice."""
    jobs = [(task, k * samples + i) for k, task in enumerate(tasks) for i in range(samples)]

    def one(job: tuple[Task, int]) -> tuple[str, GradeResult, dict[str, Any]]:
        task, index = job
        result = run_episode(make_policy(index), tokenizer, task, runner, agent)
        g = grade_settled(task, result.workspace.snapshot(), grader, include_hidden, agent.test_timeout_s)
        result.episode.passed = g.passed
        return task.task_id, g, episode_summary(result.episode)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        outcomes = list(pool.map(one, jobs))
    by_task: dict[str, TaskResult] = {t.task_id: TaskResult(t.task_id, []) for t in tasks}
    for task_id, g, summary in outcomes:
        by_task[task_id].grades.append(g)
        by_task[task_id].episodes.append(summary)
    return EvalReport(list(by_task.values()), k=samples)


def run_eval(config: EvalConfig) -> dict[str, Any]:
    """`rtrl eval`: load the tasks, grade solutions or run the checkpoint's model, return the JSON report."""
    from realtime_rl.environments import load_tasks
    from realtime_rl.environments.policies import ModelPolicy, task_seed
    from realtime_rl.environments.sandbox import Sandbox, WarmPool
    from realtime_rl.environments.sandbox.pool import queue_wait_s
    from realtime_rl.model import load_checkpoint

    assert config.tasks is not None
    tasks = load_tasks(config.tasks)[: config.limit]
    sandbox = Sandbox(config.sandbox)
    if config.solutions is not None:
        report = evaluate_solutions(tasks, config.solutions, sandbox, config.workers, config.include_hidden,
                                    config.sandbox.wall_s)
    else:
        assert config.checkpoint is not None
        ckpt = load_checkpoint(config.checkpoint)
        if ckpt.tokenizer is None:
            raise ValueError(f"{config.checkpoint}: the checkpoint has no tokenizer.json; the agent needs one")
        model = ckpt.model

        def make_policy(i: int) -> Policy:
            return ModelPolicy(model, temperature=config.agent.temperature, seed=task_seed(config.seed, i))

        # every run warm, however long the queue (evaluate.gate says why)
        wait_s = queue_wait_s(config.workers, config.sandbox.pool_size, config.agent.test_timeout_s)
        with WarmPool(config.sandbox, slot_wait_s=wait_s) as pool:
            report = evaluate_policy(tasks, make_policy, ckpt.tokenizer, pool, sandbox, config.agent,
                                     config.samples, config.workers, config.include_hidden)
    out = report.to_json()
    out["isolation_level"] = str(sandbox.isolation_level.value)
    return out
