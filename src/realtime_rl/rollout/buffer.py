"""Staleness-bounded admission and the durable log of finished groups.

    buffer = StalenessBuffer(max_staleness=2, groups_per_step=4)
    while buffer.may_start(trainer.version): submit a group; buffer.started += 1
    buffer.add(group)                            # when it finishes
    if not buffer.stranded(trainer.version, in_flight_versions):  # else wait: a step now would strand one
        batch, dropped = buffer.take(trainer.version)  # oldest groups first (or None), groups past the bound

Admission control, not waste: a group may start only while fewer than
(version + max_staleness + 1) * groups_per_step groups have been admitted, so sampling never runs
further ahead of the trainer than the bound allows (max_staleness 0 is the synchronous on-policy
mode: the next batch starts only once the trainer has published the weights it needs). At
consumption a group's staleness is the trainer's version minus the version of its oldest generated
token. Groups finish out of order (one task's episodes run longer than the next ones'), so a slow group
could outlive the window while later groups fill batches; the trainer does not step while a group in
flight would be pushed past the bound by that step (`stranded`): it waits for the straggler and trains
it with the next batch. A group past the bound is still possible (a worker that had not yet received
the weights its group was admitted at, or groups logged before a resume); it is dropped, counted, and
its slot given back to admission.

TrajectoryLog makes finished groups durable before the trainer sees them (temp file, fsync, rename),
so a killed trainer resumes with every group it had received and not yet consumed. A group dropped
for staleness leaves the log with a line in `dropped.jsonl` (its episode ids, its staleness, the
version): every received group is accounted for, trained once or dropped on the record.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from realtime_rl.types import Episode, episode_from_bytes, episode_to_bytes


def group_staleness(group: list[Episode], version: int) -> int:
    oldest = [int(s.versions[s.loss_mask].min()) for e in group for s in e.segments if s.loss_mask.any()]
    return version - min(oldest) if oldest else 0


class StalenessBuffer:
    def __init__(self, max_staleness: int, groups_per_step: int, started: int = 0) -> None:
        self.max_staleness = max_staleness
        self.groups_per_step = groups_per_step
        self.started = started
        """Groups admitted and not dropped (across resumes: the orchestrator restores it)."""
        self.ready: list[list[Episode]] = []
        self.dropped = 0

    def may_start(self, version: int) -> bool:
        return self.started < (version + self.max_staleness + 1) * self.groups_per_step

    def stranded(self, version: int, in_flight: Iterable[int]) -> bool:
        """Would stepping from `version` push a group in flight (admitted at these versions) past the bound?
        Its tokens are no older than its admission (a worker applies the weights published before a job),
        so it is consumed in time if the trainer reaches version + 1 only once it is no more than
        max_staleness versions after the group's admission."""
        return any(version + 1 - started > self.max_staleness for started in in_flight)

    def add(self, group: list[Episode]) -> None:
        self.ready.append(group)

    def take(self, version: int) -> tuple[list[list[Episode]] | None, list[list[Episode]]]:
        """(groups_per_step groups, oldest first, or None if not enough are ready; groups dropped now)."""
        fresh = [g for g in self.ready if group_staleness(g, version) <= self.max_staleness]
        dropped = [g for g in self.ready if group_staleness(g, version) > self.max_staleness]
        self.dropped += len(dropped)
        self.started -= len(dropped)
        fresh.sort(key=lambda g: -group_staleness(g, version))
        self.ready = fresh
        if len(fresh) < self.groups_per_step:
            return None, dropped
        batch, self.ready = fresh[: self.groups_per_step], fresh[self.groups_per_step :]
        return batch, dropped


class TrajectoryLog:
    """run_dir/trajectories/<group_id>.npz: one durable file per finished group."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def append(self, group: list[Episode]) -> None:
        group_id = group[0].group_id
        buf = io.BytesIO()
        np.savez(buf, **{f"e{i}": np.frombuffer(episode_to_bytes(e), dtype=np.uint8) for i, e in enumerate(group)})
        tmp = self.root / f".{group_id}.tmp"
        with open(tmp, "wb") as f:
            f.write(buf.getvalue())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / f"{group_id}.npz")
        dir_fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def load(self, consumed: set[str]) -> list[list[Episode]]:
        """Every logged group none of whose episodes was consumed, oldest file first."""
        groups = []
        for path in sorted(self.root.glob("*.npz"), key=lambda p: p.stat().st_mtime):
            with np.load(path, allow_pickle=False) as npz:
                group = [episode_from_bytes(npz[k].tobytes()) for k in sorted(npz.files, key=lambda k: int(k[1:]))]
            if not any(e.episode_id in consumed for e in group):
                groups.append(group)
        return groups

    def remove(self, groups: list[list[Episode]]) -> None:
        """Forget consumed groups (called once the checkpoint that consumed them is durable)."""
        for group in groups:
            (self.root / f"{group[0].group_id}.npz").unlink(missing_ok=True)

    def drop(self, groups: list[list[Episode]], version: int) -> None:
        """Record groups dropped for staleness (dropped.jsonl, fsync'd), then forget them."""
        if not groups:
            return
        with open(self.root / "dropped.jsonl", "a") as f:
            for group in groups:
                f.write(json.dumps({"group_id": group[0].group_id, "version": version,
                                    "staleness": group_staleness(group, version),
                                    "episode_ids": [e.episode_id for e in group]}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.remove(groups)

    def dropped_ids(self) -> set[str]:
        """Episode ids of every group dropped for staleness so far."""
        path = self.root / "dropped.jsonl"
        if not path.is_file():
            return set()
        return {i for line in path.read_text().splitlines() if line for i in json.loads(line)["episode_ids"]}

    def __len__(self) -> int:
        return sum(1 for _ in self.root.glob("*.npz"))
