"""Data parallelism across the CPU cores of one machine: spawned processes, gradients summed by gloo.

    with process_group(run_dir, world, worker, args):          # worker(rank, world, *args) in processes 1..world-1
        ...                                                     # this process is rank 0 of the group
        for rows in ...: loss = ...; loss.backward()
        loss = sum_gradients(model.parameters(), loss)          # every process now holds the summed gradients
    owner = share(lengths, world)                               # which process takes each row

The default model's matrices (hidden 128) are too small for torch's intra-op threads to keep cores busy: two
processes of one thread run a pre-training step faster than one process of two (BENCHMARKS.md, pretrain,
"Data-parallel pre-training"). Every process takes the same optimizer step from the same summed gradients, so
all hold the same weights; process 0 does the I/O.

The group's rendezvous is a file under run_dir, its traffic gloo over loopback. Every wait has a timeout: process 0
waits START_TIMEOUT_S for each process to start and COLLECTIVE_TIMEOUT at each sum; a process that dies closes its
connections, so the others' next sum fails at once; the others exit as soon as process 0 is gone, SIGKILL
included. A program that starts a group must guard its entry point with `if __name__ == "__main__":` (processes
are spawned; a fork would copy torch's thread pools).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(minutes=10)
"""How long a process waits for the others at a sum (process 0's checkpoint writes are the longest gap)."""
START_TIMEOUT_S = 300
"""How long process 0 waits for another to start (spawn, import torch: seconds, unless the machine is loaded)."""


def share(lengths: list[int], world: int) -> list[int]:
    """The process (0..world-1) each row goes to: longest first, each to the one with the fewest tokens so far
    (the lowest-numbered on a tie), so the processes' forwards take about as long."""
    load, owner = [0] * world, [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        owner[i] = min(range(world), key=lambda r: (load[r], r))
        load[owner[i]] += lengths[i]
    return owner


def same_start(params: Iterable[torch.nn.Parameter]) -> None:
    """Process 0's weights copied to every process, whatever each one's initialisation did."""
    for p in params:
        dist.broadcast(p.data, src=0)


def sum_gradients(params: Iterable[torch.nn.Parameter], loss: float) -> float:
    """Every process's gradients summed in place (one all-reduce of a flat buffer); a parameter no process
    gave a gradient keeps none, as with one process. Returns the loss summed over the processes."""
    params = list(params)
    grads = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in params]
    has_grad = torch.tensor([float(p.grad is not None) for p in params])
    flat = torch.cat([*grads, has_grad, torch.tensor([loss])])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset:offset + g.numel()].view_as(p)
        offset += g.numel()
    for p, present in zip(params, flat[offset:offset + len(params)].tolist()):
        if not present:
            p.grad = None
    return float(flat[-1])


@contextmanager
def process_group(run_dir: Path, world: int, worker: Callable[..., None], args: tuple[Any, ...]) -> Iterator[None]:
    """Processes 1..world-1 running worker(rank, world, *args) inside the group, and this one joined with them as
    process 0 once each has started. On the way out they are waited for; if any failed, the others are stopped and
    the error names each that did not exit cleanly. world 1: nothing is started."""
    if world == 1:
        yield
        return
    staging = Path(tempfile.mkdtemp(dir=run_dir, prefix=".group-"))
    store = str(staging / "store")
    context = multiprocessing.get_context("spawn")
    others: list[Any] = []
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface is None and sys.platform == "linux":
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # one machine: loopback, whatever the host name resolves to
    try:
        for rank in range(1, world):
            ours, theirs = context.Pipe(duplex=False)
            proc = context.Process(target=_run_worker, name=f"data-parallel-{rank}", daemon=True,
                                   args=(rank, world, store, theirs, worker, args))
            proc.start()
            theirs.close()
            others.append(proc)
            if not _said_ready(ours, START_TIMEOUT_S):
                raise RuntimeError(f"{proc.name} did not start within {START_TIMEOUT_S} s")
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=0, world_size=world,
                                timeout=COLLECTIVE_TIMEOUT)
        try:
            yield
        finally:
            dist.destroy_process_group()
        for proc in others:
            proc.join(timeout=60)
    except BaseException as error:
        for proc in others:
            proc.join(timeout=5)
        failed = [f"{proc.name} (exit code {proc.exitcode})" for proc in others if proc.exitcode not in (0, None)]
        if failed and isinstance(error, Exception):  # a Ctrl-C stops them all: that one is not wrapped
            raise RuntimeError(f"data-parallel run stopped: {', '.join(failed)} failed") from error
        raise
    finally:
        for proc in others:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        if interface is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        shutil.rmtree(staging, ignore_errors=True)
    failed = [f"{proc.name} (exit code {proc.exitcode})" for proc in others if proc.exitcode != 0]
    if failed:
        raise RuntimeError(f"data-parallel process failed: {', '.join(failed)}")


def remove_stale_groups(run_dir: Path) -> None:
    """Rendezvous files a killed run left under run_dir."""
    for stale in Path(run_dir).glob(".group-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _run_worker(rank: int, world: int, store: str, ready: Connection, worker: Callable[..., None],
                args: tuple[Any, ...]) -> None:
    threading.Thread(target=_exit_with_parent, name="exit-with-process-0", daemon=True).start()
    ready.send(True)
    ready.close()
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)
    try:
        worker(rank, world, *args)
    finally:
        dist.destroy_process_group()


def _exit_with_parent() -> None:
    multiprocessing.parent_process().join()
    os._exit(1)


def _said_ready(pipe: Connection, timeout_s: float) -> bool:
    """Whether the process at the pipe's other end sent its ready message within the timeout (False if it died)."""
    try:
        return pipe.poll(timeout_s) and pipe.recv()
    except EOFError:
        return False
    finally:
        pipe.close()
