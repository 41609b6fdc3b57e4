"""What a restarted real-time loop resumes from, besides the registry and the reward ledger."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class LoopState:
    """What a restarted loop needs besides the registry and the ledger (state.json, written atomically)."""

    cycle: int = 0
    window_start: float | None = None
    """When the current collection window opened."""
    canary: int | None = None
    """The version serving as canary, if any."""
    canary_since: float | None = None
    canary_cycles: int = 0
    trained_through: int = 0
    """The ledger's settle_seq up to which settled rewards were considered for training."""

    @classmethod
    def load(cls, path: Path) -> LoopState:
        return cls(**json.loads(path.read_text())) if path.is_file() else cls()

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)
