"""Host-side bait for the escape battery (escapes.py): what an escape would touch, checked afterwards.

`Bait` is a context manager: a TCP listener on every host address, a root-only secret file, a
world-writable sentinel file, a sleeping process of the sandbox's own uid with a secret in its
environment, and the same secret in this process's environment (a sandbox that inherited the host
environment would leak it). `leftovers()` finds live host processes that carry the battery's token.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from realtime_rl.environments.sandbox.sandbox import Sandbox

SECRET_DIR = Path("/tmp")


@dataclass(frozen=True)
class Attempt:
    name: str
    contained: bool
    evidence: str
    """What the host saw (and the attack's own report), for a failure message or the bench log."""


class Bait:
    """Host-side targets for one battery run; a context manager that removes them afterwards."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.token = "rtrl" + secrets.token_hex(8)
        self.secret = secrets.token_hex(16)
        """Content of the root-only file and of a host environment variable; it must never show up inside."""
        self.uid, self.gid = sandbox.probe.uid, sandbox.probe.gid
        self.secret_path = SECRET_DIR / f"{self.token}-secret"
        self.sentinel_path = SECRET_DIR / f"{self.token}-sentinel"
        self.escape_paths = [Path(d) / f"{self.token}-escape"
                             for d in ("/tmp", "/var/tmp", "/dev/shm", "/usr", "/etc")]

    def __enter__(self) -> Bait:
        self.listener = socket.socket()
        self.listener.bind(("0.0.0.0", 0))
        self.listener.listen(16)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.secret_path.write_text(self.secret)
        os.environ["RTRL_BAIT_SECRET"] = self.secret  # a sandbox that inherited the host environment leaks it
        os.chmod(self.secret_path, 0o600)
        self.sentinel_path.write_text("original")
        os.chmod(self.sentinel_path, 0o666)
        user = dict(user=self.uid, group=self.gid, extra_groups=[]) if os.geteuid() == 0 else {}
        self.sleeper = subprocess.Popen(["/bin/sleep", "300"], env={"RTRL_SECRET": self.token},
                                        start_new_session=True, **user)
        return self

    def __exit__(self, *exc) -> None:
        self.sleeper.kill()
        self.sleeper.wait(timeout=10)
        self.listener.close()
        os.environ.pop("RTRL_BAIT_SECRET", None)
        for path in [self.secret_path, self.sentinel_path, *self.escape_paths]:
            path.unlink(missing_ok=True)

    def host_addresses(self) -> list[str]:
        addrs = {"127.0.0.1"}
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect(("192.0.2.1", 9))  # no packet is sent; this picks the outgoing address
                addrs.add(s.getsockname()[0])
        except OSError:
            pass
        return sorted(addrs)

    def connections_accepted(self) -> int:
        n = 0
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, OSError):
                return n
            conn.close()
            n += 1

    def leftovers(self) -> list[int]:
        """Live host pids that carry this battery's token in their command line or name (PR_SET_NAME)."""
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
                    comm = Path(f"/proc/{name}/comm").read_text().strip()
                    state = Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
                except OSError:
                    continue
                if (self.token.encode() in cmdline or comm == self.token[:15]) and state not in (b"Z", b"X"):
                    found.append(int(name))
        return found


def attack(sandbox: Sandbox, bait: Bait, source: str, timeout_s: float = 10.0, **params):
    """Run an attack program (params arrive as JSON in argv[1], which also carries the token)."""
    argv = ["python3", "-c", source, json.dumps({"token": bait.token, **params})]
    return sandbox.run(argv, {}, timeout_s=timeout_s)
