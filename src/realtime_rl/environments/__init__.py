"""Coding environments: task directories, the synthetic task generator, the sandbox, tools, the agent loop.

    tasks = load_tasks("../shared/tasks/exercism-python")          # Exercism layout, read as it is
    generate_tasks(root, 1000, split="train")                       # synthetic tasks in the same layout
    with WarmPool(SandboxConfig()) as pool:
        result = run_episode(policy, tokenizer, tasks[0], pool, AgentConfig())
    grade(tasks[0], result.workspace.snapshot(), Sandbox())        # pristine tests, fresh sandbox
"""

from realtime_rl.environments.agent_loop import EpisodeResult, Policy, PolicyOutput, run_episode
from realtime_rl.environments.grading import GradeResult, grade, solution_files
from realtime_rl.environments.sandbox import IsolationLevel, RunResult, Sandbox, TestReport, WarmPool
from realtime_rl.environments.synthetic import SyntheticTask, generate_task, generate_tasks
from realtime_rl.environments.tasks import Task, load_task, load_tasks
from realtime_rl.environments.tools import TOOL_SCHEMAS, Tools, Workspace

__all__ = [
    "TOOL_SCHEMAS", "EpisodeResult", "GradeResult", "IsolationLevel", "Policy", "PolicyOutput", "RunResult",
    "Sandbox", "SyntheticTask", "Task", "TestReport", "Tools", "WarmPool", "Workspace", "generate_task",
    "generate_tasks", "grade", "load_task", "load_tasks", "run_episode", "solution_files",
]
