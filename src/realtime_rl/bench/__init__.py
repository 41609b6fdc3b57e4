"""The code behind `rtrl bench NAME`: each benchmark is a module with `run(quick) -> metrics`
(`run(quick, overrides)` for those that run the RL recipe).

`run_benchmark` wraps the metrics as `{"name", "metrics", "overrides", "env"}`; benchmarks/BENCHMARKS.md
records the figures with the command, machine and date. Nothing in the runtime package imports this.
"""

from __future__ import annotations

import datetime
import importlib
import os
import platform
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

BENCHMARKS = {
    "parity": "our Qwen3 / Qwen3-MoE logits against transformers', both load directions",
    "sandbox": "cold and warm sandboxed test runs: latency, throughput, isolation level, escapes contained",
    "engine": "decode tokens/s of our engine against transformers' generate (batch 1, 8, 32), capture cost, "
              "swap pause, GRPO groups' prefix sharing (device, dtype by env)",
    "mismatch": "engine logprobs against the trainer's full-sequence forward on a tiny MoE, with and without router replay",
    "delta": "weight-delta ratio vs the peers' encodings and the entropy bound on real AdamW steps, codec speed, swap pause",
    "learn": "held-out pass@1 of the default base model, then after the default RL recipe, and the RL wall time",
    "trainer": "one RL step of our trainer against TRL GRPOTrainer's on the same GRPO batch (rl.device, rl.dtype)",
    "async": "synchronous (staleness 0) against asynchronous RL: wall time for the same steps, trainer idle, pass@1",
    "vs-trl": "our trainer against TRL's GRPOTrainer: same base, tasks, reward and machine; minutes to the same pass rate",
    "ingest": "durable feedback events/s over HTTP into `rtrl serve` (SQLite, Postgres) with retries: lost, duplicated",
}
RECIPE_BENCHMARKS = ("learn", "trainer", "async", "vs-trl")
"""The benchmarks that run the RL recipe (configs/train/default.toml); `--set KEY=VALUE` changes it there
(trainer: its `rl` section, read by ours' step, and by TRL's for the device, dtype and KL weight; vs-trl:
only how ours spreads over the machine, `vs_trl.MACHINE_FIELDS`)."""


def environment() -> dict[str, Any]:
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=5, cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        commit = None
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "commit": commit,
    }
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def device_and_dtype(device: str = "cpu", dtype: str = "float32") -> tuple[torch.device, str]:
    """Where a bench runs: `RTRL_BENCH_DEVICE` and `RTRL_BENCH_DTYPE` (float32 or bfloat16), else the defaults."""
    import torch

    dtype = os.environ.get("RTRL_BENCH_DTYPE", dtype)
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"RTRL_BENCH_DTYPE must be float32 or bfloat16, got {dtype!r}")
    return torch.device(os.environ.get("RTRL_BENCH_DEVICE", device)), dtype


def run_benchmark(name: str, quick: bool = False, overrides: list[str] | None = None) -> dict[str, Any]:
    """Run one benchmark. `overrides` (`--set KEY=VALUE`) change the RL recipe of the benchmarks that run
    it and are recorded in the result; the others refuse them."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; choose from: {', '.join(sorted(BENCHMARKS))}")
    overrides = list(overrides or [])
    if overrides and name not in RECIPE_BENCHMARKS:
        raise ValueError(f"benchmark {name!r} runs no RL recipe, so --set has nothing to change "
                         f"(it applies to {', '.join(RECIPE_BENCHMARKS)})")
    module = importlib.import_module(f"realtime_rl.bench.{name.replace('-', '_')}")
    recipe = {"overrides": overrides} if name in RECIPE_BENCHMARKS else {}
    env = environment()  # before the run: a recipe's train() sets the process's torch threads
    metrics = module.run(quick=quick, **recipe)
    # "quick": a --quick run takes fewer samples (and a smoke base) under the same keys as a full one
    return {"name": name, "quick": quick, "metrics": metrics, "overrides": overrides, "env": env}
