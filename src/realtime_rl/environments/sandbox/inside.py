"""The bootstrap that runs *inside* the sandbox, under the system interpreter (`/usr/bin/python3 -I -c`).

It never imports realtime_rl (the project's venv is not reachable from the sandbox) and uses only the
standard library. It reads one header from stdin (8-byte big-endian length, then JSON), writes the
files into the working directory, sets rlimits, loads the seccomp filter, and then, by `mode`:

    exec     execs `argv`; the rest of stdin is the command's stdin
    pytest   runs pytest in this process with a counting plugin; counts go to `report_fd` as JSON
    light    runs the warm pool's light runner (`warm_src`) once, in this fresh sandbox; counts likewise
    calls    imports `module`, calls `function` on each of `inputs` (JSON values, a fresh copy each) and
             writes each return value (as tagged JSON), or the exception it raised, to `report_fd`: no expected
             value enters the sandbox, so the host compares them (value grading)
    zygote   the warm-pool server: one forked child per request (see `serve`)
    probe    reports what the sandbox looks like from inside (uid, capabilities, seccomp, pytest)

With `reaper` set (the weak tier, no pid namespace) the exec, pytest, light and calls modes fork: the parent is a
child subreaper that kills every leftover descendant when the command ends or on SIGTERM.
"""

from __future__ import annotations

import binascii
import ctypes
import errno
import json
import os
import resource
import signal
import struct
import sys
import time

PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 4, 36, 38
# Syscalls nobody's tests need and that widen the kernel attack surface; they fail with EPERM.
DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "mount", "umount2", "pivot_root",
    "chroot", "unshare", "setns", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
    "swapoff", "syslog", "acct", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "open_by_handle_at", "name_to_handle_at", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "iopl", "ioperm", "quotactl", "lookup_dcookie", "vhangup", "fanotify_init", "move_mount", "open_tree",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "uselib", "personality",
)
NAMESPACE_FLAGS = (0x80, 0x20000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
AF_UNIX = 1


def read_exact(fd: int, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            raise EOFError(f"stream ended after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_message(fd: int) -> dict | None:
    try:
        (size,) = struct.unpack(">Q", read_exact(fd, 8))
    except EOFError:
        return None
    return json.loads(read_exact(fd, size))


def write_message(fd: int, obj: dict) -> None:
    data = json.dumps(obj).encode()
    data = struct.pack(">Q", len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def safe_path(root: str, rel: str) -> str:
    parts = rel.split("/")
    if not rel or rel.startswith("/") or "\0" in rel or ".." in parts:
        raise ValueError(f"bad file name {rel!r}")
    return os.path.join(root, *[p for p in parts if p not in ("", ".")])


def write_files(root: str, files: list) -> None:
    for rel, b64 in files:
        path = safe_path(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(binascii.a2b_base64(b64))


def set_rlimits(limits: dict) -> None:
    mb = 1024 * 1024
    wanted = {
        resource.RLIMIT_CPU: (limits["cpu_s"], limits["cpu_s"] + 1),
        resource.RLIMIT_AS: (limits["memory_mb"] * mb,) * 2,
        **({} if limits["max_procs"] is None else {resource.RLIMIT_NPROC: (limits["max_procs"],) * 2}),
        resource.RLIMIT_FSIZE: (limits["file_size_mb"] * mb,) * 2,
        resource.RLIMIT_NOFILE: (limits["open_files"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }
    for res, (soft, hard) in wanted.items():
        _, cur_hard = resource.getrlimit(res)
        if cur_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, cur_hard), min(hard, cur_hard)
        resource.setrlimit(res, (soft, hard))


class ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]


def apply_seccomp(deny_network: bool) -> None:
    """Load a denylist filter with libseccomp (ctypes); with `deny_network`, only AF_UNIX sockets."""
    lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(ArgCmp)]
    lib.seccomp_load.argtypes = lib.seccomp_release.argtypes = [ctypes.c_void_p]
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    ctx = lib.seccomp_init(allow)
    if not ctx:
        raise OSError("seccomp_init failed")

    def rule(action: int, name: str, *cmps: tuple[int, int, int, int]) -> None:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:
            return  # not a syscall on this architecture
        array = (ArgCmp * max(1, len(cmps)))(*[ArgCmp(*c) for c in cmps])
        rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), array if cmps else None)
        if rc < 0:
            raise OSError(-rc, f"seccomp rule for {name}: {os.strerror(-rc)}")

    try:
        for name in DENIED_SYSCALLS:
            rule(eperm, name)
        rule(enosys, "clone3")  # flags live in a struct seccomp cannot read; libc falls back to clone
        for flag in NAMESPACE_FLAGS:
            rule(eperm, "clone", (0, 7, flag, flag))  # SCMP_CMP_MASKED_EQ: a new namespace of any kind
        if deny_network:
            rule(0x00050000 | errno.EACCES, "socket", (0, 1, AF_UNIX, 0))  # SCMP_CMP_NE AF_UNIX
        rc = lib.seccomp_load(ctx)
        if rc < 0:
            raise OSError(-rc, f"seccomp_load: {os.strerror(-rc)}")
    finally:
        lib.seccomp_release(ctx)


def prctl(option: int, value: int) -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option})")


def other_pids() -> list[int]:
    me = os.getpid()
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]


def descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for pid in other_pids():
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                parents[pid] = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier and pid not in found}
        found |= frontier
    return sorted(found)


def kill_leftovers(own_pid_namespace: bool, deadline_s: float = 2.0) -> None:
    """Kill every process this one started (and their orphans), until none is left or the deadline.

    Done means two scans in a row found none, zombies included (ours are reaped each pass): a process listed by
    one scan can fork and exit before its line is read, and its child, missing from that scan's listing, is a
    descendant in the next one; a zombie is such a process, so a scan that still lists one is not clean."""
    end, clean = time.monotonic() + deadline_s, 0
    while time.monotonic() < end:
        if own_pid_namespace:
            try:
                os.kill(-1, signal.SIGKILL)  # everything in the namespace but us and its init
            except ProcessLookupError:
                pass
            left = other_pids()
        else:
            left = descendants(os.getpid())
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        while True:  # reap our zombies (orphans of a subreaper land here)
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        clean = clean + 1 if not left else 0
        if clean == 2:
            return
        time.sleep(0.001)


def run_pytest(args: list, report_fd: int) -> int:
    import pytest

    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}

    class Counter:
        def pytest_runtest_logreport(self, report):
            if report.when == "call":
                key = {"passed": "passed", "failed": "failed"}.get(report.outcome, "skipped")
                if hasattr(report, "wasxfail"):
                    key = "skipped"
                counts[key] += 1
            elif report.outcome == "failed":
                counts["errors"] += 1
            elif report.outcome == "skipped" and report.when == "setup":
                counts["skipped"] += 1

        def pytest_collectreport(self, report):
            if report.outcome == "failed":
                counts["errors"] += 1

    code = int(pytest.main(args, plugins=[Counter()]))
    sys.stdout.flush()
    sys.stderr.flush()
    write_message(report_fd, {**counts, "exit_code": code})
    return code


BUILTINS = ((bool, "bool", bool), (int, "int", int.__int__), (float, "float", float.__float__),
            (str, "str", str.__str__))
"""The scalar types, each with how to read an instance as exactly that type (a subclass's own __str__ is not
asked: a str Enum member's value is what a test's == compares)."""
SEQUENCES = ((tuple, "tuple"), (list, "list"), (frozenset, "frozenset"), (set, "set"))


def encode_value(value, max_depth: int, depth: int = 0):
    """A returned value as tagged JSON, [type, payload], for the host to rebuild and compare with `==`: None,
    bool, int, float, complex, str, bytes, tuple, list, set, frozenset and dict, each instance read as that
    builtin type (an IntEnum as its int); anything else is a TypeError (grading by value cannot compare it)."""
    if depth > max_depth:
        raise ValueError(f"the return value nests deeper than {max_depth}")
    if value is None:
        return ["none", None]
    for kind, name, plain in BUILTINS:
        if isinstance(value, kind):
            return [name, plain(value)]
    if isinstance(value, complex):
        return ["complex", [value.real, value.imag]]
    if isinstance(value, (bytes, bytearray)):
        return ["bytes", binascii.b2a_base64(bytes(value), newline=False).decode()]
    for kind, name in SEQUENCES:
        if isinstance(value, kind):
            return [name, [encode_value(v, max_depth, depth + 1) for v in value]]
    if isinstance(value, dict):
        return ["dict", [[encode_value(k, max_depth, depth + 1), encode_value(v, max_depth, depth + 1)]
                         for k, v in value.items()]]
    raise TypeError(f"returned a {type(value).__name__}, which grading by value does not compare")


def run_calls(module: str, function: str, inputs: list, max_chars: int, max_depth: int, report_fd: int) -> int:
    """Each input's ["value", encode_value(return value)] or ["error", "Type: message"], in order, to `report_fd`,
    or {"import_error": ...} when the function cannot be imported; a value longer than `max_chars` as JSON is an
    error."""
    import importlib

    try:
        fn = getattr(importlib.import_module(module), function)
    except BaseException as e:  # noqa: BLE001 - whatever the module does on import, no call can run
        report = {"import_error": f"{type(e).__name__}: {e}"[:1000]}
    else:
        results = []
        for text in inputs:
            try:
                value = encode_value(fn(json.loads(text)), max_depth)
                size = len(json.dumps(value))
                results.append(["value", value] if size <= max_chars else
                               ["error", f"the return value is {size} characters of JSON"])
            except BaseException as e:  # noqa: BLE001 - SystemExit and friends fail the case, not the run
                results.append(["error", f"{type(e).__name__}: {e}"[:1000]])
        report = {"results": results}
    sys.stdout.flush()
    sys.stderr.flush()
    write_message(report_fd, report)
    return 0


def run_with_reaper(body) -> int:
    """Fork: the child runs body(); this process, a subreaper, kills what the child left behind."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    child = os.fork()
    if child == 0:
        os._exit(body())
    signal.signal(signal.SIGTERM, lambda *_: (kill_leftovers(False), os._exit(128 + signal.SIGTERM)))
    _, status = os.waitpid(child, 0)
    kill_leftovers(False)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def probe_report() -> dict:
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.strip()
    try:
        import pytest  # noqa: F401
        has_pytest = True
    except ImportError:
        has_pytest = False
    return {"uid": os.getuid(), "cap_eff": status.get("CapEff"), "seccomp": status.get("Seccomp"),
            "no_new_privs": status.get("NoNewPrivs"), "pytest": has_pytest, "python": sys.version.split()[0]}


def main() -> None:
    header = read_message(0)
    if header is None:
        sys.exit("no header on stdin")
    workdir, mode = header["workdir"], header["mode"]
    keep = {0, 1, 2, header.get("report_fd", -1)}
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the descriptor of the directory listing itself
    prctl(PR_SET_NO_NEW_PRIVS, 1)  # setuid binaries grant nothing (bwrap sets it too; the weak tier needs it)
    seccomp_error = None
    if header.get("seccomp"):
        try:
            apply_seccomp(header.get("deny_network", False))
        except OSError as e:
            seccomp_error = str(e)
            if mode != "probe":
                sys.exit(f"sandbox: seccomp was required but failed: {e}")
    if mode == "probe":
        write_message(1, {**probe_report(), "seccomp_error": seccomp_error})
        return
    write_files(workdir, header.get("files", []))
    os.chdir(workdir)
    if mode == "zygote":
        warm: dict = {"__name__": "rtrl_warm"}
        exec(compile(header["warm_src"], "inside_warm.py", "exec"), warm)
        warm["serve"](header)
        return
    if mode == "exec":
        argv = header["argv"]

        def body() -> int:
            set_rlimits(header["limits"])
            try:
                os.execvp(argv[0], argv)
            except OSError as e:
                print(f"sandbox: cannot run {argv[0]!r}: {e.strerror}", file=sys.stderr)
                return 127
    elif mode == "pytest":
        sys.path.append(workdir)  # like `python -m pytest`, but after the standard library

        def body() -> int:
            set_rlimits(header["limits"])
            return run_pytest(header["pytest_args"], header["report_fd"])
    elif mode == "light":
        sys.path.append(workdir)  # as in pytest mode: the workspace after the standard library
        runner: dict = {"__name__": "rtrl_light"}
        exec(compile(header["warm_src"], "inside_warm.py", "exec"), runner)

        def body() -> int:
            set_rlimits(header["limits"])
            return runner["run_light"](header["test_files"], header["report_fd"], "light runner")
    elif mode == "calls":
        sys.path.append(workdir)  # as in pytest mode: the workspace after the standard library

        def body() -> int:
            set_rlimits(header["limits"])
            return run_calls(header["module"], header["function"], header["inputs"], header["max_value_chars"],
                             header["max_value_depth"], header["report_fd"])
    else:
        sys.exit(f"unknown mode {mode!r}")
    sys.exit(run_with_reaper(body) if header.get("reaper") else body())


if __name__ == "__main__":
    main()
