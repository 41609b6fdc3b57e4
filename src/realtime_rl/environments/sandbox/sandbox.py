"""`Sandbox`: one fresh sandbox per call, for commands (`run`) and for test runs and grading (`run_tests`).

`run_tests` runs pytest inside the sandbox with a counting plugin whose counts come back over a
private pipe (so they do not depend on parsing output that the code under test can print). The test
files are mounted read-only (FULL tier), and pytest ignores conftest.py and ini files and appends the
workspace to sys.path after the standard library, so a workspace cannot swap the test runner, its
configuration or a standard module the tests import. This is what grading uses.

`runner="light"` runs the warm pool's light runner (inside_warm.py) instead, still in a fresh sandbox
with read-only tests and counts over the private pipe: the same counts as pytest for module-level test
functions and unittest classes, without importing pytest (~3x less CPU a run); for anything else it
answers "fallback" and the run is repeated with pytest (`TestReport.fallback_reason` says why).
`SandboxConfig.test_runner` picks the default.

`run_calls` imports a module of the workspace and calls one function on each input, in a fresh sandbox, and
returns what each call returned (builtin values as tagged JSON) or raised: grading compares the values with
expected ones the sandbox never holds, so code that forges a test report (see the package's docstring) still has
to compute every answer.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from realtime_rl.config import SandboxConfig
from realtime_rl.environments.sandbox.launch import (
    Outcome,
    SandboxProcess,
    b64_files,
    check_name,
    encode_files,
)
from realtime_rl.environments.sandbox.probe import Probe, probe_isolation
from realtime_rl.environments.sandbox.results import CallReport, IsolationLevel, RunResult, TestReport

LIGHT_RUNNER_SOURCE = (Path(__file__).parent / "inside_warm.py").read_text()
MAX_VALUE_DEPTH = 64
"""How deep a returned value may nest for `run_calls` to report it (lists in lists ...)."""
MAX_VALUE_CHARS = 32768
"""The longest return value (as tagged JSON) `run_calls` reports; a longer one is an error (no expected value is)."""
PYTEST_ARGS = ["-q", "-p", "no:cacheprovider", "-c", "/dev/null", "--rootdir", ".", "--noconftest",
               "--import-mode=append"]


def check_tests(files: Mapping[str, bytes], test_files: Sequence[str]) -> list[str]:
    if isinstance(test_files, str):
        raise ValueError("test_files must be a list of file names, not a string")
    names = [check_name(t) for t in test_files]
    if not names:
        raise ValueError("test_files is empty: name at least one test file")
    missing = [t for t in names if t not in files]
    if missing:
        raise ValueError(f"test files not among the files: {', '.join(missing)}")
    return names


def signal_of(exit_code: int | None) -> int | None:
    """The signal that ended a command, from the shell-style exit status 128+N."""
    return exit_code - 128 if exit_code is not None and 128 < exit_code < 160 else None


def parse_report(data: bytes) -> dict | None:
    """The report a run wrote to its private pipe: one framed JSON object, or None (none, cut, two, not JSON:
    the code under test can write to that pipe too)."""
    if len(data) < 8 or len(data) != 8 + struct.unpack(">Q", data[:8])[0]:
        return None
    try:
        report = json.loads(data[8:])
    except (ValueError, RecursionError):  # RecursionError: a forged report of deeply nested brackets
        return None
    return report if isinstance(report, dict) else None


class Sandbox:
    """Runs untrusted code, each call in a fresh sandbox at the strongest tier this machine allows."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self.probe: Probe = probe_isolation(self.config.isolation)

    @property
    def isolation_level(self) -> IsolationLevel:
        return self.probe.level

    @property
    def isolation_label(self) -> str:
        return self.probe.label

    def resolve_timeout(self, timeout_s: float | None) -> float:
        """`timeout_s`, or the config's wall_s when None; must be positive."""
        if timeout_s is None:
            return self.config.wall_s
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        return float(timeout_s)

    def result(self, outcome: Outcome) -> RunResult:
        code = outcome.exit_code
        return RunResult(
            exit_code=code, stdout=outcome.stdout.decode(errors="replace"),
            stderr=outcome.stderr.decode(errors="replace"), timed_out=outcome.timed_out,
            output_truncated=outcome.truncated, duration_s=outcome.duration_s, isolation=self.probe.level,
            isolation_label=self.probe.label, signal=signal_of(code),
            memory_limit_hit=outcome.memory_limit_hit, pids_limit_hit=outcome.pids_limit_hit)

    def run(self, argv: list[str], files: Mapping[str, str | bytes], *, stdin: bytes | None = None,
            timeout_s: float | None = None) -> RunResult:
        """Run `argv` (PATH lookup inside the sandbox) in a workspace holding `files`."""
        if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError(f"argv must be a non-empty list of strings, got {argv!r}")
        timeout = self.resolve_timeout(timeout_s)
        header = {"mode": "exec", "argv": list(argv), "files": b64_files(encode_files(files))}
        process = SandboxProcess(self.probe, self.config, header)
        return self.result(process.communicate(stdin or b"", timeout, self.config.output_bytes))

    def run_tests(self, files: Mapping[str, str | bytes], test_files: Sequence[str], *,
                  timeout_s: float | None = None, runner: Literal["pytest", "light"] | None = None
                  ) -> TestReport:
        """`test_files` (among `files`) in a fresh sandbox, tests read-only in the FULL tier: with pytest, or
        with the light runner and pytest where it falls back (runner None: the config's `test_runner`)."""
        runner = runner or self.config.test_runner
        if runner not in ("pytest", "light"):
            raise ValueError(f"runner must be 'pytest' or 'light', got {runner!r}")
        if not self.probe.pytest:
            raise RuntimeError("the sandbox's interpreter has no pytest (Debian: apt install python3-pytest)")
        encoded = encode_files(files)
        tests = check_tests(encoded, test_files)
        timeout = self.resolve_timeout(timeout_s)
        deadline = time.monotonic() + timeout  # the whole call's, a fallback run included
        workspace = b64_files({k: v for k, v in encoded.items() if k not in tests})
        ro_files = {t: encoded[t] for t in tests}

        def launch(header: dict) -> tuple[RunResult, dict | None]:
            process = SandboxProcess(self.probe, self.config, header, ro_files=ro_files, report=True)
            outcome = process.communicate(b"", remaining(deadline), self.config.output_bytes)
            return self.result(outcome), parse_report(outcome.report)

        reason = None
        if runner == "light":
            run, counts = launch({"mode": "light", "warm_src": LIGHT_RUNNER_SOURCE, "test_files": tests,
                                  "files": workspace})
            if run.timed_out or (counts is not None and not counts.get("fallback")):
                return make_report(run, counts)
            reason = counts["fallback"] if counts else "the light run ended without a report (crash or exit)"
        run, counts = launch({"mode": "pytest", "pytest_args": [*PYTEST_ARGS, *tests], "files": workspace})
        return make_report(run, counts, fallback_reason=reason)

    def run_calls(self, files: Mapping[str, str | bytes], module: str, function: str, inputs: Sequence[str], *,
                  timeout_s: float | None = None) -> CallReport:
        """Import `module` (a module of `files`), call `function` on each of `inputs` (JSON texts, each decoded
        afresh for its call) in a fresh sandbox, and return what each call returned (tagged JSON: grading's
        `decode_value` rebuilds it) or raised."""
        if not (module.isidentifier() and function.isidentifier()):
            raise ValueError(f"module and function must be identifiers, got {module!r} and {function!r}")
        if isinstance(inputs, str) or not all(isinstance(i, str) for i in inputs):
            raise ValueError("inputs must be a list of JSON texts")
        header = {"mode": "calls", "module": module, "function": function, "inputs": list(inputs),
                  "max_value_chars": MAX_VALUE_CHARS, "max_value_depth": MAX_VALUE_DEPTH,
                  "files": b64_files(encode_files(files))}
        process = SandboxProcess(self.probe, self.config, header, report=True)
        outcome = process.communicate(b"", self.resolve_timeout(timeout_s), self.config.output_bytes)
        run = self.result(outcome)
        report = (parse_report(outcome.report) if run.exit_code == 0 else None) or {}
        results, import_error = report.get("results"), report.get("import_error")
        if not (isinstance(results, list) and len(results) == len(inputs) and all(
                isinstance(r, list) and len(r) == 2 and (r[0] == "value" or r[0] == "error" and isinstance(r[1], str))
                for r in results)):
            results = None
        return CallReport([(kind, payload) for kind, payload in results] if results is not None else None,
                          import_error if isinstance(import_error, str) and results is None else None,
                          run_output(run), run, run.timed_out)


MIN_RUN_S = 0.1


def remaining(deadline: float) -> float:
    """What is left of a run_tests call's timeout for its next launch (at least MIN_RUN_S: a fallback started
    at the deadline times out rather than getting a fresh timeout)."""
    return max(MIN_RUN_S, deadline - time.monotonic())


def run_output(run: RunResult) -> str:
    """stdout, then stderr, then what the sandbox has to say (a timeout, truncation)."""
    output = run.stdout
    if run.stderr:
        output += ("" if not output or output.endswith("\n") else "\n") + run.stderr
    if run.timed_out:
        output += "\n[sandbox] timed out; every process of the run was killed\n"
    if run.output_truncated:
        output += "\n[sandbox] output truncated\n"
    return output


def make_report(run: RunResult, counts: dict | None, warm: bool = False,
                fallback_reason: str | None = None) -> TestReport:
    keys = ("passed", "failed", "errors", "skipped")
    if not counts or not all(type(counts.get(k, 0)) is int and counts.get(k, 0) >= 0 for k in keys):
        counts = {}  # none, or not counts (the code under test can write to the report pipe)
    passed, failed, errors, skipped = (counts.get(k, 0) for k in keys)
    # A skipped test is not a passed one: a solution that raises SkipTest (or calls pytest.skip) on the inputs it
    # cannot handle must not be graded as solving them.
    ok = (run.exit_code == 0 and counts.get("exit_code") == 0 and not run.timed_out
          and passed >= 1 and failed == 0 and errors == 0 and skipped == 0)
    return TestReport(passed=passed, failed=failed, errors=errors, ok=ok, output=run_output(run), run=run,
                      timed_out=run.timed_out, skipped=skipped, warm=warm,
                      fallback_reason=fallback_reason)
