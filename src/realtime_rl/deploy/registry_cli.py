"""`rtrl registry list|show|promote|rollback --run-dir DIR`: the registry from the command line.

    rtrl registry list --run-dir runs/loop                       # versions: state, parent, window, reward, metrics
    rtrl registry show 7 --run-dir runs/loop                     # lineage and every transition with its evidence
    rtrl registry promote 7 --run-dir runs/loop --reason "..."   # one step up: candidate -> canary -> live
    rtrl registry rollback 7 --run-dir runs/loop --reason "..."  # -> rolled_back (live: restores the last retired)

cli.py builds the parser (without importing this module: it imports torch through `realtime_rl.deploy`) and runs
the action with `run_registry(args)`.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from realtime_rl.deploy.registry import DataWindow, PolicyVersion, Registry


def run_registry(args: argparse.Namespace) -> int:
    """Run a `rtrl registry` action; bad input raises ValueError (the cli prints its first line)."""
    console = Console(markup=False)  # reasons and paths may hold [brackets]
    with Registry.open(args.run_dir, create=False) as registry:
        if args.registry_action == "list":
            console.print(versions_table(registry.list()))
        elif args.registry_action == "show":
            show_version(console, registry, args.version)
        elif args.registry_action == "promote":
            state = registry.get(args.version).state
            target = {"candidate": "canary", "canary": "live"}.get(state, "live")
            v = registry.transition(args.version, target, reason=args.reason, evidence={"by": "rtrl registry"})
            console.print(f"version {v.version}: {state} -> {v.state}")
        elif args.registry_action == "rollback":
            state = registry.get(args.version).state
            v = registry.rollback(args.version, reason=args.reason, evidence={"by": "rtrl registry"})
            live = registry.live()
            console.print(f"version {v.version}: {state} -> {v.state}; live: "
                          f"{'none' if live is None else live.version}")
        else:
            raise AssertionError(args.registry_action)
    return 0


def _fmt_time(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _hours(window: DataWindow) -> str:
    return f"{(window.until - window.since) / 3600:.2f} h"


def _key_metrics(metrics: dict[str, Any], limit: int = 4) -> str:
    shown = [(k, v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return ", ".join(f"{k}={v:.4g}" for k, v in shown[:limit])


def versions_table(versions: list[PolicyVersion]) -> Table:
    """A rich Table: version, state, parent, data window, reward version, key metrics."""
    table = Table(title="policy versions")
    for column in ("version", "state", "parent", "data window", "reward", "metrics"):
        table.add_column(column)
    for v in versions:
        window = "-" if v.window is None else (f"{_fmt_time(v.window.since)} +{_hours(v.window)}, "
                                               f"{v.window.completions} completions")
        table.add_row(str(v.version), v.state, "-" if v.parent is None else str(v.parent), window,
                      v.reward_version or "-", _key_metrics(v.metrics) or "-")
    return table


def show_version(console: Console, registry: Registry, version: int) -> None:
    """Print the version, its lineage and its transitions with their evidence."""
    v = registry.get(version)
    console.print(f"version {v.version} [{v.state}]  checkpoint {v.checkpoint}")
    console.print(f"  created {_fmt_time(v.created_at)}; reward {v.reward_version or '-'} "
                  f"({v.reward_digest or 'no digest'})")
    if v.window is not None:
        console.print(f"  data {_fmt_time(v.window.since)} .. {_fmt_time(v.window.until)} ({_hours(v.window)}), "
                      f"{v.window.completions} completions")
    console.print(f"  metrics {json.dumps(v.metrics, sort_keys=True)}")
    console.print("lineage: " + " <- ".join(f"{p.version} ({p.state})" for p in registry.lineage(version)))
    console.print("transitions:")
    for t in registry.history(version):
        console.print(f"  {_fmt_time(t.at)}  {t.from_state or '(new)'} -> {t.to_state}: {t.reason}")
        if t.evidence:
            console.print(f"    evidence {json.dumps(t.evidence, sort_keys=True)}", soft_wrap=True)
