"""The rollout backend seam: where worker engines run (local processes, Ray actors).

The orchestrator owns the policy loop; a backend only starts workers, hands them group jobs and new
weights, and returns finished groups. Every wait has a timeout, and a dead worker is an error.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from realtime_rl.config import RolloutConfig
from realtime_rl.rollout.worker import GroupJob, shard
from realtime_rl.types import Episode

log = logging.getLogger(__name__)


@dataclass
class _Group:
    left: int
    """Shards not back yet."""
    episodes: dict[int, Episode] = field(default_factory=dict)
    retried: set[tuple[int, int] | None] = field(default_factory=set)
    """The shards (GroupJob.episodes) that failed once and were sent to another worker."""
    error: tuple[int, str] | None = None
    """(worker, error) of the first shard that raised."""


@dataclass(frozen=True)
class GroupFailed:
    """A group its worker could not finish (the group raised: an engine request timed out, a sandbox broke):
    it has no episodes, only the error (its traceback's end)."""

    group_id: str
    worker: int
    error: str


MESSAGE_TEXT = 2048
"""The most bytes of a traceback a message carries (its end: where it was raised): with the rest of the
pickled message it stays under PIPE_BUF (4096 bytes on Linux), the size a pipe writes atomically."""


def short(text: str) -> str:
    """At most MESSAGE_TEXT bytes of `text` in UTF-8 (a traceback may quote a task's non-ASCII text), its end."""
    data = text.encode("utf-8", "surrogatepass")  # as pickle writes it
    return text if len(data) <= MESSAGE_TEXT else "...\n" + data[-MESSAGE_TEXT:].decode("utf-8", "ignore")


def publish_dtype(config: RolloutConfig) -> torch.dtype:
    """The dtype weights are published to the workers in (config.weights_dtype)."""
    return getattr(torch, config.weights_dtype)


def groups_per_worker(config: RolloutConfig, group_size: int) -> int:
    """Groups one worker holds at once: as many as its episodes in flight run (at least one), plus the
    queued ones, whose episodes wait for a free episode thread."""
    return max(1, config.episodes_in_flight // group_size) + config.queued_groups


class RolloutBackend(ABC):
    """Starts workers, spreads each group over `shards` of them (least loaded first, by episodes) and puts
    the group back together from its shards; a subclass only sends a shard job to a worker (`_send`) and
    receives finished or failed ones (`_receive`).

    A shard that raises is run once more on another worker (its episodes sample with the same seeds there);
    a second failure fails its group (failures()). A worker whose last BENCH_AFTER jobs all failed (a dead
    engine, a broken sandbox pool) gets no new job while another worker has not failed so: it fails fast, so
    least-loaded placement alone would hand it nearly every job."""

    BENCH_AFTER = 3

    def __init__(self, config: RolloutConfig, checkpoint_dir: Path, group_size: int, seed: int = 0) -> None:
        self.config = config
        self.checkpoint_dir = Path(checkpoint_dir)
        self.group_size = group_size
        self.seed = seed
        self.shards = 1
        """Workers each group's episodes are spread over (the orchestrator sets it before start: `shards_per_group`)."""
        self._load = [0] * config.workers  # episodes in flight per worker
        self._failing = [0] * config.workers  # jobs in a row that failed, per worker
        self._reports: list[dict[str, float]] = [{} for _ in range(config.workers)]  # each worker's latest report
        self.last_publish = None  # realtime_rl.deploy.PublishStats of the newest publish
        self._failed: list[GroupFailed] = []  # groups poll() found failed, until failures() hands them over
        self._groups: dict[str, _Group] = {}  # group id -> its shards' results so far, while in flight

    @property
    def capacity(self) -> int:
        """Groups that may be in flight at once across all workers."""
        return self.config.workers * groups_per_worker(self.config, self.group_size)

    @property
    def jobs_per_worker(self) -> int:
        """Jobs (groups, or shards of them) one worker may hold at once: what its job threads are sized for."""
        return groups_per_worker(self.config, self.group_size) * self.shards

    @property
    def in_flight(self) -> int:
        """Groups submitted and not yet returned by poll() (as a group or a failure)."""
        return len(self._groups)

    def submit(self, job: GroupJob) -> None:
        """Hand a group's shards each to the worker with the fewest episodes in flight."""
        shards = shard(job, self.shards)
        self._groups[job.group_id] = _Group(len(shards))
        for part in shards:
            self._place(part)

    def _place(self, part: GroupJob, avoid: int | None = None) -> None:
        def key(wid: int) -> tuple[bool, bool, int]:
            return wid == avoid, self._failing[wid] >= self.BENCH_AFTER, self._load[wid]

        wid = min(range(len(self._load)), key=key)
        self._load[wid] += len(part.indices)
        self._send(wid, part)

    def poll(self, timeout_s: float) -> list[list[Episode]]:
        """Finished groups, episodes in index order; waits up to timeout_s for the first shard (0: never waits).
        A group one of whose shards failed twice is not among them: it goes to failures() once its other
        shards are back. A worker that died or failed outside a group is an error."""
        out = []
        for wid, part, result in self._receive(timeout_s):
            group = self._groups.get(part.group_id)
            if group is None:  # not submitted here, or forgotten by close()
                log.warning("rollout worker %d returned group %s, which is not in flight", wid, part.group_id)
                continue
            self._load[wid] -= len(part.indices)
            if not isinstance(result, str) and len(result) != len(part.indices):
                result = f"the job returned {len(result)} episodes for {len(part.indices)} indices"
            if isinstance(result, str):
                self._failing[wid] += 1
                if part.episodes not in group.retried and len(self._load) > 1:
                    group.retried.add(part.episodes)
                    log.warning("rollout worker %d failed a job of group %s; running it on another worker: %s",
                                wid, part.group_id, result.strip().rsplit("\n", 1)[-1])
                    self._place(part, avoid=wid)
                    continue
                group.error = group.error or (wid, result)
            else:
                self._failing[wid] = 0
                group.episodes.update(zip(part.indices, result))
            group.left -= 1
            if not group.left:
                del self._groups[part.group_id]
                if group.error is not None:
                    self._failed.append(GroupFailed(part.group_id, *group.error))
                else:
                    out.append([group.episodes[i] for i in sorted(group.episodes)])
        return out

    def _forget_in_flight(self) -> None:
        """What close() abandons: the groups in flight, and the load they put on the workers."""
        self._groups.clear()
        self._load = [0] * len(self._load)

    def failures(self) -> list[GroupFailed]:
        """The groups found failed since the last call (by poll(); they are no longer in flight)."""
        failed, self._failed = self._failed, []
        return failed

    def generated_tokens(self) -> int:
        """Tokens sampled by all workers so far (for rollout tokens/s)."""
        return int(sum(r.get("generated_tokens", 0) for r in self._reports))

    def engine_metrics(self) -> dict[str, float]:
        """How the workers' engines spent their time, over all workers as of their latest reports:
        `rollout/engine_busy` (the share of the workers' time inside engine steps; the rest the engines
        waited for requests: episodes in tools, grading, or the agent loop's own work), `rollout/decode_ms`
        and `rollout/decode_rows` (a decode step's time and rows), `rollout/prefill_ms` and
        `rollout/prefills_per_step`; and where the episodes' time went: `rollout/policy_share` (waiting on the
        engine: queued, prefilled, decoded) and `rollout/grade_share` of episode-plus-grading seconds, the rest
        being tools and the agent loop's own work. Empty before any report."""
        total = {k: sum(r.get(k, 0.0) for r in self._reports)
                 for k in ("wall_s", "busy_s", "steps", "prefills", "prefill_s", "decode_steps", "decode_rows",
                           "decode_s", "episode_s", "policy_s", "grade_s")}
        if not total["steps"]:
            return {}
        episodes_s = max(total["episode_s"] + total["grade_s"], 1e-9)
        return {"rollout/policy_share": total["policy_s"] / episodes_s,
                "rollout/grade_share": total["grade_s"] / episodes_s,
                "rollout/engine_busy": total["busy_s"] / max(total["wall_s"], 1e-9),
                "rollout/decode_ms": 1e3 * total["decode_s"] / max(total["decode_steps"], 1),
                "rollout/decode_rows": total["decode_rows"] / max(total["decode_steps"], 1),
                "rollout/prefill_ms": 1e3 * total["prefill_s"] / max(total["prefills"], 1),
                "rollout/prefills_per_step": total["prefills"] / total["steps"]}

    @abstractmethod
    def start(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Start the workers on these weights (blocks until they are ready, within the config's timeout)."""

    @abstractmethod
    def _send(self, wid: int, job: GroupJob) -> None:
        """Start a (shard) job on worker `wid`."""

    @abstractmethod
    def _receive(self, timeout_s: float) -> list[tuple[int, GroupJob, list[Episode] | str]]:
        """Jobs that ended, waiting up to timeout_s for the first: (worker id, the job, its episodes in
        job.indices order or, where the job raised, the error's end). Updates the workers' reports."""

    @abstractmethod
    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """New weights for every worker (as a lossless delta through the weight-sync path); each worker
        verifies and rebuilds them beside its live weights and its engine swaps between decode steps."""

    @abstractmethod
    def close(self) -> None:
        """Stop the workers (in-flight groups are abandoned)."""
