"""Rollout workers as Ray actors: weights and trajectories travel through Ray's object store.

Weights go through `realtime_rl.deploy`'s RayTransport: the trainer's WeightPublisher puts each
version's lossless delta (and periodic snapshots) into the object store through a named directory
actor, and each worker's WeightSubscriber follows the chain into its engine's hot swap. A finished
group comes back as the result of `run_group.remote(job)` (episode bytes, no pickle of our classes). Actors are threaded (max_concurrency) so several groups share one
engine batch and a weight update is not stuck behind a running group. Connects to a running cluster
if `ray.is_initialized()`, otherwise starts a local one with `ray.init(num_cpus=...)`.

Each actor keeps its work and sandbox directories in a scratch directory of its own (its process's TMPDIR),
removed when it closes. An actor that dies or is killed cannot remove it: `RayBackend.close` then removes it
with a task pinned to the actor's node, so a killed actor leaves nothing in the node's /tmp.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch

from realtime_rl.config import RolloutConfig
from realtime_rl.deploy import TransportError, WeightPublisher, WeightSubscriber
from realtime_rl.environments.sandbox.launch import remove_tree
from realtime_rl.rollout.base import RolloutBackend, groups_per_worker, publish_dtype, short
from realtime_rl.rollout.worker import GroupJob, RolloutWorker
from realtime_rl.types import Episode, episode_from_bytes, episode_to_bytes

log = logging.getLogger(__name__)


class _Actor:
    def __init__(self, checkpoint_dir: str, config: RolloutConfig, worker_id: int, seed: int, weights: str) -> None:
        import ray

        from realtime_rl.deploy import RayTransport

        self.node_id = ray.get_runtime_context().get_node_id()
        # The actor owns its process: its work and sandbox directories go under a scratch directory of its own.
        self.scratch = tempfile.mkdtemp(prefix=f"rtrl-worker-{worker_id}-")
        tempfile.tempdir = os.environ["TMPDIR"] = self.scratch
        try:
            self.worker = RolloutWorker(checkpoint_dir, config, worker_id, seed)
        except BaseException:
            remove_tree(self.scratch)
            raise
        self.subscriber = WeightSubscriber(RayTransport(weights, timeout_s=config.timeout_s),
                                           apply=self.worker.set_weights)

    def ready(self) -> tuple[str, str]:
        """Where the actor's files are: its node's id and its scratch directory there."""
        return self.node_id, self.scratch

    def sync_weights(self) -> int | None:
        return self.subscriber.poll()

    def run_group(self, job: GroupJob) -> tuple[list[bytes], dict[str, float]]:
        episodes = self.worker.run_group(job)
        return [episode_to_bytes(e) for e in episodes], self.worker.report()

    def close(self) -> None:
        self.worker.close()
        remove_tree(self.scratch)


def actor_options(config: RolloutConfig, group_size: int, shards: int = 1) -> dict[str, float | int]:
    """Ray resources and threads of one rollout actor: a CPU, its GPUs when its engine runs on CUDA (Ray then
    makes them the actor's `cuda`), and a thread per job (group or shard) it holds plus two for weights and
    closing."""
    gpus = config.gpus_per_worker if config.device == "cuda" else 0
    return {"num_cpus": 1, "num_gpus": gpus, "max_concurrency": groups_per_worker(config, group_size) * shards + 2}


class RayBackend(RolloutBackend):
    def __init__(self, config: RolloutConfig, checkpoint_dir: Path, group_size: int, seed: int = 0) -> None:
        import ray  # optional dependency (extra "ray")

        super().__init__(config, checkpoint_dir, group_size, seed)
        self.ray = ray
        self._actors: list = []
        self._where: list[tuple[str, str] | None] = []  # each actor's node id and scratch directory there
        self._pending: dict = {}  # ObjectRef -> (worker id, the job)
        self._weights = f"rtrl-weights-{uuid.uuid4().hex[:12]}"  # this run's weight directory actor
        self._publisher: WeightPublisher | None = None
        self._started_ray = False  # a local Ray this backend started, shut down by close()

    def start(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        ray = self.ray
        if not ray.is_initialized():
            ray.init(num_cpus=max(2, self.config.workers), include_dashboard=False, log_to_driver=False)
            self._started_ray = True
        actor_cls = ray.remote(_Actor).options(**actor_options(self.config, self.group_size, self.shards))
        from realtime_rl.deploy import RayTransport

        self._publisher = WeightPublisher(RayTransport(self._weights, timeout_s=self.config.timeout_s),
                                          dtype=publish_dtype(self.config))
        self._actors = [actor_cls.remote(str(self.checkpoint_dir), self.config, wid, self.seed, self._weights)
                        for wid in range(self.config.workers)]
        ready = [a.ready.remote() for a in self._actors]
        placed, _ = ray.wait(ready, num_returns=len(ready), timeout=self.config.timeout_s)
        self._where = [None] * len(ready)
        errors = []
        for ref in placed:
            try:
                self._where[ready.index(ref)] = ray.get(ref, timeout=self.config.timeout_s)
            except Exception as exc:  # an actor that failed to start: its error, once the others are known
                errors.append(exc)
        if errors:
            raise errors[0]
        if len(placed) < len(ready):
            started = set(placed)
            waiting = [i for i, ref in enumerate(ready) if ref not in started]
            for i in waiting:  # nothing to close in an actor that never started
                ray.kill(self._actors[i])
            self._actors = [a for i, a in enumerate(self._actors) if i not in waiting]
            self._where = [w for i, w in enumerate(self._where) if i not in waiting]
            options = actor_options(self.config, self.group_size, self.shards)
            raise TimeoutError(
                f"{len(waiting)} of {len(ready)} rollout actors not started after {self.config.timeout_s:g} s"
                f" (rollout.timeout_s): each asks for {options['num_cpus']} CPU and {options['num_gpus']} GPU,"
                f" the cluster has {ray.available_resources()} free; lower rollout.workers or add nodes")
        self.publish(state, version)

    def _send(self, wid: int, job: GroupJob) -> None:
        self._pending[self._actors[wid].run_group.remote(job)] = wid, job

    def _receive(self, timeout_s: float) -> list[tuple[int, GroupJob, list[Episode] | str]]:
        if not self._pending:
            time.sleep(min(timeout_s, 0.05))
            return []
        first, _ = self.ray.wait(list(self._pending), num_returns=1, timeout=max(0.0, timeout_s))
        done = self.ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)[0] if first else []
        out: list[tuple[int, GroupJob, list[Episode] | str]] = []
        for ref in done:
            wid, job = self._pending.pop(ref)
            try:
                blobs, report = self.ray.get(ref, timeout=self.config.timeout_s)
            except self.ray.exceptions.RayTaskError as exc:  # run_group raised: the group failed, not the actor
                out.append((wid, job, short(str(exc))))
                continue  # an actor that died (RayActorError) or a get that timed out is the run's error
            self._reports[wid] = report
            out.append((wid, job, [episode_from_bytes(b) for b in blobs]))
        return out

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        self.last_publish = self._publisher.publish(state, version)
        self.ray.get([a.sync_weights.remote() for a in self._actors], timeout=self.config.timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask every actor to close, waiting at most timeout_s for them all, then kill each: one that died or
        hangs (often why the run is closing) does not keep the others alive or hide the error that ended the run.
        The scratch directories of those that did not close are removed by a task on each one's node."""
        self._pending.clear()
        self._forget_in_flight()
        closing = [actor.close.remote() for actor in self._actors]
        done, late = self.ray.wait(closing, num_returns=len(closing), timeout=timeout_s) if closing else ([], [])
        closed = set()
        for ref in done:
            try:
                self.ray.get(ref, timeout=0)
                closed.add(closing.index(ref))
            except Exception as exc:  # reported; the actor is killed below all the same
                log.warning("rollout actor did not close cleanly: %s", exc)
        if late:
            log.warning("%d rollout actor(s) did not close within %g s", len(late), timeout_s)
        for actor in self._actors:
            self.ray.kill(actor)
        self._remove_scratch([w for i, w in enumerate(self._where) if i not in closed and w is not None], timeout_s)
        self._actors, self._where = [], []
        if self._publisher is not None:  # the weight directory actor and the snapshots it holds
            try:
                self._publisher.transport.close()
            except TransportError as exc:
                log.warning("the weight directory actor did not stop: %s", exc)
            self._publisher = None
        if self._started_ray:
            self.ray.shutdown()
            self._started_ray = False

    def _remove_scratch(self, where: list[tuple[str, str]], timeout_s: float) -> None:
        """Remove the scratch directories of actors that did not close, each by a task pinned to its node."""
        if not where:
            return
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = self.ray.remote(remove_tree)
        refs = {task.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                .remote(path): path for node, path in where}
        done, late = self.ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        for ref in done:
            try:
                self.ray.get(ref, timeout=0)
            except Exception as exc:  # e.g. the node itself is gone, and its files with it
                log.warning("could not remove %s: %s", refs[ref], exc)
        for ref in late:
            log.warning("removing %s did not finish within %g s", refs[ref], timeout_s)
