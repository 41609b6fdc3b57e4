"""A rollout worker: one engine, a warm sandbox pool, and episodes in flight on threads.

    worker = RolloutWorker(checkpoint_dir, RolloutConfig(), worker_id=0, seed=0)
    worker.set_weights(state, version)           # staged; the engine swaps between decode steps
    episodes = worker.run_group(GroupJob(...))   # group_size graded episodes of one task
    worker.close()

The same class runs inside a local worker process (local.py) and inside a Ray actor (ray_actors.py).
Episodes of all groups in flight share the engine's continuous batch, so a worker with 16 episodes
in flight decodes 16 rows per step. Tokens keep the version that produced them: a weight update
arriving mid-episode applies at the next decode step, and the rest of the episode is sampled from it.
Grading runs the task's pristine (and hidden) tests in a fresh sandbox, as the eval harness does.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from realtime_rl.config import RolloutConfig
from realtime_rl.engine import AsyncEngine, Engine, EnginePolicy
from realtime_rl.environments import Sandbox, Task, WarmPool, generate_task, load_task, run_episode
from realtime_rl.environments.grading import GradeCache, grade_settled
from realtime_rl.environments.agent_loop import PolicyOutput
from realtime_rl.environments.policies import task_seed
from realtime_rl.environments.synthetic import SyntheticTask, holds_heldout_part, pick, split_size
from realtime_rl.model import load_checkpoint
from realtime_rl.types import Episode


@dataclass(frozen=True)
class GroupJob:
    """group_size episodes of synthetic train task `task_index` (difficulty given), one GRPO group."""

    group_id: str
    task_index: int
    difficulty: int
    group_size: int
    seed: int
    started_version: int
    """The trainer's version when the orchestrator admitted the group (for staleness accounting)."""
    episodes: tuple[int, int] | None = None
    """The [start, stop) range of the group's episode indices this job runs (None: all group_size). A group spread
    over workers is one job per shard; episode i samples with the same seeds on whichever worker runs it."""

    @property
    def indices(self) -> range:
        return range(self.group_size) if self.episodes is None else range(*self.episodes)


def shard(job: GroupJob, shards: int) -> list[GroupJob]:
    """The job as `shards` jobs (at most one per episode) of consecutive episode indices, sizes within one."""
    shards = max(1, min(shards, job.group_size))
    if shards == 1:
        return [job]
    bounds = [round(k * job.group_size / shards) for k in range(shards + 1)]
    return [replace(job, episodes=(bounds[k], bounds[k + 1])) for k in range(shards)]


HOLDING_STRIDE = 1_000_003
"""How far job_task moves past a task that holds a held-out part: past the tasks of any run's groups."""


def job_task(job: GroupJob, rollout: RolloutConfig) -> SyntheticTask:
    """The synthetic task of a group: task_index of rollout.split at the job's difficulty, wrapping around
    past the end of that pool. A task whose structure holds a held-out structure as consecutive stages
    (difficulty 3 and up: `filter:gt -> map:mul -> reduce:sum` holding a held-out `filter:gt -> map:mul`)
    would train the held-out pair that evaluation measures, so another task is drawn instead, HOLDING_STRIDE
    indices on: far from the indices the next groups get (the next index is the next group's task). Such
    structures are most often of integer lists, so the input types of difficulty 3 and up shift a little."""
    size = split_size(rollout.split, job.difficulty)
    for step in range(size):
        index = (job.task_index + step * HOLDING_STRIDE) % size
        if not holds_heldout_part(pick(index, rollout.split, rollout.task_seed, job.difficulty).ops):
            return generate_task(index, rollout.split, rollout.task_seed, difficulty=job.difficulty)
    raise ValueError(f"every {rollout.split} task of difficulty {job.difficulty} holds a held-out structure")


class _LatentPolicy:
    """Adds simulated tool latency before every turn after the first (the previous turn's tools 'ran'), and
    times the policy's calls (the engine: queued, prefilled, decoded)."""

    def __init__(self, policy: EnginePolicy, latency_s: float) -> None:
        self.policy, self.latency_s, self.turns = policy, latency_s, 0
        self.policy_s = 0.0

    def generate(self, context_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> PolicyOutput:
        if self.turns and self.latency_s:
            time.sleep(self.latency_s)
        self.turns += 1
        t0 = time.perf_counter()
        try:
            return self.policy.generate(context_ids, max_new_tokens, stop_ids)
        finally:
            self.policy_s += time.perf_counter() - t0


class RolloutWorker:
    def __init__(self, checkpoint_dir: str | Path, config: RolloutConfig, worker_id: int = 0, seed: int = 0) -> None:
        if config.agent.attempts != 1:  # RolloutConfig refuses it; a model_copy(update=...) skips that check
            raise ValueError(f"rollout.agent.attempts is {config.agent.attempts}: "
                             "RL trains one-attempt episodes")
        torch.set_num_threads(config.threads_per_worker)
        ckpt = load_checkpoint(checkpoint_dir, device=config.device, dtype=getattr(torch, config.dtype))
        if ckpt.tokenizer is None:
            raise ValueError(f"{checkpoint_dir}: the checkpoint has no tokenizer")
        self.tokenizer = ckpt.tokenizer
        self.config = config
        self.worker_id = worker_id
        engine = Engine(ckpt.model, ckpt.tokenizer, max_batch=config.episodes_in_flight,
                        max_seq_len=config.agent.max_context_tokens, seed=seed + 7919 * worker_id,
                        prefix_max_age=config.prefix_max_age or 0, compile_decode=config.compile_decode,
                        cascade_decode=config.cascade_decode, graphs=None if config.cuda_graphs else False,
                        prefill_wait_ms=config.prefill_wait_ms)
        self.engine = AsyncEngine(engine, max_pending=4 * config.episodes_in_flight).start()
        self.pool = WarmPool(config.sandbox)
        self.grader = GradeCache(Sandbox(config.sandbox))  # a group's identical workspaces are graded once
        self.episodes = ThreadPoolExecutor(config.episodes_in_flight, thread_name_prefix=f"rollout-{worker_id}")
        self._tasks_dir = Path(tempfile.mkdtemp(prefix=f"rtrl-rollout-{worker_id}-"))
        self._lock = threading.Lock()
        self.generated_tokens = 0
        self._started = time.perf_counter()
        self._episode_s = {"episode_s": 0.0, "policy_s": 0.0, "grade_s": 0.0}  # summed over episodes

    @property
    def version(self) -> int:
        return self.engine.version

    def report(self) -> dict[str, float]:
        """Tokens sampled so far, the seconds since the worker started, the episodes' seconds summed (whole,
        waiting on the policy, grading) and the engine's cumulative EngineStats: what the orchestrator's
        rollout/* metrics of where the time went are computed from (RolloutBackend.engine_metrics)."""
        with self._lock:
            return {"generated_tokens": self.generated_tokens, "wall_s": time.perf_counter() - self._started,
                    **self._episode_s, **asdict(self.engine.engine.stats)}

    def set_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.engine.update_weights(state, version)

    def run_group(self, job: GroupJob) -> list[Episode]:
        """The job's episodes of its group (job.indices, in that order), graded; its task's files (read while it
        runs) are removed when it ends."""
        root = self._tasks_dir / f"{job.group_id}-{job.indices[0]}"  # two shards of a group may share a worker
        try:
            return self._run_group(job, load_task(job_task(job, self.config).write(root)))
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def _run_group(self, job: GroupJob, task: Task) -> list[Episode]:
        agent = self.config.agent

        def one(i: int) -> Episode:
            # Each episode its own block of turn seeds: seed + i with +1 per turn gave episode i's second turn
            # the random numbers of episode i + 1's first.
            seed = task_seed(0, job.seed * job.group_size + i)
            policy = _LatentPolicy(EnginePolicy(self.engine, temperature=self.config.temperature, seed=seed,
                                                timeout_s=self.config.timeout_s), self.config.tool_latency_s)
            t0 = time.perf_counter()
            result = run_episode(policy, self.tokenizer, task, self.pool, agent, episode_id=f"{job.group_id}-{i}")
            t1 = time.perf_counter()
            # a grading starved by the loaded machine runs once more: trained as a failure, it taught the reverse
            g = grade_settled(task, result.workspace.snapshot(), self.grader, include_hidden=True,
                              timeout_s=agent.test_timeout_s)
            episode = result.episode
            episode.group_id, episode.passed = job.group_id, g.passed
            episode.metadata.update(started_version=job.started_version, worker=self.worker_id,
                                    tests_passed=g.tests_passed, tests_failed=g.tests_failed,
                                    tests_errors=g.errors)
            with self._lock:
                self.generated_tokens += episode.num_generated
                times = self._episode_s
                times["episode_s"] += t1 - t0
                times["policy_s"] += policy.policy_s
                times["grade_s"] += time.perf_counter() - t1
            return episode

        return list(self.episodes.map(one, job.indices))

    def close(self) -> None:
        self.episodes.shutdown(wait=False, cancel_futures=True)
        self.engine.stop()
        self.pool.close()
        shutil.rmtree(self._tasks_dir, ignore_errors=True)


def new_group_id() -> str:
    return uuid.uuid4().hex[:16]
