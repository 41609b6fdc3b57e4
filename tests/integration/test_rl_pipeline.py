"""The asynchronous RL pipeline end to end on a tiny MoE model: local processes and Ray actors, the
staleness bound, and a trainer killed with SIGKILL that resumes without losing or retraining a group."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from realtime_rl.config import AgentConfig, RLConfig, RolloutConfig, TrainConfig
from realtime_rl.model import load_checkpoint
from realtime_rl.rollout import TrajectoryLog, train
from realtime_rl.rollout.base import groups_per_worker
from realtime_rl.rollout.local import LocalBackend
from realtime_rl.types import Episode

AGENT = AgentConfig(max_turns=2, max_new_tokens=24, summary_trigger_tokens=3072, max_context_tokens=4096)


def _config(run_dir: Path, base: Path, backend: str = "local", steps: int = 3, max_staleness: int = 1,
            queued_groups: int = 0) -> TrainConfig:
    # The malformed-call penalty gives an untrained model's episodes different rewards, so steps really update.
    return TrainConfig(run_dir=run_dir, base_checkpoint=base, steps=steps, max_staleness=max_staleness,
                       rl=RLConfig(group_size=2, groups_per_step=2, malformed_penalty=0.5, lr=1e-3),
                       rollout=RolloutConfig(backend=backend, episodes_in_flight=4, max_difficulty=1, agent=AGENT,
                                             queued_groups=queued_groups))


def _state(run_dir: Path) -> dict:
    ckpt = sorted((run_dir / "checkpoints").glob("v-*"))[-1]
    return torch.load(ckpt / "trainer_state.pt", weights_only=True)


def _check_run(run_dir: Path, summary: dict, steps: int, max_staleness: int) -> None:
    assert summary["version"] == steps
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, steps + 1))
    assert all(line["metrics"]["train/staleness_max"] <= max_staleness for line in lines)
    trained = TrajectoryLog(run_dir / "trajectories").trained_ids()
    assert len(trained) == len(set(trained)) == steps * 2 * 2  # groups_per_step x group_size per version
    consumed = [i for ids in _state(run_dir)["consumed"].values() for i in ids]
    assert consumed == trained[-len(consumed):]  # the checkpoint's window: the last versions' episodes
    # The workers' engines reported where their time went (through the process queue or Ray).
    rollout = summary["rollout"]
    assert 0 < rollout["engine_busy"] <= 1 and rollout["decode_ms"] > 0 and rollout["prefill_ms"] > 0
    assert 1 <= rollout["decode_rows"] <= 4 and 0 < rollout["prefills_per_step"] <= 1  # 4 episodes in flight
    assert 0 < rollout["policy_share"] < 1 and 0 < rollout["grade_share"] < 1
    assert all("rollout/engine_busy" in line["metrics"] for line in lines)


def test_local_pipeline_trains_within_the_staleness_bound(tmp_path, tiny_checkpoint, monkeypatch):
    # One group queued beyond the two the worker's 4 episodes in flight run: its episodes wait for a free thread.
    config = _config(tmp_path / "run", tiny_checkpoint, queued_groups=1)
    assert groups_per_worker(config.rollout, config.rl.group_size) == 3
    # Every message a worker sends fits in PIPE_BUF, so a worker killed mid-send cannot leave half a message
    # on the shared pipe (the trainer's next read then waited forever for the rest): groups come as files.
    sizes, get = [], LocalBackend._get

    def measured(self, timeout_s):
        message = get(self, timeout_s)
        if message is not None:
            sizes.append((message[0], len(pickle.dumps(message))))
        return message

    monkeypatch.setattr(LocalBackend, "_get", measured)
    summary = train(config, show_progress=False)
    assert {"ready", "group"} <= {kind for kind, _ in sizes} and max(n for _, n in sizes) < 4096, sizes
    _check_run(tmp_path / "run", summary, steps=3, max_staleness=1)
    assert summary["dropped_stale_groups"] == 0
    for h in summary["history"]:
        if "train/mismatch_k3" in h:
            assert h["train/mismatch_k3"] < 1e-6  # R3 through real workers: trainer matches the engine
    # Weights reached the workers as verified lossless deltas (after the first snapshot).
    assert all(h["sync/delta_ratio"] > 1 for h in summary["history"])
    assert (tmp_path / "run" / "weights").is_dir()


class _Straggler(LocalBackend):
    """Real workers, but the first group to finish is held back until version 1 is published, two groups
    have finished after that, and another second has passed: a straggler the trainer would strand by
    stepping again (with max_staleness 1, trained at version 2 it would be two versions old). Held no
    longer than HOLD_LIMIT_S in any case (the test then fails on release_at rather than hanging)."""

    HOLD_LIMIT_S = 60.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held: list[Episode] | None = None
        self.held_id: str | None = None
        self.version, self.finished_after, self.release_at = 0, 0, float("inf")
        self.limit = float("inf")

    def publish(self, state, version: int) -> None:
        super().publish(state, version)
        self.version = version

    def poll(self, timeout_s: float) -> list[list[Episode]]:
        out = super().poll(timeout_s)
        if self.held_id is None and out:
            self.held = out.pop(0)
            self.held_id = self.held[0].group_id
            self.limit = time.monotonic() + self.HOLD_LIMIT_S
        if self.held is not None:
            if self.version >= 1:
                self.finished_after += len(out)
                if self.finished_after >= 2 and self.release_at == float("inf"):
                    self.release_at = time.monotonic() + 1.0
            if time.monotonic() >= min(self.release_at, self.limit):
                out.append(self.held)
                self.held = None
        return out


def test_a_straggler_is_waited_for_and_trained_not_dropped(tmp_path, tiny_checkpoint, monkeypatch):
    from realtime_rl.rollout import orchestrator

    backends: list[_Straggler] = []

    def make_backend(config: TrainConfig, checkpoint_dir: Path) -> _Straggler:
        backends.append(_Straggler(config.rollout, checkpoint_dir, config.rl.group_size, config.seed,
                                   weights_dir=Path(config.run_dir) / "weights"))
        return backends[0]

    monkeypatch.setattr(orchestrator, "make_backend", make_backend)
    summary = train(_config(tmp_path / "run", tiny_checkpoint, steps=3, max_staleness=1), show_progress=False)
    _check_run(tmp_path / "run", summary, steps=3, max_staleness=1)
    straggler = backends[0]
    assert straggler.held is None and straggler.release_at < float("inf")  # held past version 1, released
    assert summary["dropped_stale_groups"] == 0
    assert summary["straggler_wait_s"] > 0.5  # the trainer waited out the held second instead of stepping
    trained = set(TrajectoryLog(tmp_path / "run" / "trajectories").trained_ids())
    assert {f"{straggler.held_id}-{i}" for i in range(2)} <= trained  # and trained the straggler


class _Held(LocalBackend):
    """Real workers whose finished groups are handed over HOLD_S after they come back (still in flight
    until then); with `swallow`, never: workers that have hung."""

    HOLD_S = 1.0

    def __init__(self, *args, swallow: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.swallow, self.held = swallow, []
        self.submitted: list[tuple[int, int]] = []  # (difficulty, task index)

    @property
    def in_flight(self) -> int:
        return super().in_flight + len(self.held)

    def submit(self, job) -> None:
        self.submitted.append((job.difficulty, job.task_index))
        super().submit(job)

    def poll(self, timeout_s: float) -> list[list[Episode]]:
        self.held += [(time.monotonic() + self.HOLD_S, g) for g in super().poll(timeout_s)]
        now = time.monotonic()
        out = [] if self.swallow else [g for due, g in self.held if due <= now]
        self.held = [(due, g) for due, g in self.held if self.swallow or due > now]
        return out


def _use(monkeypatch, backends: list[_Held], **kwargs) -> None:
    from realtime_rl.rollout import orchestrator

    def make_backend(config: TrainConfig, checkpoint_dir: Path) -> _Held:
        # Worker start-up gets its own generous limit: the tests below time the trainer's waits for groups.
        rollout = config.rollout.model_copy(update={"timeout_s": 120.0})
        backends.append(_Held(rollout, checkpoint_dir, config.rl.group_size, config.seed,
                              weights_dir=Path(config.run_dir) / "weights", **kwargs))
        return backends[-1]

    monkeypatch.setattr(orchestrator, "make_backend", make_backend)


def _with_timeout(config: TrainConfig, timeout_s: float) -> TrainConfig:
    return config.model_copy(update={"rollout": config.rollout.model_copy(update={"timeout_s": timeout_s})})


def test_a_trainer_step_longer_than_the_rollout_timeout_is_not_a_hung_worker(tmp_path, tiny_checkpoint,
                                                                            monkeypatch):
    # Synchronous, so after its first step (which outlasts the timeout) the trainer waits for the next batch;
    # the timeout leaves that batch's sampling ample time on a loaded machine.
    from realtime_rl.train import RLTrainer

    step, slept = RLTrainer.step, []

    def slow_step(self, episodes):
        if not slept:
            slept.append(True)
            time.sleep(16.0)
        return step(self, episodes)

    monkeypatch.setattr(RLTrainer, "step", slow_step)
    _use(monkeypatch, [])
    config = _with_timeout(_config(tmp_path / "run", tiny_checkpoint, steps=2, max_staleness=0), 15.0)
    summary = train(config, show_progress=False)  # the wait is timed from the step's end, not the last group
    _check_run(tmp_path / "run", summary, steps=2, max_staleness=0)


def test_workers_that_return_nothing_end_the_run_with_a_timeout(tmp_path, tiny_checkpoint, monkeypatch):
    backends: list[_Held] = []
    _use(monkeypatch, backends, swallow=True)
    # 8 s: a first group comes back inside it on a slow 2-core machine (2 s did not there, 6 s did), so the run ends
    # on groups that came back and were never handed over, not on workers that were merely slow.
    config = _with_timeout(_config(tmp_path / "run", tiny_checkpoint, steps=2), 8.0)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="in 8 s"):
        train(config, show_progress=False)
    assert time.monotonic() - t0 < 60 and backends[0].held  # groups came back and were never handed over


def test_a_resumed_run_hands_out_no_task_twice(tmp_path, tiny_checkpoint, monkeypatch):
    # Each run ends with groups in flight that are lost; the resumed run must not hand out their tasks again
    # while logged groups of later tasks are still to be trained (nor repeat those).
    backends: list[_Held] = []
    _use(monkeypatch, backends)
    train(_config(tmp_path / "run", tiny_checkpoint, steps=2, max_staleness=2), show_progress=False)
    train(_config(tmp_path / "run", tiny_checkpoint, steps=4, max_staleness=2), show_progress=False)
    first, second = backends[0].submitted, backends[1].submitted
    assert len(first) == len(set(first)) and len(second) == len(set(second))
    for d in {d for d, _ in first}:  # a difficulty's tasks are consecutive indices: the resumed run's come after
        assert min(i for dd, i in second if dd == d) > max(i for dd, i in first if dd == d), (first, second)
    assert TrajectoryLog(tmp_path / "run" / "trajectories").tasks_handed_out() == len(first) + len(second)


def test_synchronous_mode_trains_only_on_the_current_version(tmp_path, tiny_checkpoint):
    summary = train(_config(tmp_path / "run", tiny_checkpoint, steps=2, max_staleness=0), show_progress=False)
    _check_run(tmp_path / "run", summary, steps=2, max_staleness=0)
    for h in summary["history"]:
        if "train/trained_sequences" in h:  # on-policy: every trained token is fresh, R3 makes them match
            assert h["train/fresh_token_fraction"] == 1.0 and h["train/mismatch_k3"] < 1e-6


def test_weights_published_in_bf16_reach_the_workers_as_the_trainers_weights_rounded(tmp_path, tiny_checkpoint):
    from realtime_rl.deploy import FilesystemTransport, WeightSubscriber

    config = _config(tmp_path / "run", tiny_checkpoint, steps=2, max_staleness=0)
    config = config.model_copy(update={"rollout": config.rollout.model_copy(update={"weights_dtype": "bfloat16"})})
    summary = train(config, show_progress=False)
    _check_run(tmp_path / "run", summary, steps=2, max_staleness=0)
    received: dict = {}
    WeightSubscriber(FilesystemTransport(tmp_path / "run" / "weights"),
                     apply=lambda state, version: received.update(state=state, version=version)).poll()
    assert received["version"] == 2
    model = load_checkpoint(tmp_path / "run" / "checkpoints" / "v-0000002", dtype=torch.float32).model
    trained = dict(model.named_parameters())
    assert set(received["state"]) == set(trained)
    for name, tensor in received["state"].items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, trained[name].to(torch.bfloat16)), name
    for h in summary["history"]:
        if "train/trained_sequences" in h:  # workers sample from rounded weights: a real, small mismatch
            assert 0 <= h["train/mismatch_k3"] < 1e-2


def _send_a_large_result_at_stop(inbox, outbox) -> None:
    """A worker's exit path with a result bigger than the pipe holds: it exits only once that is read."""
    outbox.put(("ready", 0))
    assert inbox.get(timeout=60) == ("stop",)
    outbox.put(("group", 0, "g", [bytes(4 << 20)], {}))
    outbox.close()
    outbox.join_thread()


def test_closing_local_workers_reads_what_they_flush_so_they_exit_by_themselves(tmp_path, tiny_checkpoint):
    backend = LocalBackend(_config(tmp_path / "run", tiny_checkpoint).rollout, tiny_checkpoint, group_size=2,
                           weights_dir=tmp_path / "weights")
    inbox = backend._ctx.Queue()
    proc = backend._ctx.Process(target=_send_a_large_result_at_stop, args=(inbox, backend._outbox), daemon=True)
    proc.start()
    backend._inboxes.append(inbox)
    backend._procs.append(proc)
    assert backend._get(120) == ("ready", 0)  # started (a spawned child's imports take a while on a busy machine)
    backend.close()
    assert proc.exitcode == 0  # not killed (-9) after a wait on its full pipe


def test_a_local_worker_killed_at_close_leaves_no_directories(tmp_path, tiny_checkpoint, monkeypatch):
    """A worker that does not stop in time (here: stopped with SIGSTOP) is killed and cannot clean up; its
    temporary directory, which holds its work and sandbox directories, goes with the backend anyway."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    rollout = _config(tmp_path / "run", tiny_checkpoint).rollout
    backend = LocalBackend(rollout, tiny_checkpoint, group_size=2, weights_dir=tmp_path / "weights")
    backend.start(load_checkpoint(tiny_checkpoint).model.state_dict(), 0)
    assert list((tmp_path / "tmp").glob("rtrl-worker-0-*/rtrl-rollout-0-*"))
    [proc] = backend._procs
    os.kill(proc.pid, signal.SIGSTOP)
    backend.close(timeout_s=1.0)
    assert proc.exitcode == -signal.SIGKILL
    assert not list((tmp_path / "tmp").iterdir())


def test_local_workers_weights_in_a_temporary_directory_go_with_the_backend(tiny_checkpoint, tmp_path):
    backend = LocalBackend(_config(tmp_path / "run", tiny_checkpoint).rollout, tiny_checkpoint, group_size=2)
    backend.publish({"w": torch.zeros(3)}, 0)
    assert (backend.weights_dir).is_dir()
    backend.close()
    assert not backend.weights_dir.exists()


def test_ray_backend(tmp_path, tiny_checkpoint):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        summary = train(_config(tmp_path / "run", tiny_checkpoint, backend="ray", steps=2), show_progress=False)
    finally:
        ray.shutdown()
    _check_run(tmp_path / "run", summary, steps=2, max_staleness=1)



def _started_ray_backend(tmp_path: Path, tiny_checkpoint: Path, workers: int):
    """A RayBackend of `workers` actors on the tiny model, started (Ray initialised by the caller)."""
    from realtime_rl.rollout.ray_actors import RayBackend

    rollout = _config(tmp_path / "run", tiny_checkpoint, backend="ray").rollout
    backend = RayBackend(rollout.model_copy(update={"workers": workers}), tiny_checkpoint, group_size=2)
    model = load_checkpoint(tiny_checkpoint).model
    backend.start({name: p.detach() for name, p in model.named_parameters()}, 0)
    return backend


def test_closing_ray_workers_stops_every_one_when_one_has_died(tmp_path, tiny_checkpoint):
    ray = pytest.importorskip("ray")

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        backend = _started_ray_backend(tmp_path, tiny_checkpoint, workers=2)
        dead, alive = backend._actors
        scratch = [Path(path) for _, path in backend._where]
        assert all(path.is_dir() and path.name.startswith(f"rtrl-worker-{i}-") for i, path in enumerate(scratch))
        assert all(list(path.glob(f"rtrl-rollout-{i}-*")) for i, path in enumerate(scratch))  # the work goes there
        ray.kill(dead)
        backend.close()  # the dead worker's close fails; the live one is stopped all the same
        assert not any(path.exists() for path in scratch)  # the killed actor's by a task on its node
        with pytest.raises(ValueError):  # and the run's weight directory actor, with the snapshots it held
            ray.get_actor(backend._weights)
        deadline = time.monotonic() + 60
        with pytest.raises(ray.exceptions.RayActorError):
            while time.monotonic() < deadline:  # a kill lands a moment after ray.kill returns
                ray.get(alive.ready.remote(), timeout=30)
                time.sleep(0.2)
    finally:
        ray.shutdown()


def test_ray_actors_that_cannot_be_placed_are_a_clear_error(tmp_path, tiny_checkpoint):
    ray = pytest.importorskip("ray")
    from realtime_rl.model import load_checkpoint
    from realtime_rl.rollout.ray_actors import RayBackend

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rollout = _config(tmp_path / "run", tiny_checkpoint, backend="ray").rollout
        # 30 s: two actors start (checkpoint, engine, sandbox pool) well within it even on a loaded 2-core machine,
        # where 10 s was too short for them after the Ray tests before this one.
        backend = RayBackend(rollout.model_copy(update={"workers": 3, "timeout_s": 30}), tiny_checkpoint, group_size=2)
        model = load_checkpoint(tiny_checkpoint).model
        # A CPU each, two CPUs: the third actor is never placed. On a loaded machine the two placed ones may not
        # have started within the 30 s either (the full suite beside it once made it "3 of 3"): the error is the
        # same clear one.
        try:
            with pytest.raises(TimeoutError, match=r"[123] of 3 rollout actors not started after 30 s.*"
                                                   r"each asks for 1 CPU.*lower rollout"):
                backend.start({name: p.detach() for name, p in model.named_parameters()}, 0)
        finally:
            backend.close()
    finally:
        ray.shutdown()


def _write_toml(path: Path, run_dir: Path, base: Path, steps: int) -> None:
    path.write_text(f'''run_dir = "{run_dir}"
base_checkpoint = "{base}"
steps = {steps}
max_staleness = 2
[rl]
group_size = 2
groups_per_step = 1
malformed_penalty = 0.5
lr = 1e-3
[rollout]
episodes_in_flight = 4
max_difficulty = 1
[rollout.agent]
max_turns = 2
max_new_tokens = 24
summary_trigger_tokens = 3072
max_context_tokens = 4096
''')


def test_sigkilled_trainer_resumes_without_losing_or_retraining_a_group(tmp_path, tiny_checkpoint):
    run_dir, config = tmp_path / "run", tmp_path / "train.toml"
    _write_toml(config, run_dir, tiny_checkpoint, steps=50)
    cmd = [sys.executable, "-m", "realtime_rl.cli", "train", "--config", str(config)]
    tmp = tmp_path / "tmp"  # the workers' work and sandbox directories
    tmp.mkdir()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "TMPDIR": str(tmp)})
    deadline = time.monotonic() + 240
    while not (run_dir / "checkpoints" / "v-0000003").exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "the trainer did not reach version 3 in time"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert list(tmp.glob("rtrl-worker-*/rtrl-rollout-*")), "the workers' work directories were not where the test looks"
    deadline = time.monotonic() + 60
    while list(tmp.glob("rtrl-*")):  # orphaned workers close their engines and sandboxes on the way out
        assert time.monotonic() < deadline, f"an orphaned worker left {sorted(p.name for p in tmp.iterdir())}"
        time.sleep(0.2)

    state = _state(run_dir)
    killed_at = state["version"]
    consumed_before = {i for ids in state["consumed"].values() for i in ids}
    consumed_at = {int(v): ids for v, ids in state["consumed"].items()}
    pending = TrajectoryLog(run_dir / "trajectories").load(consumed_at)
    pending_ids = {e.episode_id for g in pending for e in g}

    _write_toml(config, run_dir, tiny_checkpoint, steps=killed_at + 4)
    done = subprocess.run(cmd, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    final = _state(run_dir)
    assert final["version"] == killed_at + 4
    consumed = TrajectoryLog(run_dir / "trajectories").trained_ids()  # both runs', in order
    assert len(consumed) == len(set(consumed)) == final["version"] * 2, "an episode was trained twice"
    assert consumed_before <= set(consumed)
    # Every group the killed trainer had received is trained once, or dropped for staleness on the record.
    dropped = TrajectoryLog(run_dir / "trajectories").dropped_ids()
    assert pending_ids <= set(consumed) | dropped, "a group the killed trainer had received was lost"
    assert not dropped & set(consumed)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(line["metrics"]["train/staleness_max"] <= 2 for line in lines)  # the bound holds across the resume


def test_a_second_run_on_a_run_dir_in_use_is_refused(tmp_path, tiny_checkpoint):
    import fcntl

    run = tmp_path / "run"
    run.mkdir()
    with open(run / ".lock", "w") as held:  # as a running `rtrl train` holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError, match="in use by another `rtrl train`"):
            train(_config(run, tiny_checkpoint), show_progress=False)
    assert not (run / "checkpoints").exists()  # refused before anything was written


class _Corrupting(LocalBackend):
    """Groups come back with one behaviour logprob a GPU overflowed: the first group only, or every one."""
    every = False
    bad: list[str] = []

    def poll(self, timeout_s: float) -> list[list[Episode]]:
        groups = super().poll(timeout_s)
        for group in groups if self.every else groups[:1] if not self.bad else []:
            self.bad = [*self.bad, group[0].group_id]
            group[-1].segments[0].logprobs[group[-1].segments[0].loss_mask.nonzero()[0][0]] = np.nan
        return groups


def _run_with(monkeypatch, backend_class: type[LocalBackend], **attributes) -> list:
    """Make `rtrl train` run on real local workers behind backend_class (attributes set on each); the backends
    made, in order."""
    from realtime_rl.rollout import orchestrator

    backends: list = []

    def make_backend(config: TrainConfig, checkpoint_dir: Path) -> LocalBackend:
        backends.append(backend_class(config.rollout, checkpoint_dir, config.rl.group_size, config.seed,
                                      weights_dir=Path(config.run_dir) / "weights"))
        for name, value in attributes.items():
            setattr(backends[-1], name, value)
        return backends[-1]

    monkeypatch.setattr(orchestrator, "make_backend", make_backend)
    return backends


def test_a_group_the_trainer_would_refuse_is_set_aside_with_why_not_the_end_of_the_run(tmp_path, tiny_checkpoint,
                                                                                       monkeypatch):
    from realtime_rl.rollout.buffer import REJECTED_FILE

    backends = _run_with(monkeypatch, _Corrupting, every=False)
    summary = train(_config(tmp_path / "run", tiny_checkpoint, steps=2), show_progress=False)
    assert summary["version"] == 2 and summary["rejected_groups"] == 1
    log = tmp_path / "run" / "trajectories"
    [record] = [json.loads(line) for line in (log / REJECTED_FILE).read_text().splitlines()]
    [bad] = backends[0].bad
    assert record["group_id"] == bad and "non-finite behaviour logprob" in record["reason"]
    trained = {json.loads(line)["group_id"] for line in (log / "trained.jsonl").read_text().splitlines()}
    assert bad not in trained
    assert not (log / f"{bad}.npz").exists()


def test_a_run_whose_every_group_is_refused_stops_with_why_instead_of_spinning(tmp_path, tiny_checkpoint,
                                                                                monkeypatch):
    from realtime_rl.rollout.buffer import REJECTED_FILE
    from realtime_rl.rollout.orchestrator import REFUSED_STEPS

    backends = _run_with(monkeypatch, _Corrupting, every=True)
    config = _config(tmp_path / "run", tiny_checkpoint, steps=2)
    with pytest.raises(RuntimeError, match="refused the last .* non-finite behaviour logprob"):
        train(config, show_progress=False)  # no max_minutes: it would have handed out tasks forever
    records = (tmp_path / "run" / "trajectories" / REJECTED_FILE).read_text().splitlines()
    assert len(records) == REFUSED_STEPS * config.rl.groups_per_step <= len(backends[0].bad)
    trained = tmp_path / "run" / "trajectories" / "trained.jsonl"
    assert not trained.exists() or not trained.read_text().strip()  # nothing trained on a refused group


def test_a_run_whose_every_update_is_non_finite_stops_as_diverged(tmp_path, tiny_checkpoint, monkeypatch):
    """Each step skipped its non-finite updates, advanced the version and logged its batch as trained: a bf16
    overflow that persists used up the data while steps appeared to run."""
    import realtime_rl.rollout.orchestrator as orchestrator
    import realtime_rl.train.rl as rl

    monkeypatch.setattr(orchestrator, "MAX_NONFINITE_STEPS", 2)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, max_norm: torch.tensor(float("nan")))
    # a signal in every group (the tiny model's rewards are mostly all alike), so every step tries its updates
    monkeypatch.setattr(rl, "group_advantages", lambda rewards, *args: torch.linspace(-1, 1, len(rewards)))
    config = _config(tmp_path / "run", tiny_checkpoint, steps=4)
    with pytest.raises(RuntimeError, match="diverged: the last 2 steps took no update"):
        train(config, show_progress=False)



class _Failing(LocalBackend):
    """Real workers; the jobs `fails(k)` picks (k: the k-th submitted) name a difficulty no task has, so the
    worker's run_group raises, as it does for a sandbox that broke or an engine request that timed out."""

    fails = staticmethod(lambda k: k == 0)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.submitted, self.failing = 0, []

    def submit(self, job) -> None:
        if self.fails(self.submitted):
            job = dataclasses.replace(job, difficulty=99)
            self.failing.append(job.group_id)
        self.submitted += 1
        super().submit(job)


def test_a_group_that_fails_in_its_worker_is_recorded_and_replaced_not_the_end_of_the_run(tmp_path, tiny_checkpoint,
                                                                                        monkeypatch):
    from realtime_rl.rollout.buffer import FAILED_FILE

    backends = _run_with(monkeypatch, _Failing, fails=lambda k: k == 0)
    summary = train(_config(tmp_path / "run", tiny_checkpoint, steps=2), show_progress=False)
    assert summary["version"] == 2 and summary["failed_groups"] == 1
    assert summary["history"][-1]["rollout/failed_groups"] == 1
    log = tmp_path / "run" / "trajectories"
    [record] = [json.loads(line) for line in (log / FAILED_FILE).read_text().splitlines()]
    assert record["group_id"] == backends[0].failing[0] and "difficulty must be 1..4" in record["error"]
    trained = TrajectoryLog(log).trained_ids()
    assert len(trained) == len(set(trained)) == 2 * 2 * 2  # the failed group's slot went to another group


def test_a_run_whose_every_group_fails_stops_with_the_error(tmp_path, tiny_checkpoint, monkeypatch):
    from realtime_rl.rollout.buffer import FAILED_FILE
    from realtime_rl.rollout.orchestrator import REFUSED_STEPS

    _run_with(monkeypatch, _Failing, fails=lambda k: True)
    config = _config(tmp_path / "run", tiny_checkpoint, steps=2)
    with pytest.raises(RuntimeError, match=r"failed in their rollout workers(.|\n)*difficulty must be 1..4"):
        train(config, show_progress=False)  # no max_minutes: it would have handed out tasks forever
    records = (tmp_path / "run" / "trajectories" / FAILED_FILE).read_text().splitlines()
    assert len(records) == REFUSED_STEPS * config.rl.groups_per_step


def test_a_ray_group_that_raises_is_a_failure_and_the_actor_goes_on(tmp_path, tiny_checkpoint):
    ray = pytest.importorskip("ray")
    from realtime_rl.rollout.worker import GroupJob

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        backend = _started_ray_backend(tmp_path, tiny_checkpoint, workers=1)
        try:
            backend.submit(GroupJob("bad", 0, 99, 2, 0, 0))
            backend.submit(GroupJob("good", 0, 1, 2, 0, 0))
            groups, deadline = [], time.monotonic() + 120
            while backend.in_flight and time.monotonic() < deadline:
                groups += backend.poll(1.0)
            [failure] = backend.failures()
            assert failure.group_id == "bad" and "difficulty must be 1..4" in failure.error
            assert [g[0].group_id for g in groups] == ["good"] and backend.failures() == []
        finally:
            backend.close()
    finally:
        ray.shutdown()


class _Recording(LocalBackend):
    """Real workers; every group poll() returns is kept in `groups`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.groups: list[list[Episode]] = []

    def poll(self, timeout_s: float) -> list[list[Episode]]:
        groups = super().poll(timeout_s)
        self.groups += groups
        return groups


def test_a_synchronous_run_with_more_workers_than_groups_spreads_each_group_over_them(tmp_path, tiny_checkpoint,
                                                                                     monkeypatch):
    """One group a step, staleness 0, two workers: each group's two episodes run one on each worker (a group on
    one worker left the other idle) and come back as one group, in index order."""
    from realtime_rl.rollout.orchestrator import shards_per_group

    backends = _run_with(monkeypatch, _Recording)
    config = _config(tmp_path / "run", tiny_checkpoint, steps=2, max_staleness=0)
    config = config.model_copy(update={
        "rl": config.rl.model_copy(update={"groups_per_step": 1}),
        "rollout": config.rollout.model_copy(update={"workers": 2, "episodes_in_flight": 2})})
    assert shards_per_group(config) == 2
    assert train(config, show_progress=False)["version"] == 2
    groups = backends[0].groups
    assert len(groups) == 2 and backends[0].in_flight == 0
    for group in groups:
        assert [e.episode_id for e in group] == [f"{group[0].group_id}-{i}" for i in range(2)]
        assert sorted(e.metadata["worker"] for e in group) == [0, 1]
    trained = TrajectoryLog(tmp_path / "run" / "trajectories").trained_ids()
    assert sorted(trained) == sorted(e.episode_id for g in groups for e in g)
