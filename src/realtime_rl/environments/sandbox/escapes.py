"""The escape battery: attack programs run in the sandbox, each judged by what the *host* sees afterwards.

    with Bait(sandbox) as bait:
        attempts = run_battery(sandbox, bait)          # {name: Attempt(contained, evidence)}

`Bait` (bait.py) sets up what an escape would touch: a TCP listener on every host address, a root-only
secret file, a world-writable sentinel file, and a sleeping process that runs as the sandbox's own uid
with a secret in its environment. Each attack then tries to reach them (or to exhaust the machine) and
the host checks the bait, the process table and the run's result. The integration tests and
`rtrl bench sandbox` run this same battery. The attacks are real but bounded (the disk and memory
bombs stop on their own at a few times the limits), so a tier that does not contain them shows it
without taking the machine down.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from realtime_rl.environments.sandbox.bait import Attempt, Bait, attack
from realtime_rl.environments.sandbox.results import IsolationLevel
from realtime_rl.environments.sandbox.sandbox import Sandbox

NETWORK = """
import json, socket, sys
p = json.loads(sys.argv[1]); reached = []
for host in p["hosts"]:
    try:
        socket.create_connection((host, p["port"]), timeout=1).close(); reached.append(host)
    except OSError as e:
        print(host, e)
for host, port in (("1.1.1.1", 53), ("8.8.8.8", 53)):
    try:
        socket.create_connection((host, port), timeout=1).close(); reached.append(host)
    except OSError as e:
        print(host, e)
try:
    print("resolved", socket.gethostbyname("example.com")); reached.append("dns")
except OSError as e:
    print("dns", e)
print("REACHED", reached)
"""


def network(sandbox: Sandbox, bait: Bait) -> Attempt:
    result = attack(sandbox, bait, NETWORK, hosts=bait.host_addresses(), port=bait.port)
    accepted = bait.connections_accepted()
    contained = accepted == 0 and "REACHED []" in result.stdout
    return Attempt("network", contained, f"host listener accepted {accepted}; {result.stdout.strip()[-300:]}")


READ_SECRET = """
import json, os, sys
p = json.loads(sys.argv[1])
print("ENV", dict(os.environ))
for path in (p["secret"], "/etc/shadow", "/proc/1/root" + p["secret"], "/root/.bashrc", "/proc/1/environ",
             "/proc/self/environ"):
    try:
        print("READ", path, open(path, errors="replace").read()[:2000])
    except OSError as e:
        print("refused", path, e.strerror)
"""


def read_secret(sandbox: Sandbox, bait: Bait) -> Attempt:
    result = attack(sandbox, bait, READ_SECRET, secret=str(bait.secret_path))
    root_only = [line.split()[1] for line in result.stdout.splitlines()
                 if line.startswith(("READ /etc/shadow", "READ /root/"))]
    leaked = bait.secret in result.stdout or root_only
    return Attempt("read_root_only_files", not leaked,
                   f"secret leaked: {bait.secret in result.stdout}; root-only files read: {root_only}")


WRITE_OUTSIDE = """
import json, sys
p = json.loads(sys.argv[1])
for path in [p["sentinel"], *p["paths"]]:
    try:
        with open(path, "a") as f:
            f.write("escaped")
        print("WROTE", path)
    except OSError as e:
        print("refused", path, e.strerror)
"""


def write_outside(sandbox: Sandbox, bait: Bait) -> Attempt:
    result = attack(sandbox, bait, WRITE_OUTSIDE, sentinel=str(bait.sentinel_path),
                    paths=[str(p) for p in bait.escape_paths])
    changed = bait.sentinel_path.read_text() != "original"
    created = [str(p) for p in bait.escape_paths if p.exists()]
    return Attempt("write_outside_workspace", not changed and not created,
                   f"sentinel changed: {changed}; created on host: {created}; {result.stdout.strip()[-300:]}")


REMOUNT = """
import ctypes, json, subprocess, sys
p = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_REMOUNT, MS_BIND = 1, 32, 4096
print("remount /usr rw:", libc.mount(b"none", b"/usr", None, MS_REMOUNT | MS_BIND, None), ctypes.get_errno())
print("remount / rw:", libc.mount(b"none", b"/", None, MS_REMOUNT, None), ctypes.get_errno())
print("umount /usr:", libc.umount2(b"/usr", 2), ctypes.get_errno())
for cmd in (["mount", "-o", "remount,rw", "/usr"], ["unshare", "-rm", "mount", "-o", "remount,rw", "/usr"]):
    try:
        print(cmd, subprocess.run(cmd, capture_output=True, text=True, timeout=5).returncode)
    except OSError as e:
        print(cmd, e)
try:
    open(p["target"], "w").write("escaped"); print("WROTE", p["target"])
except OSError as e:
    print("refused", e.strerror)
"""


def remount(sandbox: Sandbox, bait: Bait) -> Attempt:
    target = Path("/usr") / f"{bait.token}-escape"
    result = attack(sandbox, bait, REMOUNT, target=str(target))
    return Attempt("remount_read_only_bind", not target.exists(), result.stdout.strip()[-400:])


CAPABILITIES = """
import ctypes, json, os, socket, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True); gained = []
status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
caps = {k: int(status[k], 16) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
gained += [k for k, v in caps.items() if v and k != "CapBnd"]  # the bounding set only limits gains
for name, call in (("setuid0", lambda: os.setuid(0)), ("setgid0", lambda: os.setgid(0)),
                   ("raw_socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, 1)),
                   ("mknod", lambda: os.mknod("dev_sda", 0o600 | 0o60000, os.makedev(8, 0))),
                   ("chown_root", lambda: (open("f", "w").close(), os.chown("f", 0, 0)))):
    try:
        call(); gained.append(name)
    except OSError:
        pass
if libc.prctl(47, 2, 21, 0, 0) == 0: gained.append("ambient_cap_sys_admin")
if libc.unshare(0x10000000) == 0: gained.append("new_user_namespace")
r = subprocess.run(["unshare", "-r", "id", "-u"], capture_output=True, text=True)
if r.returncode == 0: gained.append("unshare_-r: " + r.stdout.strip())
print("GAINED", gained, caps)
"""


def capabilities(sandbox: Sandbox, bait: Bait) -> Attempt:
    result = attack(sandbox, bait, CAPABILITIES)
    evidence = (result.stdout + result.stderr).strip()[-400:]
    return Attempt("raise_capabilities", "GAINED []" in result.stdout, evidence)


HOST_PROCESSES = """
import json, os, signal, sys
p = json.loads(sys.argv[1]); me = os.getpid()
for pid in [int(d) for d in os.listdir("/proc") if d.isdigit()]:
    try:
        if p["token"].encode() in open(f"/proc/{pid}/environ", "rb").read():
            print("FOUND secret in environ of", pid); os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
try:
    os.kill(p["pid"], signal.SIGKILL); print("signalled", p["pid"])
except OSError as e:
    print("kill refused", e.strerror)
"""


def host_processes(sandbox: Sandbox, bait: Bait) -> Attempt:
    result = attack(sandbox, bait, HOST_PROCESSES, pid=bait.sleeper.pid)
    time.sleep(0.05)
    alive = bait.sleeper.poll() is None
    leaked = "FOUND" in result.stdout
    return Attempt("host_processes_via_proc", alive and not leaked,
                   f"same-uid host process alive: {alive}; {result.stdout.strip()[-300:]}")


FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""


def fork_bomb(sandbox: Sandbox, bait: Bait) -> Attempt:
    start = time.monotonic()
    result = attack(sandbox, bait, FORK_BOMB, timeout_s=3.0)
    took, left = time.monotonic() - start, bait.leftovers()
    return Attempt("fork_bomb", result.timed_out and took < 8 and not left,
                   f"timed out: {result.timed_out} after {took:.1f}s; "
                   f"pids limit hit: {result.pids_limit_hit}; leftover host pids: {left}")


MEMORY_BOMB = """
import sys
chunks = []
for i in range(64):  # stops at 4 GiB on its own
    chunks.append(bytearray(64 * 1024 * 1024)); print((i + 1) * 64, flush=True)
"""


def memory_bomb(sandbox: Sandbox, bait: Bait) -> Attempt:
    result = attack(sandbox, bait, MEMORY_BOMB, timeout_s=20.0)
    reached = max([int(x) for x in result.stdout.split() if x.isdigit()], default=0)
    limit = sandbox.config.memory_mb
    return Attempt("memory_bomb", reached <= limit and not result.ok and not bait.leftovers(),
                   f"allocated {reached} MB of a {limit} MB limit; exit {result.exit_code}; "
                   f"cgroup oom kill: {result.memory_limit_hit}; {result.stderr.strip()[-120:]}")


DISK_FILL = """
import json, os, sys
p = json.loads(sys.argv[1]); total = 0; block = b"x" * (1 << 20)
for d in (".", "/tmp", "/dev/shm"):
    for n in range(10 ** 6):
        if total >= p["cap"]:
            break
        try:
            with open(os.path.join(d, f"fill-{n}"), "wb") as f:
                for _ in range(8):
                    f.write(block); f.flush(); total += len(block)
        except OSError as e:
            print(d, e.strerror); break
print("TOTAL_MB", total >> 20)
"""


def disk_fill(sandbox: Sandbox, bait: Bait) -> Attempt:
    bound_mb = 3 * sandbox.config.workspace_mb  # /workspace, /tmp and /dev/shm, one tmpfs each
    result = attack(sandbox, bait, DISK_FILL, timeout_s=30.0, cap=(bound_mb + 64) << 20)
    words = result.stdout.split()
    total = int(words[words.index("TOTAL_MB") + 1]) if "TOTAL_MB" in words else None
    return Attempt("disk_fill", total is not None and total <= bound_mb,
                   f"wrote {total} MB (bound {bound_mb} MB); {result.stdout.strip()[-200:]}")


def infinite_loop(sandbox: Sandbox, bait: Bait) -> Attempt:
    start = time.monotonic()
    result = attack(sandbox, bait, "while True: pass", timeout_s=1.0)
    took, left = time.monotonic() - start, bait.leftovers()
    return Attempt("infinite_loop", result.timed_out and took < 4 and not left,
                   f"timed out: {result.timed_out} after {took:.1f}s; leftover host pids: {left}")


DETACHED = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(120)
    os._exit(0)
print("parent exits")
"""


def detached_child(sandbox: Sandbox, bait: Bait) -> Attempt:
    result = attack(sandbox, bait, DETACHED)
    left = bait.leftovers()
    return Attempt("detached_child_outlives_run", result.ok and not left,
                   f"exit {result.exit_code}; leftover host pids right after the run: {left}")


STUB = "def add(a, b):\n    pass\n"
PRISTINE = {
    "test_add.py": "from calc import add\n\ndef test_add():\n    assert add(1, 2) == 3\n",
    "test_more.py": "from calc import add\n\ndef test_more():\n    assert add(2, 2) == 4\n",
}
FORCE_PASS_CONFTEST = """
import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
"""
REWRITE_OTHER_TEST = """
import os
try:  # runs when test_add.py imports this module, before test_more.py is collected
    os.chmod("test_more.py", 0o666)
    with open("test_more.py", "w") as f:
        f.write("def test_more():\\n    pass\\n")
except OSError:
    pass
"""
# An agent's final workspace (a wrong solution) plus one way of tampering with how it is graded.
TAMPERED = {
    "rewritten_tests": {"calc.py": STUB, "test_add.py": "def test_add():\n    assert True\n"},
    "conftest_ini_shadow": {"calc.py": STUB, "conftest.py": FORCE_PASS_CONFTEST,
                            "pytest.ini": "[pytest]\naddopts = -p no:python\n",
                            "unittest.py": "class TestCase:\n    pass\n",
                            "pytest.py": "raise SystemExit(0)\n"},
    "rewrite_at_runtime": {"calc.py": STUB + REWRITE_OTHER_TEST},
}


def tamper(kind: str) -> Callable[[Sandbox, Bait], Attempt]:
    def run(sandbox: Sandbox, bait: Bait) -> Attempt:
        workspace = dict(TAMPERED[kind])
        graded = {**{k: v for k, v in workspace.items() if k not in PRISTINE}, **PRISTINE}  # as grading does
        report = sandbox.run_tests(graded, sorted(PRISTINE))
        return Attempt(f"tamper_tests_{kind}", not report.ok and report.failed == 2 and report.passed == 0,
                       f"graded: ok {report.ok}, passed {report.passed}, failed {report.failed}, "
                       f"errors {report.errors}")
    return run


ATTACKS: dict[str, Callable[[Sandbox, Bait], Attempt]] = {
    "network": network,
    "read_root_only_files": read_secret,
    "write_outside_workspace": write_outside,
    "remount_read_only_bind": remount,
    "raise_capabilities": capabilities,
    "host_processes_via_proc": host_processes,
    "fork_bomb": fork_bomb,
    "memory_bomb": memory_bomb,
    "disk_fill": disk_fill,
    "infinite_loop": infinite_loop,
    "detached_child_outlives_run": detached_child,
    **{f"tamper_tests_{kind}": tamper(kind) for kind in TAMPERED},
}


def expected_gaps(sandbox: Sandbox) -> set[str]:
    """Attacks the sandbox's tier is documented not to contain (package docstring); empty for FULL."""
    probe = sandbox.probe
    if probe.level == IsolationLevel.FULL:
        return set()
    gaps = {"write_outside_workspace", "host_processes_via_proc", "disk_fill",
            "tamper_tests_rewrite_at_runtime"}
    if not probe.seccomp:
        gaps.add("network")
    if probe.uid == os.geteuid():
        gaps.add("read_root_only_files")  # no uid separation: the "root-only" bait is ours
    return gaps


def run_battery(sandbox: Sandbox, bait: Bait, names: list[str] | None = None) -> dict[str, Attempt]:
    return {name: ATTACKS[name](sandbox, bait) for name in (names or list(ATTACKS))}
