"""RolloutBackend's own bookkeeping, on a backend whose workers are a function: groups spread over workers as
shards and put back together in index order, a failed shard run once more elsewhere, a failing worker passed
over, and results that do not fit the job."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from realtime_rl.config import RolloutConfig
from realtime_rl.rollout.base import RolloutBackend
from realtime_rl.rollout.worker import GroupJob


class _Scripted(RolloutBackend):
    """Each job sent to worker wid ends at the next poll with script(wid, job): its episodes (here the strings
    "<group>-<index>") or an error."""

    def __init__(self, workers: int, script: Callable[[int, GroupJob], list | str], shards: int = 1) -> None:
        super().__init__(RolloutConfig(workers=workers), Path("unused"), group_size=4)
        self.script, self.shards, self.sent = script, shards, []

    def _send(self, wid: int, job: GroupJob) -> None:
        self.sent.append((wid, job))

    def _receive(self, timeout_s: float):
        sent, self.sent = self.sent, []
        return [(wid, job, self.script(wid, job)) for wid, job in sent]

    def start(self, state, version: int) -> None:
        pass

    def publish(self, state, version: int) -> None:
        pass

    def close(self) -> None:
        self._forget_in_flight()


def _episodes(wid: int, job: GroupJob) -> list[str]:
    return [f"{job.group_id}-{i}" for i in job.indices]


def _job(group_id: str) -> GroupJob:
    return GroupJob(group_id, 0, 1, 4, 0, 0)


def _drain(backend: _Scripted) -> list[list[str]]:
    out = []
    while backend.in_flight:
        out += backend.poll(0)
    return out


def test_a_group_spread_over_workers_comes_back_whole_in_index_order():
    backend = _Scripted(3, _episodes, shards=3)
    backend.submit(_job("g"))
    assert sorted(wid for wid, _ in backend.sent) == [0, 1, 2]  # one shard on each worker
    assert sorted(backend._load) == [1, 1, 2]  # episodes in flight per worker: 4 in 3 shards
    assert _drain(backend) == [["g-0", "g-1", "g-2", "g-3"]]
    assert backend.in_flight == 0 and backend._load == [0, 0, 0] and backend.failures() == []


def test_a_shard_that_fails_on_one_worker_runs_once_more_on_another():
    backend = _Scripted(2, lambda wid, job: "engine timed out" if wid == 0 else _episodes(wid, job), shards=2)
    backend.submit(_job("g"))
    assert _drain(backend) == [["g-0", "g-1", "g-2", "g-3"]] and backend.failures() == []
    assert backend._failing == [1, 0]


def test_a_shard_that_fails_twice_fails_its_group_once_after_its_other_shards_are_back():
    backend = _Scripted(2, lambda wid, job: "broken" if job.indices[0] == 0 else _episodes(wid, job), shards=2)
    backend.submit(_job("g"))
    assert _drain(backend) == []
    [failure] = backend.failures()
    assert failure.group_id == "g" and failure.error == "broken" and backend.failures() == []
    assert backend._load == [0, 0]


def test_a_worker_whose_jobs_keep_failing_is_passed_over_while_another_is_not():
    backend = _Scripted(2, lambda wid, job: "dead engine" if wid == 0 else _episodes(wid, job))
    for k in range(RolloutBackend.BENCH_AFTER):
        backend.submit(_job(f"g{k}"))
        assert backend.sent[0][0] == 0  # the least loaded, tie to the lowest id: the failing worker
        assert _drain(backend) == [[f"g{k}-{i}" for i in range(4)]]  # run again on worker 1
    backend.submit(_job("next"))
    assert backend.sent[0][0] == 1  # worker 0 failed its last 3 jobs: passed over
    assert _drain(backend) == [[f"next-{i}" for i in range(4)]]


def test_a_job_that_returns_the_wrong_number_of_episodes_is_a_failure_and_an_unknown_group_is_ignored():
    backend = _Scripted(1, lambda wid, job: _episodes(wid, job)[:-1])
    backend.submit(_job("g"))
    assert _drain(backend) == []
    [failure] = backend.failures()
    assert "returned 3 episodes for 4 indices" in failure.error
    backend.sent.append((0, _job("stranger")))
    assert backend.poll(0) == [] and backend.failures() == [] and backend._load == [0]
    backend.submit(_job("left"))
    backend.close()
    assert backend.in_flight == 0 and backend._load == [0]
