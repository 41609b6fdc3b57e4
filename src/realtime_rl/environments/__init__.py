"""Coding environments: task directories, the synthetic task generator, the sandbox, tools, the agent loop."""

from realtime_rl.environments.tasks import Task, load_task, load_tasks

__all__ = ["Task", "load_task", "load_tasks"]
