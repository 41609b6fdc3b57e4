"""The gateway's two arms: the champion engine, an optional candidate engine, and the split of users.

    arms = Arms(champion, candidate=None, traffic=load_traffic(run_dir / "traffic.json", default), path=...)
    arm, engine = arms.pick(user, session_id)     # per request: "champion" or "candidate", and its engine
    arms.set_traffic(0.05, salt=None)              # persisted (atomic rename), then seen by new requests
    arms.candidate = build_candidate(champion, state, version)   # once the candidate's store has a version

A request goes to the arm `deploy.assign_arm` gives its user (else its session id) under the current
traffic; with neither, while no candidate exists, or once the candidate's engine thread has died (its
users would get 503 until a restart), it goes to the champion. The traffic is one
immutable value swapped whole: a request reads it once, so a change applies to new requests and one in
flight finishes on the arm it started on.

run_dir/traffic.json holds the split an operator set through PUT /v1/admin/traffic; a restarted
gateway reads it back (it wins over ServeConfig.candidate_fraction and traffic_salt).

Not here: deciding to promote or roll back (evaluate, deploy), per-arm statistics (evaluate.ab).
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import ValidationError

from realtime_rl.deploy import ARMS, Arm, assign_arm
from realtime_rl.engine import AsyncEngine, Engine
from realtime_rl.model.checkpoint import write_durably
from realtime_rl.serve.schemas import TrafficUpdate

__all__ = ["ARMS", "Arm", "Arms", "Traffic", "build_candidate", "load_traffic", "save_traffic"]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Traffic:
    candidate_fraction: float
    """Share of users the candidate serves, in [0, 1]."""
    salt: str
    """Salt of the user hash; a new salt draws a new split."""


def load_traffic(path: Path, default: Traffic) -> Traffic:
    """The split persisted at `path`, or `default` when there is none; a damaged file is a ValueError."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return default
    try:
        saved = TrafficUpdate.model_validate_json(text)
    except ValidationError as e:
        raise ValueError(f"{path}: not a traffic split ({e.errors()[0]['msg']}); fix it or delete it to use the "
                         "configured candidate_fraction and traffic_salt") from None
    return Traffic(saved.candidate_fraction, saved.salt or default.salt)


def save_traffic(path: Path, traffic: Traffic) -> None:
    """Write atomically and durably: a reader (or a restart after a crash) sees the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_durably(path, json.dumps({"candidate_fraction": traffic.candidate_fraction, "salt": traffic.salt}).encode())


class Arms:
    def __init__(self, champion: AsyncEngine, candidate: AsyncEngine | None, traffic: Traffic, path: Path) -> None:
        self.champion = champion
        self.candidate = candidate
        """None until the candidate's weight store has a version (or a caller passes an engine)."""
        self.traffic = traffic
        self.path = path
        self._lock = threading.Lock()  # one writer of the file at a time, so file and memory agree
        self._dead_candidate: AsyncEngine | None = None  # the dead candidate engine already logged

    def pick(self, user: str | None, session_id: str | None) -> tuple[Arm, AsyncEngine]:
        candidate, traffic = self.candidate, self.traffic  # read once: a concurrent change is seen whole or not at all
        key = user or session_id
        if candidate is not None and candidate.error is not None:
            if self._dead_candidate is not candidate:
                self._dead_candidate = candidate
                log.error("the candidate engine died (%r); its users go to the champion", candidate.error)
            candidate = None
        if candidate is None or key is None:
            return "champion", self.champion
        arm = assign_arm(key, traffic.salt, traffic.candidate_fraction)
        return arm, candidate if arm == "candidate" else self.champion

    def set_traffic(self, candidate_fraction: float, salt: str | None = None) -> Traffic:
        """Persist the new split, then route new requests by it; `salt` None keeps the current salt."""
        with self._lock:
            traffic = Traffic(candidate_fraction, salt or self.traffic.salt)
            save_traffic(self.path, traffic)
            self.traffic = traffic
            return traffic

    def version(self, arm: Arm) -> int | None:
        engine = self.champion if arm == "champion" else self.candidate
        return None if engine is None else engine.version


def build_candidate(champion: AsyncEngine, state: Mapping[str, torch.Tensor], version: int) -> AsyncEngine:
    """A started engine of the champion's architecture, tokenizer, batch and context, serving `state`."""
    live = champion.engine
    model = copy.deepcopy(live.model)  # the architecture (tied weights included); its weights are replaced below
    engine = Engine(model, live.tokenizer, max_batch=live.max_batch, max_seq_len=live.max_seq_len, version=version,
                    capture_routing=live.capture_routing, prefix_caching=live.slots.prefix_caching,
                    prefix_max_age=live.slots.prefix_max_age, compile_decode=live.compile_decode,
                    cascade_decode=live.cascade_decode, graphs=live.graphs is not None)
    engine.update_weights(state, version)  # checks names and shapes
    engine.step()  # no requests yet: the step only swaps the staged weights in, before anyone is served
    assert engine.version == version
    return AsyncEngine(engine, max_pending=champion.max_pending).start()
