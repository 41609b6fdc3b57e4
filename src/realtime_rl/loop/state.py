"""What a restarted real-time loop resumes from, besides the registry and the reward ledger."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from realtime_rl.model.checkpoint import write_durably


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
    canary_deployed: bool = True
    """False for a canary adopted from the registry after a stop before its weights and traffic share reached the
    gateway: the next cycle deploys it (state files from before this field hold deployed canaries only)."""
    trained_through: dict[int, int] = field(default_factory=dict)
    """Per trained version, the ledger's settle_seq through which settled rewards were considered when it was
    trained. A candidate of live version L trains on what came after trained_through[L] (0 for the base): never
    on what L's lineage already trained on, but again on what only a rolled-back sibling saw."""

    def start_canary(self, version: int, *, deployed: bool) -> None:
        """`version` is the canary from now on (deployed: its weights and traffic share reached the gateway)."""
        self.canary, self.canary_since, self.canary_cycles, self.canary_deployed = version, time.time(), 0, deployed

    def end_canary(self) -> None:
        """No canary any more (promoted or rolled back, by the loop or by hand)."""
        self.canary, self.canary_since, self.canary_cycles, self.canary_deployed = None, None, 0, True

    @classmethod
    def load(cls, path: Path, live: int | None = None) -> LoopState:
        """The saved state. A state.json from before trained_through was kept per version holds one seq; it
        applies to `live`, the version whose candidates it bounded."""
        if not path.is_file():
            return cls()
        data = json.loads(path.read_text())
        through = data.get("trained_through", {})
        if isinstance(through, int):
            through = {} if live is None else {live: through}
        data["trained_through"] = {int(version): int(seq) for version, seq in through.items()}
        return cls(**data)

    def save(self, path: Path) -> None:
        """Durably: trained_through is what keeps a restarted loop from training on the same rewards twice."""
        write_durably(path, json.dumps(asdict(self)).encode())
