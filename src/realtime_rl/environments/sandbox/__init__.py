"""The sandbox: runs untrusted code (agent commands, tests, grading) under bubblewrap, or says it cannot.

    sb = Sandbox(SandboxConfig())                          probes the machine once per process
    sb.isolation_level, sb.isolation_label                 the tier reached, and exactly what it has
    sb.run(["python3", "x.py"], {"x.py": "..."})           -> RunResult (exit code, output, timeout, ...)
    sb.run_tests(files, ["x_test.py"])                     -> TestReport; a fresh sandbox: what grading uses
    sb.run_calls(files, "x", "f", ["[1, 2]"])              -> CallReport: what f returned, per input (value grading)
    with WarmPool(config) as pool:                         pre-started sandboxes, one forked child per run
        pool.run_tests(files, ["x_test.py"])               fast visible-test runs (~ms), same counts

FULL tier ("bwrap"): bubblewrap launched as an unprivileged uid (65534 when the host is root), so no
uid inside maps to host root; new user, pid, network, ipc, uts, mount and cgroup namespaces; every
capability dropped; no nested user namespaces; a new session (no TIOCSTI); `/usr` read-only and nothing
else of the host (of /etc only ld.so.cache, localtime and a generated passwd/group/hosts; no /home,
/root, /tmp, /run, /sys); the workspace, /tmp and /dev/shm each a tmpfs of `workspace_mb`; test files
mounted read-only for run_tests; a cleared environment (bwrap itself starts with only PATH); rlimits
on CPU time, address space, processes, file size and open files; a seccomp denylist (mount, ptrace,
bpf, io_uring, keyctl, namespaces, ...) loaded with libseccomp; a cgroup with memory and pids limits
where the cgroup tree is writable; a wall-clock limit that kills the whole pid namespace (detached and
re-parented children included); output truncated at `output_bytes` and flagged.
WEAK tier ("weak"), used where bubblewrap is missing or namespaces are refused, and labelled so: a
separate uid (only when the host runs as root), rlimits, seccomp with only AF_UNIX sockets, a subreaper
that kills leftover processes, cgroup limits where writable, a private temporary workspace directory.

What this does NOT isolate:
- The kernel: a kernel bug reachable through the allowed syscalls escapes both tiers (no VM, no gVisor).
- CPU and I/O bandwidth: no cgroup cpu or io limits, only RLIMIT_CPU; a run can slow its neighbours.
- Timing and shared hardware side channels; /proc/cpuinfo, /proc/meminfo and the kernel version are visible.
- Abstract AF_UNIX sockets in the WEAK tier (no network namespace); in the FULL tier only loopback
  inside the sandbox is reachable.
- In the WEAK tier: host files and directories readable or writable by the sandbox uid (world-writable
  /tmp, /var/tmp, /dev/shm), processes of the same uid (they can be read through /proc and signalled),
  disk space outside RLIMIT_FSIZE (many files), and detached processes that kill the subreaper first when
  no cgroup is available; without a cgroup, RLIMIT_NPROC (which counts every process of the uid) is the
  process limit, so weak sandboxes share it (with one, pids.max bounds each run and RLIMIT_NPROC is not set).
  Without root on the host there is no uid separation at all.
- Memory without a writable cgroup: RLIMIT_AS caps each process, not their sum (bounded by max_procs).
- The clock: the time namespace is shared. Warm-pool runs share their slot's sandbox over time (it is
  wiped and every leftover process killed between runs) and its cgroup limits cover the slot, not a run.
- Code under test tampering with its own test process: solution code imported by the tests can patch
  assertion helpers, or find the report pipe (/proc/self/fd), write forged counts to it and exit. Grading
  uses pristine, read-only test files, ignores conftest.py/ini files, counts through a private pipe and
  does not count a skipped test as passed, but the tests and the solution share one process. Tasks whose
  tests are also data (every synthetic task, what RL trains on) are therefore graded by value (`run_calls`,
  environments/grading.py): the expected values never enter the sandbox, so a forged report still has to
  compute every hidden answer; in the WEAK tier without a separate uid the host's task directory, and so the
  expected values, is readable. A task graded by a test run (Exercism's) keeps the gap, and the warm pool,
  never used for grading, shares it.
"""

from realtime_rl.environments.sandbox.pool import WarmPool
from realtime_rl.environments.sandbox.probe import Probe, probe_isolation
from realtime_rl.environments.sandbox.results import CallReport, IsolationLevel, RunResult, TestReport
from realtime_rl.environments.sandbox.sandbox import Sandbox

__all__ = ["CallReport", "IsolationLevel", "Probe", "RunResult", "Sandbox", "TestReport", "WarmPool", "probe_isolation"]
