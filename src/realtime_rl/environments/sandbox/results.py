"""What a sandboxed run returns: the isolation level it ran under, a process result, a test report."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class IsolationLevel(str, Enum):
    """The tier a run reached; `description` says what it isolates and what it does not. Every RunResult
    also carries `isolation_label`, what the probe found on this machine (cgroups, seccomp, uid)."""

    FULL = "bwrap"
    WEAK = "weak"

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    IsolationLevel.FULL: (
        "bubblewrap: user/pid/net/ipc/uts/mount/cgroup namespaces, no capabilities, non-root uid, read-only "
        "system, size-limited tmpfs workspace, rlimits, seccomp denylist, cgroup limits where writable"),
    IsolationLevel.WEAK: (
        "no namespaces: separate uid when the host is root, rlimits, seccomp (only AF_UNIX sockets) where "
        "libseccomp loads, subreaper cleanup, cgroup limits where writable; files readable or writable by "
        "that uid, world-writable directories and processes of the same uid are NOT protected"),
}


@dataclass(frozen=True)
class RunResult:
    """One sandboxed process (and everything it started). Output is decoded as UTF-8 with replacement."""

    exit_code: int | None
    """Exit status; 128+N when killed by signal N; None when the run timed out."""
    stdout: str
    stderr: str
    timed_out: bool
    """The wall-clock limit passed and the whole process tree was killed."""
    output_truncated: bool
    """stdout or stderr was longer than SandboxConfig.output_bytes and was cut."""
    duration_s: float
    isolation: IsolationLevel
    isolation_label: str
    """What this run was actually isolated with (namespaces, uid, seccomp, cgroup or why not)."""
    signal: int | None = None
    """The signal that ended the command, when the exit status says so (exit_code > 128)."""
    memory_limit_hit: bool = False
    """The cgroup memory limit killed a process (only known where cgroups are writable)."""
    pids_limit_hit: bool = False
    """A fork was refused by the cgroup pids limit (only known where cgroups are writable)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class TestReport:
    """Counts from one test run, as pytest counts them (a unittest subTest failure fails its test once)."""

    __test__ = False  # a class named Test* that pytest must not collect

    passed: int
    failed: int
    errors: int
    """Collection errors (a test file that does not import) and setup/teardown errors."""
    ok: bool
    """Exit status 0, at least one test passed, none failed, errored or was skipped (a solution can skip the tests it
    cannot pass), no timeout."""
    output: str
    """pytest's (or the warm runner's) stdout then stderr, each truncated at output_bytes."""
    run: RunResult
    timed_out: bool
    skipped: int = 0
    warm: bool = False
    """Ran in a warm-pool slot (light runner) rather than a fresh sandbox with pytest."""
    fallback_reason: str | None = None
    """Why a warm-pool request ran cold instead (the runner could not promise pytest's answer)."""


@dataclass(frozen=True)
class CallReport:
    """One function called on each of its inputs in a fresh sandbox (value grading): what came back per input."""

    results: list[tuple[str, Any]] | None
    """Per input, in order: ("value", the return value as inside.encode_value's tagged JSON) or ("error",
    "Type: message"); None when the function could not be imported or the run ended without a report (a crash,
    an exit, a timeout) or with one that does not answer every input."""
    import_error: str | None
    """Why the function could not be imported ("Type: message"), when that is what happened."""
    output: str
    """What the run printed (stdout then stderr, truncated at output_bytes), and the sandbox's notes."""
    run: RunResult
    timed_out: bool
