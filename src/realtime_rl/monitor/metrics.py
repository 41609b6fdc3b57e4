"""One metrics interface: `sink.log(metrics, step)`, then `sink.close()`.

Keys are namespaced by stage: `train/loss`, `rollout/reward_mean`, `serve/latency_p50_ms`.
Implementations here: null, console (rich), JSONL (one object per call, flushed, so a crash loses at
most the line being written) and a fan-out. TensorBoard and W&B sinks arrive with the trainer.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

from rich.console import Console

Scalar = float | int | bool


@runtime_checkable
class MetricsSink(Protocol):
    def log(self, metrics: Mapping[str, Scalar], step: int) -> None: ...

    def close(self) -> None: ...


def _check(metrics: Mapping[str, Scalar]) -> None:
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"metric keys must be non-empty strings, got {key!r}")
        if not isinstance(value, (int, float, bool)):
            raise ValueError(f"metric {key!r} must be a number, got {type(value).__name__}")


class NullSink:
    def log(self, metrics: Mapping[str, Scalar], step: int) -> None:
        _check(metrics)

    def close(self) -> None:
        pass


class ConsoleSink:
    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)

    def log(self, metrics: Mapping[str, Scalar], step: int) -> None:
        _check(metrics)
        parts = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()]
        self.console.print(f"[dim]step {step}[/dim] " + "  ".join(parts), highlight=False)

    def close(self) -> None:
        pass


class JsonlSink:
    """Appends `{"step", "time", "metrics"}` lines; NaN and inf are written as null (valid JSON)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, metrics: Mapping[str, Scalar], step: int) -> None:
        _check(metrics)
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, "time": time.time(), "metrics": clean}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class MultiSink:
    def __init__(self, *sinks: MetricsSink) -> None:
        self.sinks = sinks

    def log(self, metrics: Mapping[str, Scalar], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
