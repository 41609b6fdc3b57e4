"""Rollout workers as local processes (multiprocessing, spawn): one engine and sandbox pool each.

Messages are plain tuples on multiprocessing queues: to a worker ("weights", version), ("job", GroupJob),
("stop",); from a worker ("ready", wid), ("group", wid, job, path, report), ("failed", wid, job, text) (the
job raised: a group failure), ("error", wid, text) (the worker failed), where job is the GroupJob (a group
or a shard of one) and report is RolloutWorker.report() (tokens so far, engine stats). A job's episodes travel
as episode_to_bytes blobs (no pickle of episodes across the boundary) in a file of the worker's scratch
directory, whose path the message carries: every message a worker sends stays under PIPE_BUF, so it reaches
the shared pipe whole or not at all. (A group's megabytes on the pipe itself could be cut off by a worker killed
mid-send, and the trainer's next read then blocked for good on the rest of a message nobody would write.)
Weights travel through the weight-sync path of `realtime_rl.deploy`: the trainer's WeightPublisher
writes a verified lossless delta (and periodic snapshots) into run_dir/weights on the filesystem
transport; each worker's WeightSubscriber follows the chain and hands the rebuilt state to its
engine's hot swap. A worker runs several groups at once on threads so its engine batch stays full.
Each worker's temporary files (its task and sandbox directories) live in a directory of its own, which the
worker removes on its way out (orphaned too) and close() removes after stopping it, killed or not.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from realtime_rl.config import RolloutConfig
from realtime_rl.deploy import FilesystemTransport, WeightPublisher, WeightSubscriber
from realtime_rl.environments.sandbox.launch import remove_tree
from realtime_rl.rollout.base import RolloutBackend, publish_dtype, short
from realtime_rl.rollout.worker import GroupJob, RolloutWorker
from realtime_rl.types import Episode, episode_from_bytes, episode_to_bytes


def write_blobs(path: Path, blobs: list[bytes]) -> Path:
    """Length-prefixed blobs in one file, renamed into place whole."""
    staging = path.with_name(f".{path.name}.part")
    with open(staging, "wb") as f:
        for blob in blobs:
            f.write(len(blob).to_bytes(8, "big"))
            f.write(blob)
    os.replace(staging, path)
    return path


def read_blobs(path: Path) -> list[bytes]:
    """What write_blobs wrote; the file is removed."""
    data, blobs, at = path.read_bytes(), [], 0
    path.unlink()
    while at < len(data):
        size = int.from_bytes(data[at:at + 8], "big")
        blobs.append(data[at + 8:at + 8 + size])
        at += 8 + size
    if at != len(data):
        raise RuntimeError(f"{path}: a group file cut short ({len(data)} bytes)")
    return blobs


def _worker_main(checkpoint_dir: str, weights_dir: str, scratch: str, config: RolloutConfig, worker_id: int,
                 seed: int, jobs: int, inbox: mp.Queue, outbox: mp.Queue) -> None:
    tempfile.tempdir = os.environ["TMPDIR"] = scratch  # its work and sandbox directories, removed with it
    try:
        worker = RolloutWorker(checkpoint_dir, config, worker_id, seed)
        subscriber = WeightSubscriber(FilesystemTransport(weights_dir, timeout_s=config.timeout_s),
                                      apply=worker.set_weights)
    except BaseException:  # report why, then die: the orchestrator raises with this text
        outbox.put(("error", worker_id, short(traceback.format_exc())))
        return
    groups = ThreadPoolExecutor(jobs, thread_name_prefix=f"group-{worker_id}")

    def run(job: GroupJob) -> None:
        try:
            episodes = worker.run_group(job)
            name = f"group-{job.group_id}-{job.indices[0]}.bin"  # two shards of a group may share a worker
            path = write_blobs(Path(scratch) / name, [episode_to_bytes(e) for e in episodes])
            outbox.put(("group", worker_id, job, str(path), worker.report()))
        except BaseException:  # the group's failure, not the worker's: the orchestrator counts it and goes on
            outbox.put(("failed", worker_id, job, short(traceback.format_exc())))

    outbox.put(("ready", worker_id))
    orphaned = False
    try:
        parent = mp.parent_process()
        while True:
            try:
                message = inbox.get(timeout=1.0)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    orphaned = True  # the orchestrator was killed (even with SIGKILL): do not outlive it
                    break
                continue
            if message[0] == "stop":
                break
            if message[0] == "weights":
                try:
                    subscriber.poll()  # verified and rebuilt beside the live weights, then swapped in
                except BaseException:
                    outbox.put(("error", worker_id, short(traceback.format_exc())))
            elif message[0] == "job":
                groups.submit(run, message[1])
    finally:
        groups.shutdown(wait=False, cancel_futures=True)
        worker.close()  # its engine, sandboxes and work directories, orphaned or not
        remove_tree(scratch)
        if orphaned:
            outbox.cancel_join_thread()  # nobody reads the pipe any more: do not wait to flush it
        outbox.close()
        outbox.join_thread()
        os._exit(1 if orphaned else 0)  # episode threads waiting on the stopped engine must not hold the process


class LocalBackend(RolloutBackend):
    def __init__(self, config: RolloutConfig, checkpoint_dir: Path, group_size: int, seed: int = 0,
                 weights_dir: Path | None = None) -> None:
        super().__init__(config, checkpoint_dir, group_size, seed)
        self._own_weights_dir = weights_dir is None  # a temporary one, removed by close()
        self.weights_dir = Path(weights_dir or tempfile.mkdtemp(prefix="rtrl-weights-"))
        shutil.rmtree(self.weights_dir, ignore_errors=True)  # a fresh chain per run: snapshot first
        self._publisher = WeightPublisher(FilesystemTransport(self.weights_dir, timeout_s=config.timeout_s),
                                          dtype=publish_dtype(config))
        self._ctx = mp.get_context("spawn")
        self._outbox: mp.Queue = self._ctx.Queue()
        self._inboxes: list[mp.Queue] = []
        self._procs: list[mp.process.BaseProcess] = []
        self._scratch: list[Path] = []
        """Each worker's temporary directory: what it leaves there goes when close() has stopped it (killed too)."""

    def start(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        for wid in range(self.config.workers):
            inbox = self._ctx.Queue()
            self._scratch.append(Path(tempfile.mkdtemp(prefix=f"rtrl-worker-{wid}-")))
            proc = self._ctx.Process(target=_worker_main, name=f"rtrl-rollout-{wid}", daemon=True,
                                     args=(str(self.checkpoint_dir), str(self.weights_dir), str(self._scratch[-1]),
                                           self.config, wid, self.seed, self.jobs_per_worker, inbox, self._outbox))
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

    def _send(self, wid: int, job: GroupJob) -> None:
        self._inboxes[wid].put(("job", job))

    def _receive(self, timeout_s: float) -> list[tuple[int, GroupJob, list[Episode] | str]]:
        out: list[tuple[int, GroupJob, list[Episode] | str]] = []
        message = self._get(timeout_s)
        while message is not None:
            if message[0] == "group":
                _, wid, job, path, report = message
                self._reports[wid] = report
                out.append((wid, job, [episode_from_bytes(b) for b in read_blobs(Path(path))]))
            elif message[0] == "failed":
                _, wid, job, error = message
                out.append((wid, job, error))
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
            if message is None and any(not p.is_alive() for p in self._procs):
                with contextlib.suppress(queue.Empty):  # what it sent last (its traceback, say) comes first
                    message = self._outbox.get_nowait()
            if message is not None:
                if message[0] == "error":
                    raise RuntimeError(f"rollout worker {message[1]} failed:\n{message[2]}")
                return message
            dead = [f"{p.name} (exit code {p.exitcode})" for p in self._procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"rollout worker process died: {', '.join(dead)}")
            if remaining <= 0:
                return None

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        self.last_publish = self._publisher.publish(state, version)
        for inbox in self._inboxes:
            inbox.put(("weights", version))

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers: each closes its engine and sandboxes; one still running after `timeout_s` is
        killed. Their temporary directories go either way."""
        self._forget_in_flight()
        for inbox in self._inboxes:
            inbox.put(("stop",))
        deadline = time.monotonic() + timeout_s
        while any(p.is_alive() for p in self._procs) and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):  # a worker exits only once what it sent is off a full pipe
                self._outbox.get(timeout=0.1)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        self._procs.clear()
        for scratch in self._scratch:
            remove_tree(scratch)
        self._scratch.clear()
        for q in (*self._inboxes, self._outbox):  # their pipes and feeder threads; a dead reader must not block
            q.cancel_join_thread()
            q.close()
        self._inboxes.clear()
        if self._own_weights_dir:
            shutil.rmtree(self.weights_dir, ignore_errors=True)
