"""One writer per run directory, and what a killed one left behind.

    with run_dir_lock(run_dir, "rtrl train"):        # ValueError at once if another process holds it
        remove_staging(run_dir)                      # only under the lock: another writer's staging is live
        ...
    with run_dir_lock(run_dir, "rtrl pretrain", wait_s=7200):   # or wait for it (a base model being built)

The lock is an flock on run_dir/.lock: the kernel releases it when the process ends, kill -9 included, so a
lock is never stale. Staging is what `publish_directory` writers create beside their final directories: a
`.ckpt-*` or `.corpus-*` folder a kill cut short (a whole copy of the weights and optimizer state each), and the
`.old-*` folder a directory is moved aside into while its replacement is renamed in.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

POLL_S = 1.0
STAGING_PREFIXES = (".ckpt-", ".corpus-")


@contextlib.contextmanager
def run_dir_lock(run_dir: str | Path, holder: str, wait_s: float = 0.0) -> Iterator[None]:
    """Hold run_dir/.lock for the block. Another holder: ValueError at once (wait_s = 0), or once wait_s
    seconds have passed without it being released."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    with open(run_dir / ".lock", "w") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the file closes or the process ends
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    waited = f" (waited {wait_s:g} s)" if wait_s else ""
                    raise ValueError(f"{run_dir} is in use by another {holder} (it holds {run_dir / '.lock'})"
                                     f"{waited}") from None
                time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
        yield


def remove_staging(run_dir: str | Path) -> list[Path]:
    """Remove the staging a writer killed mid-save left under run_dir; returns what was removed. Under
    run_dir/checkpoints (where `rtrl pretrain` and `rtrl train` publish), a directory moved aside into
    `.old-<name>-*` whose replacement never got its name is put back first: the kill came between
    publish_directory's two renames, and it is the one whole copy under that name."""
    run_dir = Path(run_dir)
    published, removed = run_dir / "checkpoints", []
    if published.is_dir():
        # Before 1235a1f publish_directory moved the old directory aside into run_dir itself.
        for old in [*published.glob(".old-*"), *run_dir.glob(".old-*")]:
            for kept in (p for p in old.iterdir() if p.is_dir()):
                if not (published / kept.name).exists():
                    os.replace(kept, published / kept.name)
            shutil.rmtree(old, ignore_errors=True)
            removed.append(old)
    for prefix in STAGING_PREFIXES:
        for stale in run_dir.glob(f"{prefix}*"):
            shutil.rmtree(stale, ignore_errors=True)
            removed.append(stale)
    return removed
