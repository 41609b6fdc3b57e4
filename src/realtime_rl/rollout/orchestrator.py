"""`rtrl train`: the asynchronous RL loop, top to bottom, in the trainer's process.

    summary = train(TrainConfig(max_staleness=2))     # resumes from config.run_dir when it can

Each pass: admit new groups while the staleness bound allows (StalenessBuffer.may_start) and the
workers have room; take a batch of the groups due soonest when enough are ready, otherwise wait for
workers (the only place the trainer is idle, and it is timed; `rollout.timeout_s` with nothing
finishing ends the run). It also waits while stepping would leave a group in flight that no later
step can train before it passes the staleness bound (earliest deadline first,
`StalenessBuffer.stranded`): the straggler is trained in time instead of dropped. Then train one step;
checkpoint; publish the new weights (after the checkpoint is durable, so no worker ever samples from a
version a resume could lose); forget the consumed groups' log files. Finished groups are written to
the durable trajectory log before the trainer may consume them.

With max_staleness 0 this is synchronous on-policy RL: the next batch is admitted only after the
step that needs it has published. With max_staleness > 0 workers keep sampling (from the newest
weights they have; a swap lands between decode steps, so one episode can span versions and each
token keeps its own) while the trainer trains.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from realtime_rl.config import RolloutConfig, TrainConfig
from realtime_rl.environments.synthetic import pool_size, pool_task_index
from realtime_rl.environments.synthetic_ops import INPUT_TYPES
from realtime_rl.monitor import ConsoleSink, JsonlSink, MultiSink
from realtime_rl.rollout.base import GroupFailed, RolloutBackend
from realtime_rl.rollout.buffer import StalenessBuffer, TrajectoryLog
from realtime_rl.rollout.worker import GroupJob, new_group_id
from realtime_rl.train import RLTrainer, remove_staging, run_dir_lock
from realtime_rl.types import Episode

POLL_S = 0.5
REFUSED_STEPS = 4  # this many steps' worth of groups refused in a row, none taken, stops the run; failed likewise
MAX_NONFINITE_STEPS = 5  # this many steps in a row whose every update was non-finite (skipped) stops the run
logger = logging.getLogger(__name__)


def shards_per_group(config: TrainConfig) -> int:
    """Workers each group's episodes are spread over (`rollout.shards_per_group`; see there for None)."""
    rollout, rl = config.rollout, config.rl
    if rollout.shards_per_group is not None:  # more shards than workers would only queue on the same ones
        return min(rollout.shards_per_group, rl.group_size, rollout.workers)
    return max(1, min(rl.group_size, rollout.workers // ((config.max_staleness + 1) * rl.groups_per_step)))


def make_backend(config: TrainConfig, checkpoint_dir: Path) -> RolloutBackend:
    rollout = config.rollout
    if rollout.prefix_max_age is None:
        rollout = rollout.model_copy(update={"prefix_max_age": config.max_staleness})
    if rollout.backend == "ray":
        from realtime_rl.rollout.ray_actors import RayBackend
        return RayBackend(rollout, checkpoint_dir, config.rl.group_size, config.seed)
    from realtime_rl.rollout.local import LocalBackend
    return LocalBackend(rollout, checkpoint_dir, config.rl.group_size, config.seed,
                        weights_dir=Path(config.run_dir) / "weights")


def task_difficulty(k: int, rollout: RolloutConfig) -> int:
    """The difficulty of the run's k-th group: min_difficulty..max_difficulty in turn."""
    return rollout.min_difficulty + k % (rollout.max_difficulty - rollout.min_difficulty + 1)


def task_index(k: int, rollout: RolloutConfig) -> int:
    """The task index of the run's k-th group within its difficulty (rollout.task_mix): consecutive per difficulty,
    from first_task, or each input type in turn.
    The index space deals a difficulty's input-type pools (ints, nat, text) in turn, so with three difficulties in
    turn a shared counter gave one difficulty every third index: all its tasks from one pool."""
    turn = k // (rollout.max_difficulty - rollout.min_difficulty + 1)
    if rollout.task_mix == "index":
        return rollout.first_task + turn
    difficulty = task_difficulty(k, rollout)
    types = [t for t in INPUT_TYPES if pool_size(rollout.split, difficulty, t)]
    input_type = types[turn % len(types)]
    place = rollout.first_task // len(INPUT_TYPES) + turn // len(types)
    return pool_task_index(rollout.split, difficulty, input_type,
                           place % pool_size(rollout.split, difficulty, input_type))


def resolve_base(config: TrainConfig) -> Path:
    if config.base_checkpoint is not None:
        if not (Path(config.base_checkpoint) / "config.json").is_file():
            raise ValueError(f"base_checkpoint {config.base_checkpoint}: not a checkpoint directory")
        return Path(config.base_checkpoint)
    from realtime_rl.config import PretrainConfig
    from realtime_rl.train import ensure_base_model
    return ensure_base_model(PretrainConfig())


def train(config: TrainConfig, show_progress: bool = True) -> dict[str, Any]:
    """Train until config.steps or config.max_minutes; one run at a time per run_dir (a second would resume from the
    same checkpoint and train the logged groups again)."""
    run_dir = Path(config.run_dir)
    with run_dir_lock(run_dir, "`rtrl train`"):
        remove_staging(run_dir)  # a checkpoint save that a kill cut short
        return _train(config, run_dir, show_progress)


def _train(config: TrainConfig, run_dir: Path, show_progress: bool) -> dict[str, Any]:
    torch.set_num_threads(config.threads)
    base = resolve_base(config)
    trainer = RLTrainer.open(run_dir, base, config.rl)
    gps, size = config.rl.groups_per_step, config.rl.group_size
    log = TrajectoryLog(run_dir / "trajectories")
    rejected, in_a_row, failed, failed_in_a_row = 0, 0, 0, 0

    def admissible(group: list[Episode]) -> bool:
        """Whether the trainer would take the group; else it is logged as rejected, with why, and set aside (one
        bad group, say a non-finite logprob, must not end the run, nor every resume of it). When every group is
        refused (REFUSED_STEPS steps' worth in a row) the cause is the setup, not a group: the run stops."""
        nonlocal rejected, in_a_row
        ids, gid = [e.episode_id for e in group], group[0].group_id
        why = (f"group {gid} has {len(group)} episodes, not group_size {size}" if len(group) != size
               else f"group {gid} holds episodes of other groups" if any(e.group_id != gid for e in group)
               else f"group {gid} repeats an episode id" if len(set(ids)) != len(ids)
               else next((r for e in group if (r := trainer.refusal(e)) is not None), None))
        if why is None:
            in_a_row = 0
            return True
        log.reject(group, trainer.version, why)
        rejected, in_a_row = rejected + 1, in_a_row + 1
        logger.warning("group %s set aside: %s", group[0].group_id, why)
        if in_a_row >= REFUSED_STEPS * gps:
            raise RuntimeError(f"the trainer refused the last {in_a_row} groups (logged in trajectories/"
                               f"rejected.jsonl), the last because {why}: the rollouts cannot train this model")
        return False

    pending = [g for g in log.load(trainer.consumed) if admissible(g)]
    buffer = StalenessBuffer(config.max_staleness, gps, started=trainer.version * gps + len(pending))
    handed_out = log.tasks_handed_out()
    next_task = buffer.started if handed_out is None else handed_out  # only grows: drops give back no task
    for group in pending:
        buffer.add(group)
    backend = make_backend(config, base)
    backend.shards = shards_per_group(config)
    admitted: dict[str, int] = {}  # group id -> the trainer's version at admission, while in flight

    def fail(failure: GroupFailed) -> None:
        """A group whose worker raised (an engine request that timed out, a sandbox that broke) is recorded with
        its error and its slot re-admitted; its task is not handed out again. Failures only (REFUSED_STEPS
        steps' worth in a row) are the setup's fault or a broken worker's: the run stops with the last error."""
        nonlocal failed, failed_in_a_row
        admitted.pop(failure.group_id, None)
        buffer.started -= 1
        log.fail(failure.group_id, trainer.version, failure.worker, failure.error)
        failed, failed_in_a_row = failed + 1, failed_in_a_row + 1
        logger.warning("group %s failed in rollout worker %d: %s", failure.group_id, failure.worker,
                       failure.error.strip().rsplit("\n", 1)[-1])
        if failed_in_a_row >= REFUSED_STEPS * gps:
            raise RuntimeError(f"the last {failed_in_a_row} groups failed in their rollout workers (logged in "
                               f"trajectories/failed.jsonl); the last one's error:\n{failure.error}")

    def receive(finished: list[list[Episode]], failures: list[GroupFailed]) -> None:
        nonlocal failed_in_a_row
        for failure in failures:
            fail(failure)
        for group in finished:
            failed_in_a_row = 0
            admitted.pop(group[0].group_id, None)
            if not admissible(group):
                buffer.started -= 1  # admission may replace it
                continue
            log.append(group)
            buffer.add(group)

    t_start = time.perf_counter()
    idle_s, straggler_s, first_version, history = 0.0, 0.0, trainer.version, []
    nonfinite_steps = 0
    fill_s, fill_idle_s = None, 0.0  # start to this run's first step (the pipeline filling), and its idle part
    columns = (TextColumn("train"), BarColumn(), TextColumn("v{task.completed}/{task.total} {task.fields[info]}"),
               TimeElapsedColumn())
    with contextlib.ExitStack() as closing:  # the sink, then the backend, whatever ends the run
        closing.callback(backend.close)
        sink = closing.enter_context(contextlib.closing(
            MultiSink(JsonlSink(run_dir / "metrics.jsonl"), *([] if show_progress else [ConsoleSink()]))))
        backend.start(trainer.weights(), trainer.version)
        t_start = time.perf_counter()  # worker start-up is not training time
        progress_at = time.perf_counter()  # the last step or finished group: a wait's timeout runs from it
        with Progress(*columns, disable=not show_progress) as progress:
            bar = progress.add_task("train", total=config.steps, completed=trainer.version, info="")
            while trainer.version < config.steps:
                if config.max_minutes and (time.perf_counter() - t_start) / 60 >= config.max_minutes:
                    break
                while backend.in_flight < backend.capacity and buffer.may_start(trainer.version):
                    job = GroupJob(new_group_id(), task_index(next_task, config.rollout),
                                   task_difficulty(next_task, config.rollout), size,
                                   config.seed * 1_000_003 + next_task, trainer.version)
                    next_task += 1
                    log.hand_out(next_task)
                    backend.submit(job)
                    admitted[job.group_id] = job.started_version
                    buffer.started += 1
                batch = None
                stranding = buffer.stranded(trainer.version, admitted.values())
                if not stranding:
                    batch, dropped = buffer.take(trainer.version)
                    log.drop(dropped, trainer.version)
                if batch is None:
                    t0 = time.perf_counter()
                    finished, failures = backend.poll(POLL_S), backend.failures()
                    idle_s += time.perf_counter() - t0
                    if stranding:  # a batch was ready: the straggler's wait
                        straggler_s += time.perf_counter() - t0
                    if finished or failures:
                        progress_at = time.perf_counter()
                    elif backend.in_flight and time.perf_counter() - progress_at > config.rollout.timeout_s:
                        raise TimeoutError(f"no rollout finished in {config.rollout.timeout_s:.0f} s "
                                           f"({backend.in_flight} groups in flight)")
                    receive(finished, failures)
                    continue

                t_step = time.perf_counter()
                if fill_s is None:
                    fill_s, fill_idle_s = t_step - t_start, idle_s
                metrics = trainer.step([e for g in batch for e in g])
                # Every update of the step non-finite: the weights did not move, yet the batch counts as trained.
                # A few in a row is divergence (a bf16 overflow that persists), not a bad batch: stop, say why.
                if "train/updates" in metrics:  # a step without signal (no update tried) says nothing either way
                    none_taken = metrics.get("train/skipped_nonfinite_updates", 0) == metrics["train/updates"]
                    nonfinite_steps = nonfinite_steps + 1 if none_taken else 0
                if nonfinite_steps >= MAX_NONFINITE_STEPS:
                    raise RuntimeError(f"training diverged: the last {nonfinite_steps} steps took no update (every "
                                       "gradient non-finite); lower rl.lr, or train in fp32 (rl.dtype)")
                trainer.save(config.checkpoint_keep)
                backend.publish(trainer.weights(), trainer.version)
                log.remove(batch, trainer.version)
                receive(backend.poll(0), backend.failures())
                progress_at = time.perf_counter()
                elapsed = time.perf_counter() - t_start
                metrics |= {
                    "train/step_s": time.perf_counter() - t_step,
                    "train/idle_fraction": idle_s / max(elapsed, 1e-9),
                    "train/minutes": elapsed / 60,
                    "rollout/tokens_per_s": backend.generated_tokens() / max(elapsed, 1e-9),
                    "rollout/dropped_stale_groups": float(buffer.dropped),
                    "rollout/rejected_groups": float(rejected),
                    "rollout/failed_groups": float(failed),
                    "rollout/straggler_wait_s": straggler_s,
                    "rollout/groups_ready": float(len(buffer.ready)),
                    **backend.engine_metrics(),
                }
                if backend.last_publish is not None and backend.last_publish.ratio:
                    metrics["sync/delta_ratio"] = backend.last_publish.ratio
                    metrics["sync/publish_s"] = backend.last_publish.seconds
                sink.log(metrics, trainer.version)
                history.append(metrics)
                progress.update(bar, completed=trainer.version,
                                info=f"reward {metrics['train/reward_mean']:.2f} idle {metrics['train/idle_fraction']:.0%}")
    elapsed = time.perf_counter() - t_start
    rewards = [m["train/reward_mean"] for m in history]
    return {
        # Version 0 (no step yet, here or in the run resumed) is the base: there is no v-0000000.
        "checkpoint": str(run_dir / "checkpoints" / f"v-{trainer.version:07d}" if trainer.version else base),
        "version": trainer.version,
        "steps_this_run": trainer.version - first_version,
        "minutes": elapsed / 60,
        "trainer_idle_fraction": idle_s / max(elapsed, 1e-9),
        # The same after the first batch arrived: the steady state a run of many more steps approaches.
        "fill_s": fill_s,
        "trainer_idle_fraction_after_fill": (None if fill_s is None else
                                             (idle_s - fill_idle_s) / max(elapsed - fill_s, 1e-9)),
        "reward_first": rewards[0] if rewards else None,
        "reward_last_mean": float(np.mean(rewards[-3:])) if rewards else None,
        "dropped_stale_groups": buffer.dropped,
        "rejected_groups": rejected,
        "failed_groups": failed,
        "straggler_wait_s": straggler_s,
        "rollout_tokens_per_s": backend.generated_tokens() / max(elapsed, 1e-9),
        "rollout": {k.removeprefix("rollout/"): v for k, v in backend.engine_metrics().items()},
        "history": history,
    }
