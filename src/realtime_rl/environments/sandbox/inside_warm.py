"""The warm-pool server and its light test runner; runs inside the sandbox (inside.py loads it, mode zygote).

`serve` pre-imports the standard library a test needs, makes itself non-dumpable (so the code it runs
cannot ptrace it or read its memory), says "ready" and then answers one request at a time: it forks a
child that writes the files into a fresh run directory, sets the rlimits and runs the light runner
with stdout/stderr on pipes; it enforces the timeout, kills every process the run left behind, wipes
the workspace and scratch directories and replies with the (truncated) output and the counts.

The light runner mirrors what pytest 7 collects and counts for the common cases: module-level `test*`
functions without arguments and unittest.TestCase classes (setUp/tearDown, subTest, skips). The workspace
goes at the *end* of sys.path and conftest.py / ini files are ignored, as in the cold path's pytest
flags. Anything else (a test file that imports pytest, fixtures, plain Test* classes, xunit setup
functions, setUpClass, expected failures, generators, coroutines) makes it answer "fallback" so the
caller runs pytest in a fresh sandbox instead of guessing. It runs in the same process as the code
under test (as pytest does), so that code can tamper with the counting of its own run; grading never uses a
warm slot, whose sandbox outlives the run, but may run `run_light` once in a fresh sandbox (inside.py, mode
light).
"""

from __future__ import annotations

import fcntl
import gc
import importlib.util
import json
import os
import select
import signal
import sys
import time

import __main__ as inside  # the bootstrap (inside.py) that loaded this source

# unittest, inspect and traceback (with linecache, tokenize and re behind it) are imported where a run needs
# them: they are half of the CPU a cold light run costs (grading starts a fresh interpreter per run), and
# most test files need none of them. The warm-pool server imports them once, before it forks.
FunctionType = type(lambda: None)
CO_GENERATOR, CO_COROUTINE = 0x20, 0x80

PRELOAD = ("collections", "dataclasses", "datetime", "decimal", "enum", "fractions", "functools", "heapq",
           "itertools", "math", "operator", "random", "re", "string", "typing")
XUNIT_NAMES = ("setUpModule", "tearDownModule", "setup_module", "teardown_module", "setup_function",
               "teardown_function", "setup", "teardown")
CLASS_HOOKS = ("setUpClass", "tearDownClass", "setup_class", "teardown_class", "setup_method",
               "teardown_method")


class Fallback(Exception):
    """The runner cannot promise pytest's answer for this test file."""


class _NeverRaised(Exception):
    pass


def skip_test() -> type:
    """unittest.SkipTest, or an exception nothing raises while no test file has imported unittest."""
    unittest = sys.modules.get("unittest")
    return unittest.SkipTest if unittest is not None else _NeverRaised


def takes_arguments(func) -> bool:
    """Whether `func` has a parameter without a default (pytest would look for a fixture), as
    inspect.signature says; read off the code object unless a decorator left a signature to follow."""
    if "__wrapped__" in vars(func) or "__signature__" in vars(func):
        import inspect

        return any(p.default is p.empty for p in inspect.signature(func).parameters.values())
    code = func.__code__
    return (code.co_argcount > len(func.__defaults__ or ())
            or code.co_kwonlyargcount > len(func.__kwdefaults__ or {}))


class CaseResult:
    """What unittest reports to; without addSubTest, like pytest's, so a failing subTest ends the test."""

    failfast = shouldStop = False

    def __init__(self) -> None:
        self.errors: list = []
        self.skipped: str | None = None
        self.passed = False

    def startTest(self, test) -> None: ...
    def stopTest(self, test) -> None: ...
    def addSuccess(self, test) -> None: self.passed = True
    def addFailure(self, test, err) -> None: self.errors.append(err)
    def addError(self, test, err) -> None: self.errors.append(err)
    def addSkip(self, test, reason) -> None: self.skipped = reason
    def addExpectedFailure(self, test, err) -> None: self.errors.append(err)
    def addUnexpectedSuccess(self, test) -> None: self.errors.append(None)


def collect(module) -> list:
    """(name, callable returning a CaseResult) for every test pytest would collect from `module`."""
    for name in XUNIT_NAMES:
        if callable(getattr(module, name, None)):
            raise Fallback(f"module-level {name}()")
    items = []
    unittest = sys.modules.get("unittest")  # a TestCase subclass means its module imported unittest
    for name, obj in list(vars(module).items()):
        if isinstance(obj, type):
            if unittest is not None and issubclass(obj, unittest.TestCase):
                items += collect_case(obj)
            elif name.startswith("Test"):
                raise Fallback(f"plain test class {name}")
            continue
        if not (name.startswith("test") or getattr(obj, "__test__", False) is True) or not callable(obj):
            continue
        func = getattr(obj, "__func__", obj)
        if not isinstance(func, FunctionType) or not getattr(func, "__test__", True):
            continue  # pytest warns and skips non-functions
        if func.__code__.co_flags & (CO_GENERATOR | CO_COROUTINE):
            raise Fallback(f"{name} is a generator or coroutine")
        if takes_arguments(func):
            raise Fallback(f"{name} takes fixtures")
        items.append((name, lambda func=func: run_function(func)))
    return items


def collect_case(cls: type) -> list:
    import unittest

    if not getattr(cls, "__test__", True):
        return []
    for hook in CLASS_HOOKS:
        for klass in cls.__mro__:
            if klass is unittest.TestCase:
                break
            if hook in vars(klass):
                raise Fallback(f"{cls.__name__}.{hook}")
    names = unittest.TestLoader().getTestCaseNames(cls)
    if not names and hasattr(cls, "runTest"):
        raise Fallback(f"{cls.__name__}.runTest")
    items = []
    for name in names:
        method = getattr(cls, name)
        if not getattr(method, "__test__", True):
            continue
        if any(getattr(x, "__unittest_expecting_failure__", False) for x in (cls, method)):
            raise Fallback(f"{cls.__name__}.{name} is an expected failure")
        items.append((f"{cls.__name__}.{name}", lambda cls=cls, name=name: run_case(cls, name)))
    return items


def run_case(cls: type, name: str) -> CaseResult:
    result = CaseResult()
    cls(name).run(result)
    return result


def run_function(func) -> CaseResult:
    result = CaseResult()
    try:
        func()
        result.passed = True
    except skip_test() as e:
        result.skipped = str(e)
    except KeyboardInterrupt:
        raise
    except BaseException:
        result.errors.append(sys.exc_info())
    return result


def format_failure(etype, value, tb) -> str:
    """The traceback without unittest's and this runner's frames, as unittest and pytest show it."""
    import traceback

    frames = [(frame, line) for frame, line in traceback.walk_tb(tb)
              if not frame.f_globals.get("__unittest") and frame.f_code.co_filename != "inside_warm.py"]
    stack = "".join(traceback.StackSummary.extract(iter(frames)).format())
    error = "".join(traceback.format_exception_only(etype, value))
    return f"Traceback (most recent call last):\n{stack}{error}"


def run_light(test_files: list, report_fd: int, label: str = "warm runner") -> int:
    """Run the tests; write {passed, failed, errors, skipped, exit_code, fallback} to report_fd."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "fallback": None}
    try:
        modules = []
        for rel in test_files:
            path = os.path.abspath(rel)
            name = os.path.basename(rel)[:-3]
            if not rel.endswith(".py") or os.path.exists(os.path.join(os.path.dirname(path), "__init__.py")):
                raise Fallback(f"{rel}: only .py test files outside packages")
            if name in sys.modules:
                raise Fallback(f"{rel}: module name {name} is already imported")
            if os.path.dirname(path) not in sys.path:
                sys.path.append(os.path.dirname(path))
            try:
                spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                spec.loader.exec_module(module)
                modules.append(module)
            except skip_test():
                raise Fallback(f"{rel} skips at import") from None
            except Exception:
                import traceback

                counts["errors"] += 1
                print(f"{'_' * 20} ERROR collecting {rel} {'_' * 20}\n{traceback.format_exc()}")
        if "pytest" in sys.modules:
            raise Fallback("a test file imports pytest")
        items = [item for module in modules for item in collect(module)]
    except Fallback as e:
        counts["fallback"] = str(e)
        inside.write_message(report_fd, {**counts, "exit_code": None})
        return 0
    code = 2 if counts["errors"] else (5 if not items else 0)
    if not counts["errors"]:
        for name, run in items:
            result = run()
            if result.errors:
                counts["failed"] += 1
                print(f"{'_' * 20} {name} {'_' * 20}")
                for err in result.errors:
                    print("unexpected success" if err is None else format_failure(*err))
            elif result.skipped is not None and not result.passed:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
        code = 1 if counts["failed"] else code
    summary = ", ".join(f"{counts[k]} {k}" for k in ("failed", "passed", "skipped", "errors") if counts[k])
    # No wall time here (pytest prints one): the output is an observation the model reads and the
    # pre-training corpus records, so it must be a function of the code alone; duration_s has the time.
    print(f"{'=' * 10} {summary or 'no tests ran'} ({label}) {'=' * 10}")
    sys.stdout.flush()
    inside.write_message(report_fd, {**counts, "exit_code": code})
    return code


def clear_dir(path: str) -> None:
    import shutil

    def unlock(func, p, _):
        os.chmod(os.path.dirname(p), 0o700)
        os.chmod(p, 0o700)
        func(p)

    for entry in os.listdir(path):
        full = os.path.join(path, entry)
        try:
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full, onerror=unlock)
            else:
                os.unlink(full)
        except OSError:
            pass


class Child:
    """A forked child that waits for its request on a pipe: the fork happens between runs, not during one."""

    def __init__(self, rundir: str) -> None:
        (req_r, self.req_w), (self.out_r, out_w), (self.err_r, err_w), (self.rep_r, rep_w) = (
            os.pipe(), os.pipe(), os.pipe(), os.pipe())
        gc.freeze()  # the child's collections leave the inherited heap alone: fewer copy-on-write faults
        self.pid = os.fork()
        if self.pid == 0:
            child_main(rundir, req_r, out_w, err_w, rep_w)
        for fd in (req_r, out_w, err_w, rep_w):
            os.close(fd)
        self.pidfd = os.pidfd_open(self.pid)

    def close(self) -> None:
        for fd in (self.req_w, self.out_r, self.err_r, self.rep_r, self.pidfd):
            try:
                os.close(fd)
            except OSError:
                pass


def child_main(rundir: str, req_r: int, out_w: int, err_w: int, rep_w: int) -> None:
    code = 70
    try:
        devnull = os.open("/dev/null", os.O_RDONLY)
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (devnull, out_w, err_w, rep_w, req_r)]
        for target, fd in enumerate(high):  # 0 stdin, 1 stdout, 2 stderr, 3 report, 4 request
            os.dup2(fd, target)
        os.closerange(5, 65536)
        req = inside.read_message(4)
        if req is None:
            os._exit(0)
        os.close(4)
        inside.prctl(inside.PR_SET_DUMPABLE, 1)
        inside.set_rlimits(req["limits"])
        inside.write_files(rundir, req["files"])
        os.chdir(rundir)
        code = run_light(req["test_files"], 3)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def run_one(req: dict, child: Child, workdir: str, scratch: list, own_pidns: bool) -> dict:
    start = time.monotonic()
    try:
        inside.write_message(child.req_w, req)
    except OSError:
        pass  # the child is gone; it is reported as a run without a report
    limit = req["output_bytes"]
    bufs = {child.out_r: bytearray(), child.err_r: bytearray(), child.rep_r: bytearray()}
    caps = {child.out_r: limit, child.err_r: limit, child.rep_r: 1 << 20}
    truncated, status, open_fds = False, None, set(bufs)
    deadline = start + req["timeout_s"]
    while open_fds or status is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        watch = list(open_fds) + ([child.pidfd] if status is None else [])
        for fd in select.select(watch, [], [], remaining)[0]:
            if fd == child.pidfd:
                status = os.waitpid(child.pid, 0)[1]
                inside.kill_leftovers(own_pidns)  # so pipes held by grandchildren reach EOF
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.discard(fd)
            keep = max(0, caps[fd] - len(bufs[fd]))
            bufs[fd] += chunk[:keep]
            truncated |= len(chunk) > keep and fd != child.rep_r
    timed_out = status is None
    if timed_out:
        os.kill(child.pid, signal.SIGKILL)
        status = os.waitpid(child.pid, 0)[1]
    inside.kill_leftovers(own_pidns)
    child.close()
    for path in [workdir, *scratch]:
        clear_dir(path)
    rep = bufs[child.rep_r]
    complete = len(rep) >= 8 and len(rep) == 8 + int.from_bytes(rep[:8], "big")
    try:  # the code under test can write to the report pipe too: anything but one JSON object is no report
        report = json.loads(bytes(rep[8:])) if complete else None
    except (ValueError, RecursionError):
        report = None
    report = report if isinstance(report, dict) else None
    return {
        "timed_out": timed_out, "report": report, "truncated": truncated,
        "exit_code": os.waitstatus_to_exitcode(status), "duration_s": time.monotonic() - start,
        "stdout": bufs[child.out_r].decode(errors="replace"),
        "stderr": bufs[child.err_r].decode(errors="replace"),
    }


def serve(header: dict) -> None:
    for name in (*PRELOAD, "inspect", "shutil", "traceback", "unittest"):
        __import__(name)
    import linecache
    import unittest

    linecache.getlines(unittest.case.__file__)  # tracebacks of failed assertions read it: read it once
    own_pidns = header["own_pid_namespace"]
    inside.prctl(inside.PR_SET_DUMPABLE, 0)
    if not own_pidns:
        inside.prctl(inside.PR_SET_CHILD_SUBREAPER, 1)
    workdir, scratch = header["workdir"], header.get("scratch_dirs", [])
    rundir = os.path.join(workdir, "run")
    gc.collect()
    child = Child(rundir)
    inside.write_message(1, {"ready": True})
    while True:
        req = inside.read_message(0)
        if req is None:
            os.kill(child.pid, signal.SIGKILL)
            return
        os.mkdir(rundir)
        reply = run_one(req, child, workdir, scratch, own_pidns)
        inside.write_message(1, reply)
        child = Child(rundir)  # while the host reads the reply
