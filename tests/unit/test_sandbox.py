"""The sandbox API on real runs: files in, output out, limits, timeouts, exact test counts, cold and warm.

Every test runs real sandboxed processes (bubblewrap where the machine allows it, else the weak tier,
whichever the probe reaches); nothing is mocked.
"""

from __future__ import annotations

import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from realtime_rl.config import SandboxConfig
from realtime_rl.environments.sandbox import IsolationLevel, Sandbox, WarmPool, probe_isolation
from tests.conftest import EXERCISM
from tests.integration.test_value_grading import FORGE as VALUE_GRADING_FORGE


def _probe_or_skip():
    try:
        return probe_isolation("auto")
    except RuntimeError as e:
        pytest.skip(f"no sandbox tier can run here: {e}")


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    _probe_or_skip()
    return Sandbox(SandboxConfig(wall_s=20))


@pytest.fixture(scope="module")
def pool(sandbox):
    with WarmPool(sandbox=sandbox) as pool:
        yield pool


def host_pids_with(token: str) -> list[int]:
    """Live host processes whose command line carries `token`."""
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and token.encode() in open(f"/proc/{name}/cmdline", "rb").read():
                if open(f"/proc/{name}/stat", "rb").read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X"):
                    found.append(int(name))
        except OSError:
            pass
    return found


def test_probe_labels_the_tier(sandbox):
    assert sandbox.isolation_level in (IsolationLevel.FULL, IsolationLevel.WEAK)
    assert sandbox.isolation_label and sandbox.isolation_level.description
    result = sandbox.run(["true"], {})
    assert result.isolation == sandbox.isolation_level and result.isolation_label == sandbox.isolation_label
    if sandbox.probe.cgroups.version is None:
        assert "no cgroup limits" in sandbox.isolation_label


def test_files_in_stdin_in_output_out(sandbox):
    files = {"a.txt": "alpha", "sub/dir/b.bin": bytes([0, 1, 2, 255]),
             "prog.py": "import sys\nprint(sys.stdin.read())"}
    result = sandbox.run(["sh", "-c", "cat a.txt; od -An -tu1 sub/dir/b.bin; python3 prog.py; echo err >&2"],
                         files, stdin=b"from stdin")
    assert result.ok and not result.timed_out and not result.output_truncated
    assert result.stdout.split() == ["alpha", "0", "1", "2", "255", "from", "stdin"]
    assert result.stderr == "err\n"


def test_runs_as_unprivileged_user_with_clean_environment(sandbox):
    os.environ["RTRL_HOST_ONLY"] = "host-secret"
    try:
        result = sandbox.run(["python3", "-c", "import os; print(os.getuid(), dict(os.environ))"], {})
        ids = sandbox.run(["python3", "-c", "import os; print(os.getuid(), os.getgid(), os.getgroups())"], {})
    finally:
        del os.environ["RTRL_HOST_ONLY"]
    assert result.ok and int(result.stdout.split()[0]) != 0
    assert "host-secret" not in result.stdout
    if os.geteuid() == 0:  # a root host drops to nobody:nogroup and all supplementary groups (launch.SETPRIV)
        assert ids.stdout.split(maxsplit=2) == ["65534", "65534", "[]\n"]


@pytest.mark.parametrize("name", ["/etc/passwd", "../x.py", "a/../../x.py", "", ".", "a\0b", "a\\b"])
def test_bad_file_names_are_rejected(sandbox, name):
    with pytest.raises(ValueError, match="file name"):
        sandbox.run(["true"], {name: "x"})


def test_bad_arguments_are_rejected(sandbox):
    with pytest.raises(ValueError, match="argv"):
        sandbox.run("ls", {})
    with pytest.raises(ValueError, match="timeout_s"):
        sandbox.run(["true"], {}, timeout_s=0)
    with pytest.raises(ValueError, match="not among the files"):
        sandbox.run_tests({"a.py": ""}, ["test_a.py"])
    with pytest.raises(ValueError, match="str or bytes"):
        sandbox.run(["true"], {"a": 3})


def test_exit_codes(sandbox):
    assert sandbox.run(["sh", "-c", "exit 3"], {}).exit_code == 3
    killed = sandbox.run(["python3", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], {})
    assert (killed.exit_code, killed.signal) == (137, 9)
    missing = sandbox.run(["no-such-command"], {})
    assert missing.exit_code == 127 and "no-such-command" in missing.stderr


def test_output_is_truncated_and_flagged():
    _probe_or_skip()
    small = Sandbox(SandboxConfig(output_bytes=1024))
    result = small.run(["python3", "-c", "print('x' * 100_000); print('y' * 10, flush=True)"], {})
    assert result.ok and result.output_truncated and len(result.stdout) == 1024
    assert not small.run(["echo", "short"], {}).output_truncated


def test_timeout_kills_the_whole_tree(sandbox):
    token = "rtrl-timeout-tree"
    program = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    while True: pass\ntime.sleep(60)\n")
    result = sandbox.run(["python3", "-c", program, token], {}, timeout_s=1.0)
    assert result.timed_out and result.exit_code is None and result.duration_s < 4
    assert host_pids_with(token) == []


def test_a_program_may_start_threads_under_the_memory_limit():
    """glibc's per-thread malloc arenas are address space that RLIMIT_AS counts: 512 MB used to stop at 14."""
    program = ("import threading, time\n"
               "threads = [threading.Thread(target=time.sleep, args=(0.2,)) for _ in range(30)]\n"
               "for t in threads:\n    t.start()\nprint('started', len(threads))\n")
    result = Sandbox(SandboxConfig(memory_mb=512)).run(["python3", "-c", program], {})
    assert result.exit_code == 0 and result.stdout.strip() == "started 30", result.stderr


def test_memory_and_file_size_limits(sandbox):
    mem = sandbox.run(["python3", "-c", "b = bytearray(2 * 1024**3)"], {})
    assert not mem.ok and "MemoryError" in mem.stderr
    big = sandbox.run(["python3", "-c", "open('f', 'wb').write(b'x' * (64 * 1024**2))"], {})
    assert not big.ok  # RLIMIT_FSIZE (16 MB by default) stops the write


UNITTEST_MIXED = """
import unittest
from sol import f

class T(unittest.TestCase):
    def setUp(self):
        if self._testMethodName == "test_setup_error":
            raise RuntimeError("boom")

    def test_ok(self):
        self.assertEqual(f(), 1)

    def test_setup_error(self):
        pass

    @unittest.skip("not now")
    def test_skipped(self):
        pass

    def test_subtests(self):
        for i in range(3):
            with self.subTest(i=i):
                self.assertEqual(i % 2, 0)
"""
PYTEST_STYLE = "from sol import f\n\ndef test_a():\n    assert f() == 1\n\ndef test_b():\n    assert f(){}2\n"
# name: (test file source, expected (passed, failed, errors, skipped), ok)
CASES = {
    "pytest_pass": (PYTEST_STYLE.format(" + 1 == "), (2, 0, 0, 0), True),
    "pytest_fail": (PYTEST_STYLE.format(" == "), (1, 1, 0, 0), False),
    "unittest_mixed": (UNITTEST_MIXED, (1, 2, 0, 1), False),
    "import_error": ("from sol import missing\n\ndef test_a():\n    pass\n", (0, 0, 1, 0), False),
    "syntax_error": ("def test_a(:\n    pass\n", (0, 0, 1, 0), False),
    "no_tests": ("x = 1\n", (0, 0, 0, 0), False),
    "raises": ("def test_a():\n    raise KeyError(1)\n\ndef test_b():\n    pass\n", (1, 1, 0, 0), False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_counts_match_pytest_cold_and_warm(sandbox, pool, case):
    source, (passed, failed, errors, skipped), ok = CASES[case]
    files = {"sol.py": "def f():\n    return 1\n", "test_sol.py": source}
    cold = sandbox.run_tests(files, ["test_sol.py"])
    warm = pool.run_tests(files, ["test_sol.py"])
    for report in (cold, warm):
        counts = (report.passed, report.failed, report.errors, report.skipped)
        assert counts == (passed, failed, errors, skipped), report.output
        assert report.ok is ok and not report.timed_out
    assert warm.warm and warm.fallback_reason is None


def test_warm_falls_back_to_pytest_for_fixtures(pool):
    files = {"test_fx.py": "import pytest\n\n@pytest.fixture\ndef n():\n    return 2\n\n"
                           "def test_n(n):\n    assert n == 2\n\n@pytest.mark.parametrize('x', [1, 2, 3])\n"
                           "def test_x(x):\n    assert x < 3\n"}
    report = pool.run_tests(files, ["test_fx.py"])
    assert not report.warm and "pytest" in report.fallback_reason
    assert (report.passed, report.failed) == (3, 1)


def test_warm_pool_is_thread_safe(pool):
    files = {"sol.py": "def f():\n    return 1\n", "test_sol.py": CASES["pytest_fail"][0]}
    with ThreadPoolExecutor(4) as ex:
        reports = list(ex.map(lambda _: pool.run_tests(files, ["test_sol.py"]), range(24)))
    assert all((r.passed, r.failed, r.warm) == (1, 1, True) for r in reports)


def test_warm_output_is_a_function_of_the_code(pool):
    """The output is an observation the policy reads and the pre-training corpus records: no wall time in it,
    so two runs of the same files print the same bytes (the run's duration_s keeps the time)."""
    files = {"sol.py": "def f():\n    return 1\n",
             "test_sol.py": "import time\n\nfrom sol import f\n\ndef test_a():\n    time.sleep(0.05)\n"
                            "    assert f() == 1\n\ndef test_b():\n    assert f() == 2\n"}
    first, second = (pool.run_tests(files, ["test_sol.py"]) for _ in range(2))
    assert first.warm and (first.passed, first.failed) == (1, 1)
    assert first.output == second.output and "(warm runner)" in first.output
    assert not re.search(r"\d\.\d+ ?s\b", first.output), first.output
    assert first.run.duration_s >= 0.05


def test_warm_slot_survives_a_hang_and_a_killed_slot(pool):
    hang = {"test_h.py": "def test_h():\n    while True:\n        pass\n"}
    report = pool.run_tests(hang, ["test_h.py"], timeout_s=1.0)
    assert report.timed_out and not report.ok and report.warm
    kill_slot = {"test_k.py": "import os\n\ndef test_k():\n    os.kill(os.getppid(), 9)  # the slot server\n"}
    report = pool.run_tests(kill_slot, ["test_k.py"])
    assert not report.warm and "slot failed" in report.fallback_reason  # ran cold; the slot is replaced
    ok = {"test_ok.py": "def test_ok():\n    pass\n"}
    reports = [pool.run_tests(ok, ["test_ok.py"]) for _ in range(4)]
    assert all(r.ok and r.warm for r in reports)


# The forger of test_value_grading, handed the report's bytes as they are (not a report to dump as JSON)
FORGE = VALUE_GRADING_FORGE.replace("data = json.dumps(report).encode()", "data = report")


@pytest.mark.parametrize("forged", [
    b"[]",  # a report that is no object: the host read .get on a list and the grading raised
    b'{"passed": 1, "x": ' + b"[" * 980 + b"]" * 980 + b"}",  # parsed in the slot; too deep for the host's stack
])
def test_a_report_forged_by_the_code_under_test_is_no_report_and_the_pool_serves_on(pool, forged):
    files = {"test_f.py": "import f\n\ndef test_f():\n    pass\n", "f.py": FORGE + f"_forge({forged!r})\n"}
    report = pool.run_tests(files, ["test_f.py"])
    assert not report.ok and report.passed == 0 and report.fallback_reason  # graded as no report, cold
    ok = {"test_ok.py": "def test_ok():\n    pass\n"}
    assert all(r.ok and r.warm for r in (pool.run_tests(ok, ["test_ok.py"]) for _ in range(3)))


def test_a_fallback_run_gets_what_is_left_of_the_calls_timeout_not_a_fresh_one(sandbox, pool):
    """A solution that sleeps, then exits before reporting, makes the warm run (or the light runner) fall back to
    pytest: the whole run_tests call stays within its timeout, so the fallback times out here."""
    files = {"test_s.py": "import s\n\ndef test_s():\n    assert s.ok()\n",
             "s.py": "import os, time\ntime.sleep(1.5)\nos._exit(1)\n"}
    warm = pool.run_tests(files, ["test_s.py"], timeout_s=2.5)
    assert warm.fallback_reason and warm.timed_out and not warm.ok
    light = sandbox.run_tests(files, ["test_s.py"], timeout_s=2.5, runner="light")
    assert light.fallback_reason and light.timed_out and not light.ok


def test_warm_runs_do_not_leak_into_each_other(pool):
    full = pool.sandbox.isolation_level == IsolationLevel.FULL
    scratch = "/tmp" if full else "."  # the weak tier's /tmp is the host's
    plant = {"test_p.py": f"def test_p():\n    open('{scratch}/planted', 'w').write('x')\n"
                          "    open('../planted.py', 'w').write('X = 1')\n"}
    assert pool.run_tests(plant, ["test_p.py"]).ok
    check = {"test_c.py": f"import os\n\ndef test_c():\n    assert not os.path.exists('{scratch}/planted')\n"
                          "    assert not os.path.exists('../planted.py')\n"}
    assert all(pool.run_tests(check, ["test_c.py"]).ok for _ in range(2 * pool.config.pool_size))


def _exercism_tasks():
    if not EXERCISM.is_dir():
        pytest.skip(f"task data not found at {EXERCISM}")
    from realtime_rl.environments.tasks import load_tasks

    return load_tasks(EXERCISM)


# ledger is a refactoring exercise: its stub is working (ugly) code and passes its own tests.
STUB_PASSES = {"ledger"}


def _graded(task, which: str) -> tuple[dict, list[str]]:
    files = task.workspace()
    if which == "reference":
        files.update(task.reference_solution())
    files.update(task.pristine_tests())
    return files, list(task.test_files)


def test_exercism_warm_references_pass_and_stubs_fail(pool):
    tasks = _exercism_tasks()
    with ThreadPoolExecutor(pool.config.pool_size) as ex:
        ref = list(ex.map(lambda t: pool.run_tests(*_graded(t, "reference")), tasks))
        stub = list(ex.map(lambda t: pool.run_tests(*_graded(t, "stub")), tasks))
    assert [t.task_id for t, r in zip(tasks, ref, strict=True) if not r.ok] == []
    passing_stubs = [t.task_id for t, r in zip(tasks, stub, strict=True) if r.ok]
    assert passing_stubs == sorted(STUB_PASSES & {t.task_id for t in tasks})
    assert all(r.warm for r in ref + stub), [r.fallback_reason for r in ref + stub if not r.warm]


@pytest.mark.slow
def test_exercism_grading_cold_matches_warm(sandbox, pool):
    """Fresh sandboxes with pytest: every reference passes, every stub fails, same counts as the warm pool
    and as the light runner in fresh sandboxes (which falls back to pytest where it must)."""
    tasks = _exercism_tasks()
    jobs = [(t, which) for t in tasks for which in ("reference", "stub")]
    with ThreadPoolExecutor(2) as ex:
        cold = list(ex.map(lambda j: sandbox.run_tests(*_graded(*j)), jobs))
        light = list(ex.map(lambda j: sandbox.run_tests(*_graded(*j), runner="light"), jobs))
    warm = [pool.run_tests(*_graded(*j)) for j in jobs]
    for (task, which), c, w, lt in zip(jobs, cold, warm, light, strict=True):
        expect_ok = which == "reference" or task.task_id in STUB_PASSES
        assert c.ok is expect_ok, f"{task.task_id} {which}: {c.output[-500:]}"
        assert (c.passed, c.failed, c.errors) == (w.passed, w.failed, w.errors), f"{task.task_id} {which}"
        assert (lt.ok, lt.passed, lt.failed, lt.errors) == (c.ok, c.passed, c.failed, c.errors), \
            f"{task.task_id} {which}: {lt.output[-500:]}"
    assert sum(r.fallback_reason is None for r in light) > len(light) // 2  # most ran without pytest


WRAPPED = ("import functools\n\ndef deco(f):\n    @functools.wraps(f)\n    def w(*a, **k):\n"
           "        return f(*a, **k)\n    return w\n\n@deco\ndef test_a(n):\n    pass\n")
# name: (test file source, the light runner's fallback reason or None where it answers itself)
LIGHT_CASES = {
    "skip_in_a_function": ("import unittest\n\ndef test_a():\n    raise unittest.SkipTest('no')\n\n"
                           "def test_b():\n    pass\n", None),
    "defaults": ("def test_a(x=1, *, y=2):\n    assert x + y == 3\n", None),
    "keyword_fixture": ("def test_a(*, n):\n    pass\n", "takes fixtures"),
    "wrapped_fixture": (WRAPPED, "takes fixtures"),
    "coroutine": ("async def test_a():\n    pass\n", "generator or coroutine"),
    "skip_at_import": ("import unittest\nraise unittest.SkipTest('later')\n", "skips at import"),
}


@pytest.mark.parametrize("case", sorted(CASES) + sorted(LIGHT_CASES))
def test_light_runner_counts_as_pytest_importing_only_what_a_test_file_uses(sandbox, case):
    """The light runner in a fresh sandbox imports unittest, inspect and traceback only where a test file
    needs them (a fresh interpreter per grade pays for each import); its counts are pytest's either way."""
    source, reason = LIGHT_CASES[case] if case in LIGHT_CASES else (CASES[case][0], None)
    files = {"sol.py": "def f():\n    return 1\n", "test_sol.py": source}
    light = sandbox.run_tests(files, ["test_sol.py"], runner="light")
    cold = sandbox.run_tests(files, ["test_sol.py"], runner="pytest")
    counts = [(r.ok, r.passed, r.failed, r.errors, r.skipped) for r in (light, cold)]
    assert counts[0] == counts[1], light.output
    assert (light.fallback_reason is None) if reason is None else reason in light.fallback_reason


def test_light_runner_in_a_fresh_sandbox_counts_as_pytest_and_falls_back_to_it(sandbox):
    tests = {"test_add.py": "from calc import add\n\ndef test_add():\n    assert add(1, 2) == 3\n\n"
                            "def test_neg():\n    assert add(-1, -2) == -3\n"}
    files = {"calc.py": "def add(a, b):\n    return a + b if a > 0 else 0\n", **tests}
    light = sandbox.run_tests(files, ["test_add.py"], runner="light")
    cold = sandbox.run_tests(files, ["test_add.py"], runner="pytest")
    assert (light.ok, light.passed, light.failed) == (cold.ok, cold.passed, cold.failed) == (False, 1, 1)
    assert light.fallback_reason is None and "light runner" in light.output
    uses_pytest = {"calc.py": files["calc.py"], "test_add.py": "import pytest\n" + tests["test_add.py"]}
    report = sandbox.run_tests(uses_pytest, ["test_add.py"], runner="light")
    assert (report.passed, report.failed) == (1, 1)
    assert "imports pytest" in report.fallback_reason
    hang = {"calc.py": "while True:\n    pass\n", **tests}
    report = sandbox.run_tests(hang, ["test_add.py"], runner="light", timeout_s=1)
    assert report.timed_out and not report.ok and report.fallback_reason is None
    with pytest.raises(ValueError, match="runner"):
        sandbox.run_tests(files, ["test_add.py"], runner="nose")


def test_grading_uses_pristine_read_only_tests(sandbox):
    tests = {"test_add.py": "from calc import add\n\ndef test_add():\n    assert add(1, 2) == 3\n"}
    agent = {"calc.py": "def add(a, b):\n    return 0\n", "test_add.py": "def test_add():\n    assert True\n",
             "conftest.py": "raise SystemExit(0)\n"}
    graded = {**agent, **tests}
    report = sandbox.run_tests(graded, ["test_add.py"])
    assert (report.ok, report.passed, report.failed) == (False, 0, 1)
    if sandbox.isolation_level == IsolationLevel.FULL:  # the weak tier cannot mount the tests read-only
        files = {"calc.py": CALC_WRITES_TESTS, "test_add.py": TESTS_SEE_WRITE}
        report = sandbox.run_tests(files, ["test_add.py"])
        assert (report.ok, report.passed) == (True, 2), report.output


CALC_WRITES_TESTS = """
import os
try:
    os.chmod("test_add.py", 0o666)
    with open("test_add.py", "a") as f:
        f.write("x")
    wrote = True
except OSError:
    wrote = False

def add(a, b):
    return a + b
"""
TESTS_SEE_WRITE = """
from calc import add, wrote

def test_add():
    assert add(1, 2) == 3

def test_read_only():
    assert not wrote
"""


def test_threads_share_one_probe():
    _probe_or_skip()
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(Sandbox().probe)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(seen) == 4 and all(p is seen[0] for p in seen)


def test_grade_cache_runs_identical_workspaces_once(sandbox):
    """Concurrent requests for one workspace make one sandboxed run and share its report; other files run
    on their own; a run that timed out is never replayed."""
    from realtime_rl.environments.grading import GradeCache

    tests = {"test_add.py": "from calc import add\n\ndef test_add():\n    assert add(1, 2) == 3\n"}
    right = {"calc.py": "def add(a, b):\n    return a + b\n", **tests}
    wrong = {"calc.py": "def add(a, b):\n    return a - b\n", **tests}
    cache = GradeCache(sandbox)
    with ThreadPoolExecutor(4) as ex:
        reports = list(ex.map(lambda files: cache.run_tests(files, ["test_add.py"]),
                              [right] * 4 + [wrong] * 2))
    assert [r.ok for r in reports] == [True] * 4 + [False] * 2
    assert (cache.runs, cache.hits) == (2, 4)
    assert all(r is reports[0] for r in reports[:4])
    changed = {**right, "calc.py": right["calc.py"] + "\n"}  # a byte differs
    assert cache.run_tests(changed, ["test_add.py"]).ok
    assert cache.runs == 3
    slow = {"calc.py": "import time\ntime.sleep(30)\n\ndef add(a, b):\n    return a + b\n", **tests}
    first = cache.run_tests(slow, ["test_add.py"], timeout_s=1)
    assert first.timed_out
    assert cache.run_tests(slow, ["test_add.py"], timeout_s=1) is not first
    assert cache.runs == 5
    with pytest.raises(ValueError, match="max_entries"):
        GradeCache(sandbox, max_entries=0)


def test_run_calls_returns_each_value_or_what_was_raised_and_the_cache_runs_it_once(sandbox):
    """Each input is decoded afresh for its call (a call that mutates it changes nothing for the next); what the
    function raised is per call; builtin values come back as what they were (tagged JSON, rebuilt on the host),
    other types as an error; an import that fails is said once; a run that exits answers nothing."""
    from realtime_rl.environments.grading import NOT_A_VALUE, GradeCache, decode_value

    files = {"calc.py": "def twice(xs):\n    if xs == [0]:\n        raise ValueError('zero')\n    out = xs * 2\n"
                        "    xs += xs\n    return out\n"}
    report = sandbox.run_calls(files, "calc", "twice", ["[1]", "[0]", "[1]", '"ab"'])
    assert [kind for kind, _ in report.results] == ["value", "error", "value", "value"]
    assert [decode_value(v) if kind == "value" else v for kind, v in report.results] == [
        [1, 1], "ValueError: zero", [1, 1], "abab"]
    assert report.import_error is None and not report.timed_out
    kinds = {"calc.py": "import enum, fractions\n\n\nclass E(str, enum.Enum):\n    A = 'a'\n\n\n"
                        "def twice(x):\n    return [None, True, 2, 2.5, 1j, 'a', b'\\x00', (1,),"
                        " {3}, frozenset({4}), {'k': [5]}, fractions.Fraction(1, 2), E.A][x]\n"}
    values = sandbox.run_calls(kinds, "calc", "twice", [str(i) for i in range(13)]).results
    assert [decode_value(v) for _, v in values[:11]] == [None, True, 2, 2.5, 1j, "a", b"\x00", (1,), {3},
                                                         frozenset({4}), {"k": [5]}]
    assert decode_value(values[12][1]) == "a"  # a str Enum member is its value, as a test's == sees it
    assert type(decode_value(values[1][1])) is bool and type(decode_value(values[7][1])) is tuple
    assert values[11] == ("error", "TypeError: returned a Fraction, which grading by value does not compare")
    assert decode_value(["list", [["int", "1"]]]) is NOT_A_VALUE and decode_value(["x", 1]) is NOT_A_VALUE
    broken = sandbox.run_calls({"calc.py": "def twice(:\n"}, "calc", "twice", ["1"])
    assert broken.results is None and broken.import_error.startswith("SyntaxError")
    gone = sandbox.run_calls({"calc.py": "import os\n\ndef twice(x):\n    os._exit(0)\n"}, "calc", "twice", ["1"])
    assert gone.results is None and gone.import_error is None
    slow = sandbox.run_calls({"calc.py": "import time\n\ndef twice(x):\n    time.sleep(30)\n"}, "calc", "twice",
                             ["1"], timeout_s=1)
    assert slow.timed_out and slow.results is None
    with pytest.raises(ValueError, match="identifiers"):
        sandbox.run_calls(files, "calc.py", "twice", ["1"])
    with pytest.raises(ValueError, match="JSON texts"):
        sandbox.run_calls(files, "calc", "twice", [1])
    cache = GradeCache(sandbox)
    first = cache.run_calls(files, "calc", "twice", ["[1]"])
    assert cache.run_calls(files, "calc", "twice", ["[1]"]) is first
    assert decode_value(cache.run_calls(files, "calc", "twice", ["[2]"]).results[0][1]) == [2, 2]
    assert (cache.runs, cache.hits) == (2, 1)


def test_remove_tree_removes_an_unwritable_tree_and_never_touches_its_parent(tmp_path):
    """A tree sandboxed code made read-only goes; removing one that is gone already (a worker removed its own,
    then the backend tried) must not chmod the parent: it once turned /tmp into 0700."""
    from realtime_rl.environments.sandbox.launch import remove_tree

    parent = tmp_path / "parent"
    tree = parent / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "f").write_text("x")
    (tree / "sub").chmod(0o500)
    parent.chmod(0o755)
    remove_tree(tree)
    assert not tree.exists()
    remove_tree(tree)
    assert parent.stat().st_mode & 0o777 == 0o755


def test_a_run_queued_behind_a_busy_slot_waits_as_long_as_slot_wait_s_then_runs_cold():
    """A cold fallback prints pytest's output, not the warm runner's: the gate's paired evaluation passes a
    wait (queue_wait_s) that no queue of its runs can pass, so each of its runs is warm."""
    _probe_or_skip()
    from realtime_rl.environments.sandbox.pool import queue_wait_s

    busy = {"test_b.py": "import time\n\ndef test_b():\n    time.sleep(3)\n"}
    ok = {"test_ok.py": "def test_ok():\n    pass\n"}
    for wait_s, warm in ((0.5, False), (queue_wait_s(2, 1, timeout_s=5.0), True)):
        with WarmPool(SandboxConfig(wall_s=20, pool_size=1), slot_wait_s=wait_s) as one_slot, \
                ThreadPoolExecutor(1) as other:
            blocking = other.submit(one_slot.run_tests, busy, ["test_b.py"], timeout_s=5.0)
            time.sleep(0.5)  # the busy run has the slot
            report = one_slot.run_tests(ok, ["test_ok.py"])
            assert blocking.result(timeout=30).ok and report.ok and report.warm == warm
            assert warm or f"no warm slot became free within {wait_s:g} s" in report.fallback_reason
