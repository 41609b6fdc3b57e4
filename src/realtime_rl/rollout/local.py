"""Rollout workers as local processes (multiprocessing, spawn): one engine and sandbox pool each.

Messages are plain tuples on multiprocessing queues: to a worker ("weights", state, version),
("job", GroupJob), ("stop",); from a worker ("ready", wid), ("group", wid, group_id, [episode bytes]),
("error", wid, text). Episodes travel as episode_to_bytes blobs (no pickle of our objects across the
boundary); weights as a dict of CPU tensors. A worker runs several groups at once on threads so its
engine batch stays full; a newer weight message simply replaces a pending one in the engine.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from realtime_rl.config import RolloutConfig
from realtime_rl.rollout.base import RolloutBackend, groups_per_worker
from realtime_rl.rollout.worker import GroupJob, RolloutWorker
from realtime_rl.types import Episode, episode_from_bytes, episode_to_bytes


def _worker_main(checkpoint_dir: str, config: RolloutConfig, worker_id: int, seed: int, group_size: int,
                 inbox: mp.Queue, outbox: mp.Queue) -> None:
    try:
        worker = RolloutWorker(checkpoint_dir, config, worker_id, seed)
    except BaseException:  # report why, then die: the orchestrator raises with this text
        outbox.put(("error", worker_id, traceback.format_exc()))
        return
    groups = ThreadPoolExecutor(groups_per_worker(config, group_size), thread_name_prefix=f"group-{worker_id}")

    def run(job: GroupJob) -> None:
        try:
            episodes = worker.run_group(job)
            outbox.put(("group", worker_id, job.group_id, [episode_to_bytes(e) for e in episodes],
                        worker.generated_tokens))
        except BaseException:
            outbox.put(("error", worker_id, traceback.format_exc()))

    outbox.put(("ready", worker_id))
    try:
        parent = mp.parent_process()
        while True:
            try:
                message = inbox.get(timeout=1.0)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    os._exit(1)  # the orchestrator was killed (even with SIGKILL): do not outlive it
                continue
            if message[0] == "stop":
                break
            if message[0] == "weights":
                worker.set_weights(message[1], message[2])
            elif message[0] == "job":
                groups.submit(run, message[1])
    finally:
        groups.shutdown(wait=False, cancel_futures=True)
        worker.close()
        outbox.close()
        outbox.join_thread()
        os._exit(0)  # episode threads still waiting on the stopped engine must not hold the process


class LocalBackend(RolloutBackend):
    def __init__(self, config: RolloutConfig, checkpoint_dir: Path, group_size: int, seed: int = 0) -> None:
        super().__init__(config, checkpoint_dir, group_size, seed)
        self._ctx = mp.get_context("spawn")
        self._outbox: mp.Queue = self._ctx.Queue()
        self._inboxes: list[mp.Queue] = []
        self._procs: list[mp.process.BaseProcess] = []
        self._jobs: dict[str, int] = {}

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def start(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        for wid in range(self.config.workers):
            inbox = self._ctx.Queue()
            proc = self._ctx.Process(target=_worker_main, name=f"rtrl-rollout-{wid}", daemon=True,
                                     args=(str(self.checkpoint_dir), self.config, wid, self.seed, self.group_size,
                                           inbox, self._outbox))
            proc.start()
            self._inboxes.append(inbox)
            self._procs.append(proc)
        self.publish(state, version)
        ready, deadline = set(), time.monotonic() + self.config.timeout_s
        while len(ready) < self.config.workers:
            message = self._get(deadline - time.monotonic())
            if message is None:
                raise TimeoutError(f"rollout workers not ready after {self.config.timeout_s:.0f} s")
            if message[0] == "ready":
                ready.add(message[1])

    def submit(self, job: GroupJob) -> None:
        wid = self._least_loaded()
        self._jobs[job.group_id] = wid
        self._inboxes[wid].put(("job", job))

    def poll(self, timeout_s: float) -> list[list[Episode]]:
        out: list[list[Episode]] = []
        message = self._get(timeout_s)
        while message is not None:
            if message[0] == "group":
                _, wid, group_id, blobs, tokens = message
                self._load[wid] -= 1
                self._jobs.pop(group_id, None)
                self._tokens[wid] = tokens
                out.append([episode_from_bytes(b) for b in blobs])
            message = self._get(0)
        return out

    def _get(self, timeout_s: float) -> tuple | None:
        """The next worker message within timeout_s (None if none came); raises on a worker error or death."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            remaining = deadline - time.monotonic()
            try:
                message = self._outbox.get(timeout=min(0.5, remaining)) if remaining > 0 else self._outbox.get_nowait()
            except queue.Empty:
                message = None
            if message is not None:
                if message[0] == "error":
                    raise RuntimeError(f"rollout worker {message[1]} failed:\n{message[2]}")
                return message
            dead = [p.name for p in self._procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"rollout worker process died: {', '.join(dead)}")
            if remaining <= 0:
                return None

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        state = {k: v.detach().cpu() for k, v in state.items()}
        for inbox in self._inboxes:
            inbox.put(("weights", state, version))

    def close(self) -> None:
        for inbox in self._inboxes:
            inbox.put(("stop",))
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs.clear()
