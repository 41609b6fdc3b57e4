"""Publishing weights after each optimizer step, and applying them on the serving side.

Trainer (or the registry deploying a promoted checkpoint):

    publisher = WeightPublisher(FilesystemTransport("runs/x/weights"), snapshot_every=10)
    publisher.publish(dict(model.named_parameters()), version=step)   # a delta, and every 10th a snapshot
    publisher.resume()                     # after a restart: the newest published version, the next base

Rollout worker or gateway:

    subscriber = WeightSubscriber(transport, apply=engine.update_weights)
    subscriber.poll()                      # newest version now staged in the engine, or None if current
    subscriber.run(stop_event, interval_s=1.0)   # the same in a loop that logs and survives faults

`publish` casts to the published dtype (bf16 by default: fp32 master weights ship as bf16), digests
every tensor, writes the delta from the previous published version and, every `snapshot_every`
versions (and first), a snapshot; then prunes versions older than the `keep_snapshots`-th newest
snapshot. Pass parameters, not a state_dict with tied aliases (those would travel twice). A publish
that raised may still land (the transport cannot always tell), so the next publish carries a
snapshot too: subscribers on the landed version cannot follow a delta from the one before it.

`poll` walks the delta chain from the live version to the newest one; when the chain is broken (a
version pruned or never written), longer than `max_chain`, or a blob is rejected, it starts again
from the newest snapshot and the deltas after it. Everything is decoded and verified beside the live
weights; only a verified state is handed to `apply(state, version)` (the engine stages it and swaps
between decode steps; `version` is the state's policy version, which is its store version unless the
publisher labelled it otherwise, as a rollback does). A corrupt, truncated or out-of-order blob never
reaches `apply`: poll raises WeightSyncError naming it, after applying the furthest version it could
verify (if that is newer than the live one), so the weights serving are those of the last good version.

Not here: deciding what to deploy (the registry and gate), multi-node broadcast (NCCL).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from realtime_rl.deploy.delta import (
    WORKERS, DeltaError, OutOfOrder, WeightState, decode, encode_delta, encode_snapshot,
)
from realtime_rl.deploy.transports.base import MissingBlob, TransportError, WeightTransport

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 60.0
"""WeightSubscriber.run doubles its wait after each failed poll, up to this (reset by a poll that succeeds)."""


class WeightSyncError(RuntimeError):
    """The subscriber could not reach the newest version. If it verified a version newer than the live one
    on the way, it applied that one before raising (`subscriber.version` says which); otherwise the weights
    it serves did not change. Nothing unverified is ever applied."""


@dataclass(frozen=True)
class PublishStats:
    version: int
    bytes_full: int
    """Size of the published weights in their published dtype."""
    bytes_delta: int | None
    bytes_snapshot: int | None
    seconds: float

    @property
    def ratio(self) -> float | None:
        return self.bytes_full / self.bytes_delta if self.bytes_delta else None


class WeightPublisher:
    def __init__(self, transport: WeightTransport, *, snapshot_every: int = 10, keep_snapshots: int = 2,
                 dtype: torch.dtype | None = torch.bfloat16, workers: int = WORKERS) -> None:
        if snapshot_every < 1 or keep_snapshots < 1:
            raise ValueError("snapshot_every and keep_snapshots must be >= 1")
        self.transport = transport
        self.snapshot_every = snapshot_every
        self.keep_snapshots = keep_snapshots
        self.dtype = dtype
        self.workers = workers
        self.last: WeightState | None = None
        self._since_snapshot = 0
        self._snapshot_next = False
        """A publish failed: its version may have landed after all, and only a snapshot follows from both."""

    def publish(self, tensors: Mapping[str, torch.Tensor], version: int,
                policy_version: int | None = None) -> PublishStats:
        """Publish `tensors` (copied, cast to `dtype`) as `version`, which must exceed the last one.
        `policy_version`: the policy these weights are, when not `version` (subscribers stamp it on what they
        generate): how a rolled-back policy is served again, as a new store version.

        If it raises (TransportError, or anything else), the version may have landed anyway, now or later;
        the next publish carries a snapshot, so whatever landed, every subscriber can reach it. Retrying the
        same version then raises AlreadyPublished if the failed attempt did land: publish a later version."""
        t0 = time.perf_counter()
        if self.last is not None and version <= self.last.version:
            raise ValueError(f"versions must increase: published {self.last.version}, got {version}")
        with torch.no_grad():
            owned = {name: t.detach().to(device="cpu", dtype=self.dtype or t.dtype, copy=True)
                     for name, t in tensors.items()}
        state = WeightState.of(owned, version, workers=self.workers, policy_version=policy_version)
        blobs = {}
        if self.last is not None:
            blobs["delta"] = encode_delta(self.last, state, workers=self.workers)
        if self.last is None or self._snapshot_next or self._since_snapshot + 1 >= self.snapshot_every:
            blobs["snapshot"] = encode_snapshot(state)
        try:
            self.transport.publish(version, blobs)
        except BaseException:
            # self.last stays the base of the next delta, which a subscriber on this version (if it landed) cannot
            # follow: the snapshot beside that delta lets it recover.
            self._snapshot_next = True
            raise
        self._snapshot_next = False
        self._since_snapshot = 0 if "snapshot" in blobs else self._since_snapshot + 1
        self.last = state
        self._prune()
        return PublishStats(version, state.nbytes, len(blobs["delta"]) if "delta" in blobs else None,
                            len(blobs["snapshot"]) if "snapshot" in blobs else None, time.perf_counter() - t0)

    def resume(self) -> int | None:
        """After a restart, load the newest published version (verified) as the base of the next
        delta; returns that version (None if nothing is published). Publish versions after it."""
        subscriber = WeightSubscriber(self.transport, workers=self.workers)
        subscriber.poll()
        self.last = subscriber.state
        available = self.transport.versions()
        newest_snapshot = max((v for v, kinds in available.items() if "snapshot" in kinds), default=-1)
        self._since_snapshot = sum(1 for v in available if v > newest_snapshot)
        return subscriber.version

    def _prune(self) -> None:
        available = self.transport.versions()
        snapshots = sorted(v for v, kinds in available.items() if "snapshot" in kinds)
        if len(snapshots) <= self.keep_snapshots:
            return
        oldest_kept = snapshots[-self.keep_snapshots]
        for v in sorted(available):
            if v < oldest_kept:
                self.transport.remove(v)


class WeightSubscriber:
    def __init__(self, transport: WeightTransport,
                 apply: Callable[[dict[str, torch.Tensor], int], None] | None = None, *,
                 state: WeightState | None = None, max_chain: int = 32, workers: int = WORKERS) -> None:
        """`state`: the weights already serving, if they are a published version (else the first poll
        starts from a snapshot)."""
        self.transport = transport
        self.apply = apply
        self.state = state
        self.max_chain = max_chain
        self.workers = workers

    @property
    def version(self) -> int | None:
        return None if self.state is None else self.state.version

    def poll(self) -> int | None:
        """Reach the newest published version; return it, or None if already there."""
        available = self.transport.versions()
        if not available:
            return None
        latest = max(available)
        if self.state is not None and latest <= self.state.version:
            return None
        current = self.state
        problems: list[str] = []
        reached, chain = None, []
        if current is not None:
            chain = [v for v in sorted(available) if v > current.version]
            if len(chain) <= self.max_chain:
                reached = self._follow(current, chain, problems)
                chain = []
            else:
                problems.append(f"{len(chain)} versions behind, more than max_chain={self.max_chain}")
        if reached is None or reached.version < latest:
            floor = reached.version if reached else current.version if current else -1
            snapshots = [v for v, kinds in available.items() if "snapshot" in kinds and v > floor]
            for s in sorted(snapshots, reverse=True):
                start = self._load(s, "snapshot", None, problems)
                if start is not None:
                    reached = self._follow(start, [v for v in sorted(available) if v > s], problems) or start
                    break
        if reached is None and chain:  # too long, and no snapshot to jump to: the long way, delta by delta
            reached = self._follow(current, chain, problems)
        if reached is None:
            raise WeightSyncError(f"cannot move from version {self.version} to {latest}; the weights serving "
                                  f"did not change: {'; '.join(problems) or 'no snapshot to start from'}")
        if self.apply is not None:
            self.apply(dict(reached.tensors), reached.serves)
        self.state = reached
        if reached.version < latest:
            raise WeightSyncError(f"reached version {reached.version}, not {latest}: {'; '.join(problems)}")
        return reached.version

    def _load(self, version: int, kind: str, base: WeightState | None,
              problems: list[str]) -> WeightState | None:
        try:
            return decode(self.transport.fetch(version, kind), base, workers=self.workers)
        except (DeltaError, TransportError) as exc:
            problems.append(f"{kind} {version} rejected: {exc}" if isinstance(exc, DeltaError)
                            else f"{kind} {version} unavailable: {exc}")
            expected = isinstance(exc, (MissingBlob, OutOfOrder))  # a pruned or skipped version
            level = logging.INFO if expected else logging.WARNING
            log.log(level, "weight sync: %s %d: %s", kind, version, exc)
            return None

    def _follow(self, state: WeightState, chain: list[int], problems: list[str]) -> WeightState | None:
        """Apply deltas in order; the furthest verified state (None if not even the first applies)."""
        reached = None
        for v in chain:
            nxt = self._load(v, "delta", state, problems)
            if nxt is None:
                break
            state = reached = nxt
        return reached

    def run(self, stop: threading.Event, interval_s: float = 1.0) -> None:
        """Poll until `stop` is set; faults are logged and retried at the next interval. Anything else is logged
        with its traceback and retried too: a follower that died would leave its engine serving stale weights,
        every later promotion and rollback published and never served."""
        wait = interval_s
        while not stop.is_set():
            try:
                self.poll()
                wait = interval_s
            except (WeightSyncError, TransportError) as exc:
                log.warning("weight sync: %s", exc)
                wait = min(2 * wait, max(interval_s, MAX_BACKOFF_S))  # a store or apply that keeps failing
            except Exception:
                log.exception("weight sync: unexpected error; retrying")
                wait = min(2 * wait, max(interval_s, MAX_BACKOFF_S))
            stop.wait(wait)
