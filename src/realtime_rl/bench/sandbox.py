"""`rtrl bench sandbox`: sandboxed test-run latency and throughput, the isolation level, escapes contained.

    cold_p50_ms      Sandbox.run_tests: a fresh sandbox running pytest on a small unittest-style task
    cold_exec_p50_ms Sandbox.run(["true"]): the cost of a fresh sandbox alone
    cold_light_p50_ms  the same tests as plain functions (the synthetic tasks' style), with the light runner
                     in a fresh sandbox: what grading runs
    cold_light_cpu_ms  the machine's CPU time per such run (all processes: /proc/stat over the runs, so
                     anything else running on the machine counts too)
    cold_calls_p50_ms, _cpu_ms  the same eight checks graded by value (Sandbox.run_calls: is_isogram called on each
                     input in a fresh sandbox, the values compared on the host): what grading runs for
                     synthetic tasks
    cold_exec_big_parent_p50_ms, _cpu_ms  cold_exec_p50_ms from a parent holding BALLAST_MB of touched memory,
                     as a rollout worker or a trainer holding a model does (starting a process may copy the
                     parent's page tables), with its machine CPU time as above
    warm_p50_ms      WarmPool.run_tests on the same task, one request at a time (p99 too)
    runs_per_s       warm runs per second with `pool_size` (2) slots and as many client threads
    escapes_*        the escape battery of the integration tests (sandbox/escapes.py), judged on the host

Targets (DESIGN.md): warm p50 <= 10 ms and >= 100 runs/s on 2 cores, every escape contained. Timings
share the machine with whatever else runs on it; `--quick` takes fewer samples.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from typing import Any

from realtime_rl.config import SandboxConfig
from realtime_rl.environments.grading import decode_value
from realtime_rl.environments.sandbox import Sandbox, WarmPool
from realtime_rl.environments.sandbox.escapes import Bait, run_battery

SOLUTION = '''def is_isogram(string):
    letters = [c.lower() for c in string if c.isalpha()]
    return len(letters) == len(set(letters))
'''
TESTS = '''import unittest

from isogram import is_isogram


class IsogramTest(unittest.TestCase):
    def test_empty_string(self):
        self.assertIs(is_isogram(""), True)

    def test_lowercase_letters(self):
        self.assertIs(is_isogram("isogram"), True)

    def test_duplicate_letter(self):
        self.assertIs(is_isogram("eleven"), False)

    def test_mixed_case(self):
        self.assertIs(is_isogram("Alphabet"), False)

    def test_hyphens_and_spaces(self):
        self.assertIs(is_isogram("six-year-old"), True)
        self.assertIs(is_isogram("Emily Jung Schwartzkopf"), True)

    def test_duplicate_after_hyphen(self):
        self.assertIs(is_isogram("thumbscrew-japingly"), True)
        self.assertIs(is_isogram("up-to-date"), False)
'''
FILES = {"isogram.py": SOLUTION, "isogram_test.py": TESTS}
FUNCTION_TESTS = '''from isogram import is_isogram


def test_empty_string():
    assert is_isogram("") is True


def test_lowercase_letters():
    assert is_isogram("isogram") is True


def test_duplicate_letter():
    assert is_isogram("eleven") is False


def test_mixed_case():
    assert is_isogram("Alphabet") is False


def test_hyphens_and_spaces():
    assert is_isogram("six-year-old") is True
    assert is_isogram("Emily Jung Schwartzkopf") is True


def test_duplicate_after_hyphen():
    assert is_isogram("thumbscrew-japingly") is True
    assert is_isogram("up-to-date") is False
'''
FUNCTION_FILES = {"isogram.py": SOLUTION, "isogram_test.py": FUNCTION_TESTS}
"""The same tests as plain functions, the synthetic tasks' style."""
CALLS = [("", True), ("isogram", True), ("eleven", False), ("Alphabet", False), ("six-year-old", True),
         ("Emily Jung Schwartzkopf", True), ("thumbscrew-japingly", True), ("up-to-date", False)]
"""The same checks as data: what grading by value calls and compares."""


def _ms(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def _timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _timed_with_cpu(fn, n: int) -> tuple[list[float], float]:
    """_timed, and the machine's CPU seconds per run over them (_machine_cpu_s)."""
    before = _machine_cpu_s()
    samples = _timed(fn, n)
    return samples, (_machine_cpu_s() - before) / n


def _machine_cpu_s() -> float:
    """User + system CPU seconds the whole machine has spent since boot (/proc/stat's first line)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (fields[0] + fields[1] + fields[2]) / os.sysconf("SC_CLK_TCK")


BALLAST_MB = 512


def _check(report) -> None:
    if not (report.ok and report.passed == 6):
        raise RuntimeError(f"the benchmark task did not pass in the sandbox:\n{report.output[-2000:]}")


def run(quick: bool = False) -> dict[str, Any]:
    config = SandboxConfig(pool_size=2)
    sandbox = Sandbox(config)
    n_cold, n_warm, throughput_s = (5, 100, 2.0) if quick else (20, 500, 5.0)

    _check(sandbox.run_tests(FILES, ["isogram_test.py"]))
    cold = _timed(lambda: sandbox.run_tests(FILES, ["isogram_test.py"]), n_cold)
    cold_exec = _timed(lambda: sandbox.run(["true"], {}), n_cold)
    _check(light := sandbox.run_tests(FUNCTION_FILES, ["isogram_test.py"], runner="light"))
    if light.fallback_reason:
        raise RuntimeError(f"the light runner fell back to pytest: {light.fallback_reason}")
    cold_light, cold_light_cpu_s = _timed_with_cpu(
        lambda: sandbox.run_tests(FUNCTION_FILES, ["isogram_test.py"], runner="light"), n_cold)
    solution = {"isogram.py": SOLUTION}
    inputs = [json.dumps(text) for text, _ in CALLS]
    called = sandbox.run_calls(solution, "isogram", "is_isogram", inputs)
    if called.results is None or [decode_value(v) for _, v in called.results] != [want for _, want in CALLS]:
        raise RuntimeError(f"the benchmark task's calls did not all return the expected values:\n{called}")
    cold_calls, cold_calls_cpu_s = _timed_with_cpu(
        lambda: sandbox.run_calls(solution, "isogram", "is_isogram", inputs), n_cold)
    ballast = bytearray(BALLAST_MB << 20)  # memory this process has written to (every page mapped)
    ballast[::4096] = b"\1" * (len(ballast) // 4096)
    cold_exec_big, cold_exec_big_cpu_s = _timed_with_cpu(lambda: sandbox.run(["true"], {}), n_cold)
    del ballast

    with WarmPool(sandbox=sandbox) as pool:
        first = pool.run_tests(FILES, ["isogram_test.py"])
        _check(first)
        if not first.warm:
            raise RuntimeError(f"the warm pool fell back to a cold run: {first.fallback_reason}")
        warm = _timed(lambda: pool.run_tests(FILES, ["isogram_test.py"]), n_warm)
        counts = [0] * config.pool_size
        stop = time.perf_counter() + throughput_s

        def client(i: int) -> None:
            while time.perf_counter() < stop:
                pool.run_tests(FILES, ["isogram_test.py"])
                counts[i] += 1

        threads = [threading.Thread(target=client, args=(i,)) for i in range(config.pool_size)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=throughput_s + 60)
        runs_per_s = sum(counts) / (time.perf_counter() - start)

    with Bait(sandbox) as bait:
        attempts = run_battery(sandbox, bait)
    return {
        "n_cold": n_cold, "n_warm": n_warm, "throughput_s": throughput_s,
        "isolation_level": sandbox.isolation_level.value,
        "isolation_label": sandbox.isolation_label,
        "cold_p50_ms": _ms(cold, 0.5),
        "cold_exec_p50_ms": _ms(cold_exec, 0.5),
        "cold_light_p50_ms": _ms(cold_light, 0.5),
        "cold_light_cpu_ms": round(1000 * cold_light_cpu_s, 2),
        "cold_calls_p50_ms": _ms(cold_calls, 0.5),
        "cold_calls_cpu_ms": round(1000 * cold_calls_cpu_s, 2),
        "cold_exec_big_parent_p50_ms": _ms(cold_exec_big, 0.5),
        "cold_exec_big_parent_cpu_ms": round(1000 * cold_exec_big_cpu_s, 2),
        "warm_p50_ms": _ms(warm, 0.5),
        "warm_p99_ms": _ms(warm, 0.99),
        "warm_mean_ms": round(1000 * statistics.fmean(warm), 2),
        "runs_per_s": round(runs_per_s, 1),
        "pool_size": config.pool_size,
        "escapes_contained": sum(a.contained for a in attempts.values()),
        "escapes_total": len(attempts),
        "escapes_not_contained": {name: a.evidence for name, a in attempts.items() if not a.contained},
    }
