"""Per-run cgroups with a memory and a pids limit, where this process may create child cgroups.

cgroup v1 (separate memory and pids hierarchies, as on this project's machines) and v2 (a unified
hierarchy whose own cgroup already delegates, or can delegate, the memory and pids controllers) are
supported. The child cgroups are created under this process's own cgroup, so limits nest inside
whatever the host already imposes. Where nothing is writable, `find_support` says why and runs go
without cgroup limits (the run's isolation label says so). This module does not limit CPU or I/O.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

_names = itertools.count()


@dataclass(frozen=True)
class CgroupSupport:
    version: str | None
    """"v1", "v2", or None when no cgroup limits can be set."""
    parents: tuple[Path, ...] = ()
    """Where run cgroups are created: v1 (memory dir, pids dir); v2 (one dir)."""
    reason: str = ""
    """Why cgroups are unavailable (empty when they are available)."""


def _mounts() -> list[tuple[str, str, str, str]]:
    """(mount root, mount point, fs type, super options) for every cgroup mount."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            out.append((fields[3], fields[4], tail[0], tail[2]))
    return out


def _own_dir(mount_root: str, mount_point: str, cg_path: str) -> Path:
    rel = cg_path[len(mount_root):] if mount_root != "/" and cg_path.startswith(mount_root) else cg_path
    return Path(mount_point + rel.rstrip("/"))


def _candidates() -> list[CgroupSupport]:
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            own[name] = path
    mounts = _mounts()
    v1 = {}
    for root, point, fstype, opts in mounts:
        for controller in ("memory", "pids"):
            if fstype == "cgroup" and controller in opts.split(",") and controller in own:
                v1[controller] = _own_dir(root, point, own[controller])
    found = []
    if len(v1) == 2:
        found.append(CgroupSupport("v1", (v1["memory"], v1["pids"])))
    for root, point, fstype, _ in mounts:
        if fstype == "cgroup2" and "" in own:
            found.append(CgroupSupport("v2", (_own_dir(root, point, own[""]),)))
    return found


def find_support() -> CgroupSupport:
    """Try to create (and remove) a limited child cgroup; the first flavour that works, or why none does."""
    reasons = []
    for candidate in _candidates():
        try:
            if candidate.version == "v2":
                _delegate_v2(candidate.parents[0])
            probe = RunCgroup.create(candidate, memory_mb=64, max_procs=8, tag="probe")
            probe.remove()
            _remove_stale(candidate)
            return candidate
        except OSError as e:
            reasons.append(f"{candidate.version} at {candidate.parents[0]}: {e.strerror or e}")
    return CgroupSupport(None, (), "; ".join(reasons) or "no cgroup memory+pids hierarchy mounted")


def _remove_stale(support: CgroupSupport) -> None:
    """Remove empty run cgroups left by processes that died without cleaning up (named rtrl-<pid>-...)."""
    for parent in support.parents:
        for d in parent.glob("rtrl-*"):
            pid = d.name.split("-")[1]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                try:
                    d.rmdir()
                except OSError:
                    pass


def _delegate_v2(own: Path) -> None:
    enabled = (own / "cgroup.subtree_control").read_text().split()
    missing = [c for c in ("memory", "pids") if c not in enabled]
    if missing:  # fails with EBUSY when our own cgroup holds processes ("no internal processes")
        (own / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in missing))


class RunCgroup:
    """One run's cgroup(s): create with limits, attach a pid, read whether a limit was hit, kill, remove."""

    def __init__(self, support: CgroupSupport, dirs: list[Path]) -> None:
        self.support = support
        self.dirs = dirs

    @classmethod
    def create(cls, support: CgroupSupport, memory_mb: int, max_procs: int, tag: str = "run") -> RunCgroup:
        name = f"rtrl-{os.getpid()}-{tag}-{next(_names)}"
        dirs = [parent / name for parent in support.parents]
        made = []
        try:
            for d in dirs:
                d.mkdir()
                made.append(d)
            limit = str(memory_mb * 1024 * 1024)
            if support.version == "v1":
                (dirs[0] / "memory.limit_in_bytes").write_text(limit)
                if (dirs[0] / "memory.memsw.limit_in_bytes").exists():
                    (dirs[0] / "memory.memsw.limit_in_bytes").write_text(limit)  # no escape into swap
                (dirs[1] / "pids.max").write_text(str(max_procs))
            else:
                (dirs[0] / "memory.max").write_text(limit)
                if (dirs[0] / "memory.swap.max").exists():
                    (dirs[0] / "memory.swap.max").write_text("0")
                (dirs[0] / "pids.max").write_text(str(max_procs))
        except OSError:
            for d in made:
                d.rmdir()
            raise
        return cls(support, dirs)

    def attach(self, pid: int) -> None:
        for d in self.dirs:
            (d / "cgroup.procs").write_text(str(pid))

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs:
            try:
                found |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
            except OSError:
                pass
        return found

    def limits_hit(self) -> tuple[bool, bool]:
        """(memory limit killed something, pids limit refused a fork)."""
        def counter(path: Path, key: str) -> int:
            try:
                for line in path.read_text().splitlines():
                    k, _, v = line.partition(" ")
                    if k == key:
                        return int(v)
            except (OSError, ValueError):
                pass
            return 0

        mem_dir, pids_dir = self.dirs[0], self.dirs[-1]
        events = "memory.oom_control" if self.support.version == "v1" else "memory.events"
        return counter(mem_dir / events, "oom_kill") > 0, counter(pids_dir / "pids.events", "max") > 0

    def kill_all(self, timeout_s: float = 2.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (left := self.pids()) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)

    def remove(self) -> None:
        """Kill what is left and remove the directories (retrying while the kernel drains them)."""
        self.kill_all()
        for d in self.dirs:
            for attempt in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if attempt == 49:
                        raise
                    time.sleep(0.01)
