"""What this machine lets the sandbox do, found once per process by trying it.

`probe_isolation(isolation)` checks the system interpreter, whether a child cgroup can be created
(cgroups.find_support), then starts bubblewrap with every namespace and reads back, from inside, the
uid, the effective capabilities and the seccomp mode; if bubblewrap is missing or refused, it tries the
weak tier the same way. The answer, with a one-line honest label, is cached per `isolation` setting.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import struct
import threading
from dataclasses import dataclass, replace

from realtime_rl.config import SandboxConfig
from realtime_rl.environments.sandbox.cgroups import CgroupSupport, find_support
from realtime_rl.environments.sandbox.launch import PYTHON, SandboxProcess
from realtime_rl.environments.sandbox.results import IsolationLevel

SANDBOX_UID = 65534  # "nobody": used when the host runs as root, so sandboxed code never maps to root


@dataclass(frozen=True)
class Probe:
    level: IsolationLevel
    label: str
    """What runs are isolated with here, including what is missing and why."""
    uid: int
    """Host uid the sandboxed code runs as."""
    gid: int
    bwrap_path: str | None
    namespaces_error: str
    """Why bubblewrap could not be used ("" when it could)."""
    seccomp: bool
    seccomp_error: str
    cgroups: CgroupSupport
    python: str
    """Version of the sandbox's interpreter."""
    pytest: bool


def _try(probe: Probe) -> tuple[dict | None, str]:
    """Run the probe mode under `probe`'s settings; (what inside.py reported, or None, and bwrap's error)."""
    process = SandboxProcess(probe, SandboxConfig(wall_s=30), {"mode": "probe"})
    outcome = process.communicate(b"", 30.0, 65536)
    if outcome.exit_code != 0 or len(outcome.stdout) < 8:
        return None, (outcome.stderr.decode(errors="replace").strip() or f"exit status {outcome.exit_code}")
    (size,) = struct.unpack(">Q", outcome.stdout[:8])
    return json.loads(outcome.stdout[8:8 + size]), ""


def _label(p: Probe) -> str:
    uid = f"uid {p.uid}" + ("" if p.uid == SANDBOX_UID else " (same as the host process: no uid separation)")
    if p.level == IsolationLevel.FULL:
        parts = ["bwrap: user/pid/net/ipc/uts/mount/cgroup namespaces", "no capabilities", uid,
                 "read-only system", "tmpfs workspace", "rlimits"]
    else:
        parts = [f"weak (no namespaces: {p.namespaces_error})", uid, "rlimits", "subreaper cleanup"]
    parts.append("seccomp denylist" + ("" if p.level == IsolationLevel.FULL else ", only AF_UNIX sockets")
                 if p.seccomp else f"no seccomp ({p.seccomp_error})")
    if p.cgroups.version:
        parts.append(f"cgroup {p.cgroups.version} memory+pids limits")
    else:
        parts.append(f"no cgroup limits (cannot create a child cgroup: {p.cgroups.reason})")
    return "; ".join(parts)


_lock = threading.Lock()


def probe_isolation(isolation: str = "auto") -> Probe:
    """The strongest tier allowed by `isolation` ("auto", "full", "weak") that works here; cached."""
    if isolation not in ("auto", "full", "weak"):
        raise ValueError(f"isolation must be 'auto', 'full' or 'weak', got {isolation!r}")
    with _lock:
        return _probe(isolation)


@functools.cache
def _probe(isolation: str) -> Probe:
    if not os.access(PYTHON, os.X_OK):
        raise RuntimeError(f"the sandbox runs the system interpreter {PYTHON}, which is missing "
                           "(Debian: apt-get install python3 python3-pytest)")
    root = os.geteuid() == 0
    uid, gid = (SANDBOX_UID, SANDBOX_UID) if root else (os.getuid(), os.getgid())
    bwrap = shutil.which("bwrap") or ("/usr/bin/bwrap" if os.access("/usr/bin/bwrap", os.X_OK) else None)
    base = Probe(IsolationLevel.FULL, "", uid, gid, bwrap, "", True, "", find_support(), "", False)
    found, error = None, "bubblewrap (bwrap) is not installed" if bwrap is None else ""
    if isolation != "weak" and bwrap is not None:
        found, error = _try(replace(base, cgroups=CgroupSupport(None)))
        if found is not None and (found["uid"] != uid or int(found["cap_eff"], 16) != 0):
            found, error = None, f"inside bwrap: uid {found['uid']}, CapEff {found['cap_eff']}"
    if found is None and isolation == "full":
        raise RuntimeError(f"isolation='full' was asked for but bubblewrap cannot run here: {error}")
    if found is None:
        reason = error or "isolation='weak' was asked for"
        base = replace(base, level=IsolationLevel.WEAK, namespaces_error=reason)
        found, weak_error = _try(replace(base, cgroups=CgroupSupport(None)))
        if found is None:
            raise RuntimeError(f"neither bubblewrap ({error}) nor the weak tier ({weak_error}) can run here")
    seccomp_ok = found["seccomp"] == "2"
    seccomp_error = "" if seccomp_ok else found.get("seccomp_error") or f"Seccomp mode {found['seccomp']}"
    probe = replace(base, seccomp=seccomp_ok, seccomp_error=seccomp_error, python=found["python"],
                    pytest=found["pytest"])
    return replace(probe, label=_label(probe))
