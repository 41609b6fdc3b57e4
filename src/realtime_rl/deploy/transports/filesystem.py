"""Weight blobs in a directory: one subdirectory per version, made visible by a single rename.

    root/0000000012/delta.rtw       (from the previous published version)
    root/0000000012/snapshot.rtw    (every N versions)

`publish` writes into `root/.staging-*`, fsyncs, then renames the directory to its version name, so a
reader sees a version whole or not at all; `remove` renames it away before deleting. A staging or trash
directory a killed publish or remove left behind is swept when a transport next opens the root, once it is
ABANDONED_AFTER_S old (a publish still writing, even a slow one on another host, is never that old). Works on a
local disk or a shared filesystem (NFS, a mounted bucket); each call runs on a helper thread and
gives up with TransportError after `timeout_s`, so a hung mount cannot hang the caller. The helper
thread cannot be stopped: a publish given up on may still rename its version into place later. While
MAX_HUNG_CALLS calls on a root hang, further calls on it fail at once, so a hung mount holds a few threads,
not one per poll.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from realtime_rl.deploy.transports.base import (
    KINDS, AlreadyPublished, MissingBlob, TransportError, WeightTransport, check_blobs,
)
from realtime_rl.model.checkpoint import fsync_path

T = TypeVar("T")
SUFFIX = ".rtw"
ABANDONED_AFTER_S = 3600.0
log = logging.getLogger(__name__)


MAX_HUNG_CALLS = 4
"""Calls on one root that timed out and are still running (their threads cannot be stopped): past this, a call
on that root fails at once instead of leaving one more thread blocked on the mount (a subscriber polling a hung
share every few seconds used to pile one up per poll)."""
_hung: dict[str, int] = {}
_hung_lock = threading.Lock()


def with_timeout(fn: Callable[[], T], timeout_s: float, what: str, root: str | os.PathLike | None = None) -> T:
    """Run fn on a daemon thread; TransportError if it has not finished within timeout_s, or at once while
    MAX_HUNG_CALLS earlier calls on `root` are still hung."""
    key = None if root is None else os.fspath(root)
    result: dict[str, object] = {}
    done = threading.Event()
    with _hung_lock:
        if key is not None and _hung.get(key, 0) >= MAX_HUNG_CALLS:
            raise TransportError(f"{what}: not tried, {_hung[key]} earlier calls on {key} are still hung "
                                 "(the mount does not answer)")

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # re-raised on the caller's thread
            result["error"] = exc
        finally:
            with _hung_lock:
                done.set()
                if result.pop("hung", False):
                    _hung[key] -= 1

    threading.Thread(target=run, name=f"transport: {what}", daemon=True).start()
    if not done.wait(timeout_s):
        with _hung_lock:
            if not done.is_set():  # it may have finished since the wait gave up: then it is not hung
                if key is not None:
                    result["hung"] = True
                    _hung[key] = _hung.get(key, 0) + 1
                raise TransportError(f"{what} did not finish within {timeout_s:g} s")
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["value"]  # type: ignore[return-value]


def last_written(folder: Path) -> float:
    """The newest modification time of a folder and the files in it (a blob being written keeps its file's time
    moving); +inf when the folder is gone, so that a concurrent removal is not raced."""
    try:
        return max([folder.stat().st_mtime] + [p.stat().st_mtime for p in folder.iterdir()])
    except FileNotFoundError:
        return float("inf")


def remove_abandoned(root: Path, prefixes: tuple[str, ...], older_than_s: float, keep: Path | None = None
                     ) -> list[str]:
    """Remove root's directories named with one of `prefixes` (but `keep`) in which nothing changed for
    older_than_s: what a publisher that died mid-write left. The names removed."""
    cutoff, removed = time.time() - older_than_s, []
    for folder in root.iterdir():
        if (folder.name.startswith(prefixes) and folder != keep and folder.is_dir()
                and last_written(folder) < cutoff):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
    return removed


class FilesystemTransport(WeightTransport):
    def __init__(self, root: str | os.PathLike, timeout_s: float = 60.0) -> None:
        self.root = Path(root)
        self.timeout_s = timeout_s
        # Bounded like every call: a hung share fails here, in timeout_s, instead of blocking forever.
        with_timeout(lambda: self.root.mkdir(parents=True, exist_ok=True), timeout_s, f"creating {self.root}",
                     self.root)
        try:
            with_timeout(self.sweep, timeout_s, f"sweeping {self.root}", self.root)
        except (TransportError, OSError) as exc:  # a failing share: the next open tries again
            log.warning("could not sweep abandoned directories from %s: %s", self.root, exc)

    def sweep(self, older_than_s: float = ABANDONED_AFTER_S) -> list[str]:
        """Remove the `.staging-*` and `.trash-*` directories a kill during a publish or a remove left, once
        nothing in them changed for older_than_s; the names removed."""
        return remove_abandoned(self.root, (".staging-", ".trash-"), older_than_s)

    def version_dir(self, version: int) -> Path:
        return self.root / f"{version:010d}"

    def blob_path(self, version: int, kind: str) -> Path:
        if kind not in KINDS:
            raise ValueError(f"blob kind must be one of {KINDS}, got {kind!r}")
        return self.version_dir(version) / f"{kind}{SUFFIX}"

    def staging_dir(self) -> Path:
        # mkdir under the umask, not mkdtemp: mkdtemp's 0700 would be the published version's mode after the
        # rename, unreadable to subscribers (and a weights server) running as another user on the share
        path = self.root / f".staging-{secrets.token_hex(8)}"
        path.mkdir()
        return path

    def commit(self, staging: Path, version: int) -> None:
        """Rename a filled staging directory to `version`; AlreadyPublished if that version exists."""
        try:
            fsync_path(staging)
            os.rename(staging, self.version_dir(version))
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            error = AlreadyPublished if self.version_dir(version).exists() else TransportError
            raise error(f"cannot publish version {version} in {self.root}: {exc}") from exc
        try:
            fsync_path(self.root)
        except OSError as exc:  # the version is visible: published, its name's durability is the share's
            log.warning("version %d is published in %s, but syncing the directory failed: %s", version, self.root, exc)

    def publish(self, version: int, blobs: Mapping[str, bytes]) -> None:
        check_blobs(version, blobs)

        def write() -> None:
            if self.version_dir(version).exists():  # inside the timeout (commit's rename refuses it anyway)
                raise AlreadyPublished(f"version {version} is already published in {self.root}")
            staging = None
            try:
                staging = self.staging_dir()
                for kind, data in blobs.items():
                    with open(staging / f"{kind}{SUFFIX}", "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
            except BaseException as exc:
                if staging is not None:
                    shutil.rmtree(staging, ignore_errors=True)
                if isinstance(exc, OSError):  # a full disk, a failing share: a fault to retry, as every call's
                    raise TransportError(f"publishing version {version} to {self.root}: {exc}") from exc
                raise
            self.commit(staging, version)

        with_timeout(write, self.timeout_s, f"publishing version {version} to {self.root}", self.root)

    def versions(self) -> dict[int, list[str]]:
        def scan() -> dict[int, list[str]]:
            out = {}
            try:
                for entry in os.scandir(self.root):
                    if entry.name.isdigit() and entry.is_dir():
                        try:
                            names = set(os.listdir(entry.path))
                        except FileNotFoundError:  # pruned by the publisher since the scan: no longer offered
                            continue
                        out[int(entry.name)] = [k for k in KINDS if f"{k}{SUFFIX}" in names]
            except OSError as exc:  # the directory gone or the share failing (ESTALE, EIO): a fault to retry
                raise TransportError(f"listing {self.root}: {exc}") from exc
            return out

        return with_timeout(scan, self.timeout_s, f"listing {self.root}", self.root)

    def fetch(self, version: int, kind: str) -> bytes:
        path = self.blob_path(version, kind)

        def read() -> bytes:
            try:
                return path.read_bytes()
            except FileNotFoundError:
                raise MissingBlob(f"no {kind} for version {version} in {self.root}") from None
            except OSError as exc:
                raise TransportError(f"reading {path}: {exc}") from exc

        return with_timeout(read, self.timeout_s, f"reading {path}", self.root)

    def remove(self, version: int) -> None:
        def drop() -> None:
            trash = self.root / f".trash-{version:010d}-{os.getpid()}-{threading.get_ident()}"
            try:
                os.rename(self.version_dir(version), trash)
            except FileNotFoundError:
                return
            except OSError as exc:
                raise TransportError(f"removing version {version} from {self.root}: {exc}") from exc
            shutil.rmtree(trash, ignore_errors=True)

        with_timeout(drop, self.timeout_s, f"removing version {version} from {self.root}", self.root)
