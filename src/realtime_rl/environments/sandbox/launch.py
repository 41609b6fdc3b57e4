"""Starting one sandboxed process and talking to it: the bwrap command line, uid, cgroup, header, output.

A `SandboxProcess` is the system interpreter running inside.py, either inside bubblewrap (FULL) or
directly under a separate uid with a temporary host directory as its workspace (WEAK). Files go in
through the header on stdin; pristine test files go in as read-only bind mounts (FULL) so nothing in
the sandbox can rewrite them. Where cgroups are writable the process starts behind a one-line gate
(`sh -c 'read; exec ...'`) so that it is inside its cgroup before anything it runs can fork.
`communicate` feeds stdin, reads stdout/stderr (keeping at most `output_bytes` of each) and the report
pipe, and kills the whole tree at the deadline.
"""

from __future__ import annotations

import base64
import json
import os
import selectors
import shutil
import signal
import struct
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from realtime_rl.config import SandboxConfig
from realtime_rl.environments.sandbox.cgroups import RunCgroup
from realtime_rl.environments.sandbox.results import IsolationLevel

PYTHON = "/usr/bin/python3"
WORKSPACE = "/workspace"
INSIDE_SOURCE = (Path(__file__).parent / "inside.py").read_text()
GATE = ["/bin/sh", "-c", 'read -r _ && exec "$@"', "sh"]
SETPRIV = next((p for p in ("/usr/bin/setpriv", "/bin/setpriv") if os.access(p, os.X_OK)), None)
"""util-linux's setpriv: a root host drops to the sandbox uid through it, after exec, instead of through
Popen(user=...). Popen must fork() to change uid (it vforks otherwise), and fork copies the page tables of
the whole parent: 20 ms and 10 ms of CPU per run from a 600 MB rollout worker (0.8 ms with vfork)."""
INNER_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
             "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "MALLOC_ARENA_MAX": "2"}
"""MALLOC_ARENA_MAX: glibc reserves a 64 MB malloc arena of address space per thread, which RLIMIT_AS counts:
without a cap, 512 MB stopped a program at 14 threads."""


def frame(obj: dict) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack(">Q", len(data)) + data


def check_name(name: str) -> str:
    """A workspace-relative POSIX path; absolute paths, `..` and empty names are refused."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        raise ValueError(f"file name must be a non-empty relative POSIX path, got {name!r}")
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts:
        raise ValueError(f"file name {name!r} must be relative to the workspace and must not contain '..'")
    if not path.parts or path.parts == (".",):
        raise ValueError(f"file name {name!r} names no file")
    return str(path)


def encode_files(files: Mapping[str, str | bytes]) -> dict[str, bytes]:
    out = {}
    for name, content in files.items():
        if isinstance(content, str):
            content = content.encode()
        if not isinstance(content, bytes):
            raise ValueError(f"content of {name!r} must be str or bytes, got {type(content).__name__}")
        out[check_name(name)] = content
    return out


def b64_files(files: Mapping[str, bytes]) -> list[list[str]]:
    """The header's form of files: [relative path, base64 content]."""
    return [[name, base64.b64encode(data).decode()] for name, data in files.items()]


def limits(config: SandboxConfig, nproc_rlimit: bool = True) -> dict:
    """The rlimits inside.py sets; `max_procs` None leaves RLIMIT_NPROC alone (SandboxProcess.nproc_rlimit)."""
    return {"cpu_s": config.cpu_s, "memory_mb": config.memory_mb,
            "max_procs": config.max_procs if nproc_rlimit else None,
            "file_size_mb": config.file_size_mb, "open_files": config.open_files}


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    _write_all(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def etc_files(uid: int, gid: int) -> dict[str, str]:
    """The only /etc the sandbox sees besides ld.so.cache and localtime: who it is, and localhost."""
    return {"/etc/passwd": f"root:x:0:0::/:/usr/sbin/nologin\nsandbox:x:{uid}:{gid}::{WORKSPACE}:/bin/sh\n",
            "/etc/group": f"root:x:0:\nsandbox:x:{gid}:\n",
            "/etc/hosts": "127.0.0.1 localhost\n::1 localhost\n"}


def bwrap_argv(bwrap: str, config: SandboxConfig, ro_files: Mapping[str, int],
               etc_fds: Mapping[str, int]) -> list[str]:
    """Every namespace, no capabilities, read-only /usr, tmpfs workspace, /tmp and /dev/shm, clean env."""
    size = str(config.workspace_mb * 1024 * 1024)
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--cap-drop", "ALL", "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/", name)
        if host.is_symlink():
            argv += ["--symlink", os.readlink(host), str(host)]
        elif host.is_dir():
            argv += ["--ro-bind", str(host), str(host)]
    argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
             "--ro-bind-try", "/etc/localtime", "/etc/localtime"]
    for dest, fd in etc_fds.items():
        argv += ["--perms", "0444", "--ro-bind-data", str(fd), dest]
    argv += ["--dev", "/dev", "--proc", "/proc",
             "--size", size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
             "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", WORKSPACE]
    for parent in sorted({str(PurePosixPath(rel).parent) for rel in ro_files} - {"."}):
        argv += ["--dir", f"{WORKSPACE}/{parent}"]
    for rel, fd in ro_files.items():
        argv += ["--perms", "0444", "--ro-bind-data", str(fd), f"{WORKSPACE}/{rel}"]
    argv += ["--remount-ro", "/", "--chdir", WORKSPACE, "--clearenv"]
    for key, value in {**INNER_ENV, "HOME": WORKSPACE, "USER": "sandbox"}.items():
        argv += ["--setenv", key, value]
    return [*argv, "--"]


@dataclass
class Outcome:
    stdout: bytes
    stderr: bytes
    report: bytes
    truncated: bool
    timed_out: bool
    exit_code: int | None
    duration_s: float
    memory_limit_hit: bool = False
    pids_limit_hit: bool = False


class SandboxProcess:
    """One sandboxed interpreter running inside.py with `header` (mode, files, argv, ...)."""

    def __init__(self, probe, config: SandboxConfig, header: dict, *,
                 ro_files: Mapping[str, bytes] | None = None, report: bool = False) -> None:
        self.probe, self.config = probe, config
        self.full = probe.level == IsolationLevel.FULL
        self.cgroup = self.host_workdir = self.report_r = None
        self.started = time.monotonic()
        fds: list[int] = []
        try:
            if probe.cgroups.version:
                # pids.max also covers the two bubblewrap processes (the monitor and the namespace's init)
                self.cgroup = RunCgroup.create(probe.cgroups, config.memory_mb, config.max_procs + 2)
            # RLIMIT_NPROC counts every process of the uid: in the WEAK tier (no user namespace) that is every
            # weak sandbox's and every FULL one's of the same uid, so one run's fork bomb (or many runs) made
            # the others' forks fail. Where the run has its own cgroup, pids.max bounds it alone instead.
            self.nproc_rlimit = self.full or self.cgroup is None
            uid, gid = probe.uid, probe.gid
            ro_files = dict(ro_files or {})
            if self.full:
                workdir, cwd = WORKSPACE, "/"
                etc_fds = {dest: _memfd("etc", text.encode()) for dest, text in etc_files(uid, gid).items()}
                ro_fds = {rel: _memfd("ro", data) for rel, data in ro_files.items()}
                fds += [*etc_fds.values(), *ro_fds.values()]
                argv = bwrap_argv(probe.bwrap_path, config, ro_fds, etc_fds)
                env = {"PATH": "/usr/bin:/bin"}  # the outer bwrap's environment is readable from inside
            else:
                workdir = cwd = self.host_workdir = tempfile.mkdtemp(prefix="rtrl-sandbox-")
                if os.geteuid() == 0:
                    os.chown(workdir, uid, gid)
                header = {**header, "files": header.get("files", []) + b64_files(ro_files)}
                argv, env = [], {**INNER_ENV, "HOME": workdir}
            if report:
                self.report_r, report_w = os.pipe()
                fds.append(report_w)
                header = {**header, "report_fd": report_w}
            header = {"workdir": workdir, "seccomp": probe.seccomp, "deny_network": not self.full,
                      "reaper": not self.full, "limits": limits(config, self.nproc_rlimit), **header}
            argv = [*(GATE if self.cgroup else []), *argv, PYTHON, "-I", "-c", INSIDE_SOURCE]
            user: dict = {}
            if os.geteuid() == 0 and SETPRIV:
                argv = [SETPRIV, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--", *argv]
            elif os.geteuid() == 0:
                user = dict(user=uid, group=gid, extra_groups=[])
            pipe = subprocess.PIPE
            self.proc = subprocess.Popen(argv, stdin=pipe, stdout=pipe, stderr=pipe, pass_fds=fds, env=env,
                                         cwd=cwd, start_new_session=True, **user)
        except BaseException:
            for fd in fds + ([self.report_r] if self.report_r is not None else []):
                os.close(fd)
            self._cleanup_host()
            raise
        for fd in fds:
            os.close(fd)
        self.preamble = (b"\n" if self.cgroup else b"") + frame(header)
        if self.cgroup:
            try:
                self.cgroup.attach(self.proc.pid)  # before the gate opens: every descendant is inside
            except OSError:
                self.close()
                raise

    def communicate(self, stdin: bytes, timeout_s: float, output_bytes: int) -> Outcome:
        deadline = self.started + timeout_s
        out_fd, err_fd = self.proc.stdout.fileno(), self.proc.stderr.fileno()
        stdin_fd = self.proc.stdin.fileno()
        caps = {out_fd: output_bytes, err_fd: output_bytes}
        if self.report_r is not None:
            caps[self.report_r] = 1 << 20
        bufs = {fd: bytearray() for fd in caps}
        sel = selectors.DefaultSelector()
        for fd in caps:
            sel.register(fd, selectors.EVENT_READ)
        pending = memoryview(self.preamble + stdin)
        os.set_blocking(stdin_fd, False)
        sel.register(stdin_fd, selectors.EVENT_WRITE)
        truncated = timed_out = False
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in sel.select(remaining):
                fd = key.fd
                if fd == stdin_fd:
                    try:
                        pending = pending[os.write(fd, pending[:65536]):]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(fd)
                        self.proc.stdin.close()
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    sel.unregister(fd)
                    continue
                keep = max(0, caps[fd] - len(bufs[fd]))
                bufs[fd] += chunk[:keep]
                truncated |= len(chunk) > keep and fd != self.report_r
        sel.close()
        if not timed_out:
            try:
                self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
        self.kill()
        memory_hit, pids_hit = self.cgroup.limits_hit() if self.cgroup else (False, False)
        report = bytes(bufs.get(self.report_r, b"")) if self.report_r is not None else b""
        self.close()
        rc = self.proc.returncode
        exit_code = None if timed_out else (128 - rc if rc < 0 else rc)
        return Outcome(bytes(bufs[out_fd]), bytes(bufs[err_fd]), report, truncated, timed_out, exit_code,
                       time.monotonic() - self.started, memory_hit, pids_hit)

    def kill(self) -> None:
        """Kill the whole tree: bwrap's pid namespace goes with it; the weak tier's reaper cleans up first."""
        if self.proc.poll() is None:
            if self.full:
                self.proc.kill()
            else:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.cgroup:
            self.cgroup.kill_all()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        self.kill()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f and not f.closed:
                f.close()
        if self.report_r is not None:
            os.close(self.report_r)
            self.report_r = None
        self._cleanup_host()

    def _cleanup_host(self) -> None:
        if self.cgroup:
            self.cgroup.remove()
            self.cgroup = None
        if self.host_workdir:
            remove_tree(self.host_workdir)
            self.host_workdir = None


def remove_tree(path: str | os.PathLike) -> None:
    """Remove a directory tree that sandboxed code may have made unwritable (best effort: what cannot go stays).
    A path that is gone already is left alone: the permission repair must never reach the tree's parent."""
    root = os.path.abspath(path)
    if not os.path.lexists(root):
        return

    def force_remove(func, failed, _exc) -> None:
        try:
            if os.path.abspath(failed) != root:
                os.chmod(os.path.dirname(failed), 0o700)
            os.chmod(failed, 0o700)
            func(failed)
        except OSError:
            pass

    shutil.rmtree(root, onerror=force_remove)
