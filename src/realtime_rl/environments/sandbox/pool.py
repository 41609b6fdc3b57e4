"""WarmPool: pre-started sandboxes that fork one child per test run, for fast visible-test runs.

Each slot is a sandbox (same tier, limits and cgroup as a fresh one) whose interpreter has imported
the standard library and waits for requests (inside_warm.serve). A request forks a child that writes
the files, sets the rlimits and runs the light runner; the slot then kills everything the run left
behind and wipes the workspace, /tmp and /dev/shm. Runs that need what the light runner cannot promise
(pytest fixtures, conftest-free pytest features, a crash without a report) are re-run cold with
`Sandbox.run_tests` and say why (`TestReport.fallback_reason`).

Slots are started from one long-lived thread (bubblewrap's --die-with-parent follows the thread that
started it). A slot that dies or stops answering is killed and replaced on next use; a run that hangs
is killed at its timeout inside the slot. Runs in one slot share that sandbox over time: a run can
kill its slot (it is replaced) but cannot ptrace it. Grading never uses the pool: it runs
`Sandbox.run_tests`, a fresh sandbox with pristine read-only tests.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import queue
import select
import struct
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from realtime_rl.config import SandboxConfig
from realtime_rl.environments.sandbox.launch import SandboxProcess, b64_files, encode_files, frame, limits
from realtime_rl.environments.sandbox.results import IsolationLevel, RunResult, TestReport
from realtime_rl.environments.sandbox.sandbox import (
    LIGHT_RUNNER_SOURCE,
    Sandbox,
    check_tests,
    make_report,
    remaining,
    signal_of,
)
START_TIMEOUT_S = 30.0
REPLY_GRACE_S = 5.0  # beyond the run's own timeout, which the slot enforces itself


class SlotError(Exception):
    """The slot died, broke the protocol or did not answer in time; it must be replaced."""


class Slot:
    def __init__(self, sandbox: Sandbox) -> None:
        full = sandbox.isolation_level == IsolationLevel.FULL
        config = sandbox.config
        # The slot's cgroup also holds the waiting interpreter and bubblewrap's init.
        slot_config = config.model_copy(update={"memory_mb": config.memory_mb + 64,
                                                "max_procs": config.max_procs + 4})
        header = {"mode": "zygote", "warm_src": LIGHT_RUNNER_SOURCE, "own_pid_namespace": full,
                  "scratch_dirs": ["/tmp", "/dev/shm"] if full else []}
        self.process = SandboxProcess(sandbox.probe, slot_config, header)
        self.stdin_fd = self.process.proc.stdin.fileno()
        self.stdout_fd = self.process.proc.stdout.fileno()
        os.set_blocking(self.stdin_fd, False)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            self._write(self.process.preamble, deadline)
            if not self._read(deadline).get("ready"):
                raise SlotError("slot did not say ready")
        except SlotError as e:
            stderr_fd = self.process.proc.stderr.fileno()
            os.set_blocking(stderr_fd, False)
            try:
                detail = os.read(stderr_fd, 4096).decode(errors="replace").strip()
            except OSError:
                detail = ""
            self.close()
            raise SlotError(f"warm slot did not start: {e}; {detail}") from None

    def request(self, message: dict, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        self._write(frame(message), deadline)
        return self._read(deadline)

    def close(self) -> None:
        self.process.close()

    def _write(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            if not select.select([], [self.stdin_fd], [], max(0.0, deadline - time.monotonic()))[1]:
                raise SlotError("timed out writing to the slot")
            try:
                view = view[os.write(self.stdin_fd, view[:65536]):]
            except OSError as e:
                raise SlotError(f"slot closed its input: {e}") from None

    def _read_exact(self, n: int, deadline: float) -> bytes:
        data = bytearray()
        while len(data) < n:
            if not select.select([self.stdout_fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise SlotError("timed out waiting for the slot")
            chunk = os.read(self.stdout_fd, n - len(data))
            if not chunk:
                raise SlotError(f"slot exited (status {self.process.proc.poll()})")
            data += chunk
        return bytes(data)

    def _read(self, deadline: float) -> dict:
        (size,) = struct.unpack(">Q", self._read_exact(8, deadline))
        try:
            reply = json.loads(self._read_exact(size, deadline))
        except (ValueError, RecursionError) as e:  # RecursionError: brackets nested deeper than this stack allows
            raise SlotError(f"bad reply: {e!r:.200}") from None
        if not isinstance(reply, dict):
            raise SlotError(f"bad reply: a JSON {type(reply).__name__}, not an object")
        return reply


def queue_wait_s(callers: int, pool_size: int, timeout_s: float) -> float:
    """The longest a run can wait for a slot when at most `callers` threads run tests of at most `timeout_s`
    each on `pool_size` slots: every run ahead of it ends within its timeout plus the reply's grace (a slot
    that does not reply is killed and its place taken by a fresh one)."""
    return math.ceil(max(callers - 1, 0) / pool_size) * (START_TIMEOUT_S + 10 + timeout_s + REPLY_GRACE_S) + 1.0


class WarmPool:
    """`config.pool_size` warm slots; `run_tests` is thread-safe. Use as a context manager or call close().

    A run waits up to `slot_wait_s` (default `config.wall_s`) for a free slot, then runs cold. A cold run's
    output is pytest's, not the warm runner's, so a caller whose model reads the output and must see the same
    for the same code (the gate's paired evaluation) passes a wait no queue of its runs can pass:
    `queue_wait_s`. A run's deadline starts once it has a slot: waiting for one never times a solution out."""

    def __init__(self, config: SandboxConfig | None = None, *, sandbox: Sandbox | None = None,
                 slot_wait_s: float | None = None) -> None:
        self.sandbox = sandbox or Sandbox(config)
        self.config = self.sandbox.config
        self.slot_wait_s = self.config.wall_s if slot_wait_s is None else slot_wait_s
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rtrl-warm-slots")
        self._idle: queue.Queue[Slot | None] = queue.Queue()
        self._closed = False
        try:
            for _ in range(self.config.pool_size):
                self._idle.put(self._start())
        except BaseException:
            self.close()
            raise

    def _start(self) -> Slot:
        return self._spawner.submit(Slot, self.sandbox).result(timeout=START_TIMEOUT_S + 10)

    def run_tests(self, files: Mapping[str, str | bytes], test_files: Sequence[str], *,
                  timeout_s: float | None = None) -> TestReport:
        """Sandbox.run_tests' counts from a warm slot; falls back to a fresh sandbox when it must."""
        if self._closed:
            raise RuntimeError("this WarmPool is closed")
        encoded = encode_files(files)
        tests = check_tests(encoded, test_files)
        timeout = self.sandbox.resolve_timeout(timeout_s)
        try:
            slot = self._idle.get(timeout=self.slot_wait_s)
        except queue.Empty:
            return self._cold(files, tests, time.monotonic() + timeout,
                              f"no warm slot became free within {self.slot_wait_s:g} s")
        deadline = time.monotonic() + timeout  # the run's, from here: a cold fallback gets what is left of it
        healthy = None
        try:
            slot = slot or self._start()
            reply = slot.request({"files": b64_files(encoded), "test_files": tests, "timeout_s": timeout,
                                  "output_bytes": self.config.output_bytes,
                                  "limits": limits(self.config, slot.process.nproc_rlimit)},
                                 timeout + REPLY_GRACE_S)
            healthy = slot
        except (SlotError, OSError, TimeoutError) as e:
            if slot is not None:
                slot.close()
            return self._cold(files, tests, deadline, f"warm slot failed ({e}); it is replaced")
        finally:
            self._give_back(healthy)
        run = self._run_result(reply)
        report = reply["report"]
        if run.timed_out:
            return make_report(run, None, warm=True)
        if not isinstance(report, dict):  # the code under test can write to the report pipe (inside_warm.py)
            return self._cold(files, tests, deadline, "the warm run ended without a report (crash or exit)")
        if report.get("fallback"):
            return self._cold(files, tests, deadline, report["fallback"])
        return make_report(run, report, warm=True)

    def _run_result(self, reply: dict) -> RunResult:
        code = reply["exit_code"]
        code = None if reply["timed_out"] else (128 - code if code < 0 else code)
        return RunResult(exit_code=code, stdout=reply["stdout"], stderr=reply["stderr"],
                         timed_out=reply["timed_out"], output_truncated=reply["truncated"],
                         duration_s=reply["duration_s"], isolation=self.sandbox.isolation_level,
                         isolation_label=self.sandbox.isolation_label + "; warm pool slot",
                         signal=signal_of(code))

    def _cold(self, files, tests, deadline: float, reason: str) -> TestReport:
        report = self.sandbox.run_tests(files, tests, timeout_s=remaining(deadline), runner="pytest")
        return dataclasses.replace(report, fallback_reason=reason)

    def _give_back(self, slot: Slot | None) -> None:
        if self._closed:
            if slot is not None:
                slot.close()
            return
        self._idle.put(slot)  # None: a dead slot, replaced by whoever takes it next

    def close(self) -> None:
        """Kill every slot (and everything running in it)."""
        self._closed = True
        while True:
            try:
                slot = self._idle.get_nowait()
            except queue.Empty:
                break
            if slot is not None:
                slot.close()
        self._spawner.shutdown(wait=True)

    def __enter__(self) -> WarmPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
