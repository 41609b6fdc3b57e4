"""Asynchronous rollout: workers (engine + agent loop + sandbox), the staleness-bounded buffer, the
durable trajectory log, local-process and Ray backends, and the `rtrl train` loop (orchestrator.py).

    summary = train(TrainConfig())          # resumable; max_staleness = 0 is synchronous on-policy
"""

from realtime_rl.rollout.base import RolloutBackend
from realtime_rl.rollout.buffer import StalenessBuffer, TrajectoryLog, group_staleness
from realtime_rl.rollout.orchestrator import make_backend, train
from realtime_rl.rollout.worker import GroupJob, RolloutWorker

__all__ = ["GroupJob", "RolloutBackend", "RolloutWorker", "StalenessBuffer", "TrajectoryLog", "group_staleness",
           "make_backend", "train"]
