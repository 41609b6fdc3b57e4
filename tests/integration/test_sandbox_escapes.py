"""The escape battery (realtime_rl.environments.sandbox.escapes), one test per attack, judged on the host.

Each attack runs in a fresh sandbox and the host then checks its bait: a TCP listener on every host
address, a root-only secret file, a world-writable sentinel file, a process of the sandbox's own uid
with a secret in its environment, the process table (no survivor carries the attack's token) and, for
the grading attacks, the counts of the pristine tests. The same battery feeds `rtrl bench sandbox`.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from realtime_rl.config import SandboxConfig
from realtime_rl.environments.sandbox import IsolationLevel, Sandbox, WarmPool
from realtime_rl.environments.sandbox.escapes import ATTACKS, Bait, expected_gaps, run_battery

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None and not os.access("/usr/bin/bwrap", os.X_OK),
                                reason="bubblewrap (bwrap) is not installed: apt-get install bubblewrap")


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(SandboxConfig(wall_s=20))


@pytest.fixture(scope="module")
def bait(sandbox):
    with Bait(sandbox) as bait:
        yield bait


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_is_contained(sandbox, bait, name):
    attempt = ATTACKS[name](sandbox, bait)
    if name in expected_gaps(sandbox):
        pytest.xfail(f"documented gap of the {sandbox.isolation_level.value} tier: {sandbox.isolation_label}")
    assert attempt.contained, attempt.evidence
    assert bait.leftovers() == []


def test_full_tier_is_reached_where_bwrap_runs(sandbox):
    if sandbox.isolation_level != IsolationLevel.FULL:
        pytest.skip(f"bubblewrap is installed but refused here: {sandbox.probe.namespaces_error}")
    assert sandbox.isolation_label.startswith("bwrap:")


@pytest.mark.slow
def test_weak_tier_contains_what_its_label_claims():
    """Forced weak tier: every attack outside its documented gaps is contained."""
    weak = Sandbox(SandboxConfig(isolation="weak", wall_s=20))
    with Bait(weak) as bait:
        attempts = run_battery(weak, bait)
        assert bait.leftovers() == []
    escaped = {name for name, a in attempts.items() if not a.contained}
    assert escaped <= expected_gaps(weak), {n: attempts[n].evidence for n in escaped - expected_gaps(weak)}


DETACH = """
import os

def test_detach():
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execvp("python3", ["python3", "-c", "import time; time.sleep(120)", "{token}"])
        os._exit(0)
"""
FORK_BOMB = """
import ctypes, os

def test_bomb():
    ctypes.CDLL(None).prctl(15, b"{name}", 0, 0, 0)  # PR_SET_NAME: every child inherits it
    while True:
        try:
            os.fork()
        except OSError:
            pass
"""


def test_warm_pool_leaves_nothing_behind(sandbox, bait):
    """Warm slots outlive runs, so they must kill what each run started: detached children, fork bombs."""
    with WarmPool(sandbox=sandbox) as pool:
        detach = pool.run_tests({"test_d.py": DETACH.format(token=bait.token)}, ["test_d.py"])
        assert detach.ok and detach.warm
        assert bait.leftovers() == []
        bomb_file = {"test_b.py": FORK_BOMB.format(name=bait.token[:15])}
        bomb = pool.run_tests(bomb_file, ["test_b.py"], timeout_s=3.0)
        assert bomb.warm and bomb.timed_out and bait.leftovers() == []
        after = pool.run_tests({"test_ok.py": "def test_ok():\n    pass\n"}, ["test_ok.py"])
        assert after.ok and after.warm


HOLD_EVERY_PROCESS = """
import os, time
for _ in range(10_000):
    try:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
    except OSError:
        pass
time.sleep(30)
"""
FORK_20 = "import subprocess\nfor _ in range(20):\n    subprocess.run(['true'], check=True)\nprint('forked 20')\n"


def test_a_weak_sandbox_holding_every_process_it_may_does_not_starve_another_ones_forks():
    """Weak sandboxes share a uid. Their process limit was RLIMIT_NPROC, which counts every process of the uid:
    one run at its limit made every other run's fork fail (EAGAIN), grading it wrong. With a cgroup each run
    has its own pids.max."""
    weak = Sandbox(SandboxConfig(isolation="weak", wall_s=20))
    if weak.probe.cgroups.version is None:
        pytest.skip("no writable cgroup: weak sandboxes share RLIMIT_NPROC, a documented gap of the tier")
    with ThreadPoolExecutor(1) as other:
        holder = other.submit(weak.run, ["python3", "-c", HOLD_EVERY_PROCESS], {}, timeout_s=6.0)
        time.sleep(2.0)  # it holds max_procs processes by now
        result = weak.run(["python3", "-c", FORK_20], {}, timeout_s=10.0)
        assert not holder.done()
        assert result.ok and "forked 20" in result.stdout, result.stderr[-500:]
        assert holder.result(timeout=30).timed_out
