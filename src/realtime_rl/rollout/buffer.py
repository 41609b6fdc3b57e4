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
token, so each group has a deadline: the last version it may be trained at (its oldest token's version,
or its admission version while it is in flight, plus max_staleness). Groups finish out of order (one
task's episodes run longer than the next ones'), so a slow group could outlive the window while later
groups fill batches. The trainer schedules earliest deadline first (`take` picks the oldest groups) and
does not step while that would leave more groups due by some version than the steps before it can train
and waiting for a group in flight would give a batch with an earlier deadline (`stranded`): it waits for
the straggler and trains it in time instead of dropping it. A group past the bound is still possible
(a worker that had not yet received the weights its group was admitted at, groups logged before a
resume, or more groups due at once than steps can take); it is dropped, counted, and its slot given back
to admission.

TrajectoryLog makes finished groups durable before the trainer sees them (temp file, fsync, rename),
so a killed trainer resumes with every group it had received and not yet consumed. A trained group
leaves the log with a line in `trained.jsonl` (its episode ids, the version its step made), a group
dropped for staleness with one in `dropped.jsonl` (its staleness too): every received group is
accounted for, trained once or dropped, on the record.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from realtime_rl.model.checkpoint import write_durably
from realtime_rl.types import Episode, episode_from_bytes, episode_to_bytes


def oldest_version(group: list[Episode]) -> int | None:
    """The policy version of the group's oldest generated token (None when it generated nothing)."""
    oldest = [int(s.versions[s.loss_mask].min()) for e in group for s in e.segments if s.loss_mask.any()]
    return min(oldest) if oldest else None


def group_staleness(group: list[Episode], version: int) -> int:
    oldest = oldest_version(group)
    return 0 if oldest is None else version - oldest


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

    def deadline(self, group: list[Episode], version: int) -> int:
        """The last version `group` may be trained at (one that generated nothing never goes stale)."""
        oldest = oldest_version(group)
        return version + self.max_staleness if oldest is None else oldest + self.max_staleness

    def stranded(self, version: int, in_flight: Iterable[int]) -> bool:
        """Should the trainer wait instead of stepping from `version` with the batch `take` would give?

        Groups in flight were admitted at these versions; their tokens are no older (a worker applies the
        weights published before a job), so admission + max_staleness bounds their deadline. Stepping now
        trains the groups_per_step ready groups with the earliest deadlines; the steps from version + 1 to
        D then have room for (D - version) * groups_per_step more, and every group left (ready or in flight)
        due by D must fit in them. When some D does not fit, waiting pays only if a group in flight is due
        before the batch's latest deadline (it would take that place): then wait. Otherwise no order
        trains them all and the trainer steps (the late group is dropped when it is past the bound)."""
        gps = self.groups_per_step
        ready = sorted(d for d in (self.deadline(g, version) for g in self.ready) if d >= version)
        if len(ready) < gps:
            return False  # no batch to step with: the trainer waits anyway
        # A group in flight past its deadline may still arrive fresh (its tokens newer than its admission), but
        # nothing bounds when: waiting for it would stall the trainer on a group `take` may drop.
        flying = [d for d in (started + self.max_staleness for started in in_flight) if d >= version]
        if not any(d < ready[gps - 1] for d in flying):
            return False
        # Earliest deadline first, the i-th group left is trained at version + ceil((i + 1) / gps).
        return any(d - version < (i + gps) // gps for i, d in enumerate(sorted(ready[gps:] + flying)))

    def add(self, group: list[Episode]) -> None:
        self.ready.append(group)

    def take(self, version: int) -> tuple[list[list[Episode]] | None, list[list[Episode]]]:
        """(groups_per_step groups, earliest deadline first, or None if not enough are ready; groups dropped
        now)."""
        fresh = [g for g in self.ready if group_staleness(g, version) <= self.max_staleness]
        dropped = [g for g in self.ready if group_staleness(g, version) > self.max_staleness]
        self.dropped += len(dropped)
        self.started -= len(dropped)
        fresh.sort(key=lambda g: self.deadline(g, version))
        self.ready = fresh
        if len(fresh) < self.groups_per_step:
            return None, dropped
        batch, self.ready = fresh[: self.groups_per_step], fresh[self.groups_per_step :]
        return batch, dropped


TASKS_FILE = "tasks_handed_out"
TRAINED_FILE = "trained.jsonl"
DROPPED_FILE = "dropped.jsonl"
REJECTED_FILE = "rejected.jsonl"
FAILED_FILE = "failed.jsonl"


class TrajectoryLog:
    """run_dir/trajectories/<group_id>.npz: one durable file per finished group, until it is trained or
    dropped; `trained.jsonl`, `dropped.jsonl` and `rejected.jsonl` (groups the trainer would refuse, with why): the
    record of each; `tasks_handed_out`: the admission counter of tasks and sampling seeds."""

    def __init__(self, root: Path) -> None:
        """Opened by the one trainer of a run (under run_dir's lock): a temporary file in it is what a kill
        during a write left (a whole group's bytes each, piling up over kills), and is removed."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in self.root.glob(".*"):  # write_durably's temporaries: ".<name>.<random>"
            if leftover.is_file():
                leftover.unlink(missing_ok=True)

    def append(self, group: list[Episode]) -> None:
        buf = io.BytesIO()
        np.savez(buf, **{f"e{i}": np.frombuffer(episode_to_bytes(e), dtype=np.uint8) for i, e in enumerate(group)})
        write_durably(self.root / f"{group[0].group_id}.npz", buf.getvalue())

    def tasks_handed_out(self) -> int | None:
        """How many tasks admission has handed out, as `hand_out` recorded (None: a log from before it)."""
        path = self.root / TASKS_FILE
        return int(path.read_text()) if path.is_file() else None

    def hand_out(self, count: int) -> None:
        """Record durably that `count` tasks have been handed out, before the last of them is submitted: a
        resumed trainer goes on from there, so no task (and no sampling seed) is handed out twice."""
        write_durably(self.root / TASKS_FILE, str(count).encode())

    def load(self, consumed: dict[int, list[str]]) -> list[list[Episode]]:
        """Every logged group none of whose episodes was consumed (`consumed`: version -> episode ids, as
        RLTrainer.consumed), oldest file first. The files of consumed ones (a trainer stopped between its
        checkpoint and `remove`) are removed now, on the record; so are those dropped.jsonl or rejected.jsonl
        records already (a kill between the record and the unlink), which would otherwise be set aside twice."""
        consumed_at = {i: v for v, ids in consumed.items() for i in ids}
        groups, recorded, set_aside = [], None, None
        for path in sorted(self.root.glob("*.npz"), key=lambda p: p.stat().st_mtime):
            with np.load(path, allow_pickle=False) as npz:
                group = [episode_from_bytes(npz[k].tobytes()) for k in sorted(npz.files, key=lambda k: int(k[1:]))]
            versions = {consumed_at[e.episode_id] for e in group if e.episode_id in consumed_at}
            if versions:
                recorded = set(self._records(TRAINED_FILE, "group_id")) if recorded is None else recorded
                self.remove([group], max(versions), recorded=group[0].group_id in recorded)
                continue
            if set_aside is None:
                set_aside = {g for name in (DROPPED_FILE, REJECTED_FILE) for g in self._records(name, "group_id")}
            if group[0].group_id in set_aside:  # dropped or rejected on the record, then killed before the unlink
                self._forget([group])
            else:
                groups.append(group)
        return groups

    def remove(self, groups: list[list[Episode]], version: int, recorded: bool = False) -> None:
        """Forget groups the step that made `version` consumed (called once its checkpoint is durable), with a
        line each in trained.jsonl (unless `recorded`: the line is there already)."""
        if not recorded:
            self._record(TRAINED_FILE, [{"group_id": g[0].group_id, "version": version,
                                         "episode_ids": [e.episode_id for e in g]} for g in groups])
        self._forget(groups)

    def drop(self, groups: list[list[Episode]], version: int) -> None:
        """Record groups dropped for staleness (dropped.jsonl), then forget them."""
        self._record(DROPPED_FILE, [{"group_id": g[0].group_id, "version": version,
                                     "staleness": group_staleness(g, version),
                                     "episode_ids": [e.episode_id for e in g]} for g in groups])
        self._forget(groups)

    def reject(self, group: list[Episode], version: int, reason: str) -> None:
        """Record a group the trainer would refuse (rejected.jsonl, with why), then forget it."""
        self._record(REJECTED_FILE, [{"group_id": group[0].group_id, "version": version, "reason": reason,
                                      "episode_ids": [e.episode_id for e in group]}])
        self._forget([group])

    def fail(self, group_id: str, version: int, worker: int, error: str) -> None:
        """Record a group its worker failed to finish (failed.jsonl, with the error); it has no episodes."""
        self._record(FAILED_FILE, [{"group_id": group_id, "version": version, "worker": worker, "error": error}])

    def _forget(self, groups: list[list[Episode]]) -> None:
        for group in groups:
            (self.root / f"{group[0].group_id}.npz").unlink(missing_ok=True)

    def trained_ids(self) -> list[str]:
        """Episode ids of every group trained so far, in the order trained (a group trained twice would show
        twice; none is)."""
        return [i for ids in self._records(TRAINED_FILE, "episode_ids") for i in ids]

    def dropped_ids(self) -> set[str]:
        """Episode ids of every group dropped for staleness so far."""
        return {i for ids in self._records(DROPPED_FILE, "episode_ids") for i in ids}

    def _record(self, name: str, records: list[dict]) -> None:
        """Append one JSON line per record to root/name, fsync'd. An unterminated last line (an append a
        kill cut short: not a record) is cut off first, so that it does not run into the next record."""
        if not records:
            return
        with open(self.root / name, "ab+") as f:
            end = f.seek(0, os.SEEK_END)
            if end:
                f.seek(end - 1)
                if f.read(1) != b"\n":
                    f.seek(0)
                    f.truncate(f.read().rfind(b"\n") + 1)
            f.write("".join(json.dumps(r) + "\n" for r in records).encode())
            f.flush()
            os.fsync(f.fileno())

    def _records(self, name: str, key: str) -> list:
        """Field `key` of every record in root/name. Every record ends with a newline: a trainer killed
        mid-append leaves an unterminated last line, which is not a record (its group is still in the log and
        is recorded again)."""
        path = self.root / name
        if not path.is_file():
            return []
        return [json.loads(line)[key] for line in path.read_text().split("\n")[:-1] if line]

    def __len__(self) -> int:
        return sum(1 for _ in self.root.glob("*.npz"))
