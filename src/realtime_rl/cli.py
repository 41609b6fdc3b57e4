"""The `rtrl` command. One entry point; each subcommand reads its config (`--config FILE.toml`,
`--set key=value`), shows progress, and exits non-zero with a one-line reason on bad input.

Subcommands appear here as their stage lands: `demo` and `bench` today; `pretrain`, `train`, `serve`,
`loop`, `eval`, `registry` and `simulate-users` arrive with the issues that build them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from realtime_rl.config import DemoConfig, load_config


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="TOML recipe (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config field, e.g. --set model.num_experts=8 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rtrl", description="realtime-rl: RL from the people who use your agent.")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the most complete end-to-end job on embedded defaults")
    _add_config_args(demo)

    from realtime_rl.bench import BENCHMARKS

    bench = sub.add_parser("bench", help="run a benchmark and write its metrics",
                           description="benchmarks: " + "; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items()))
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    bench.add_argument("--json", type=Path, help="write {name, metrics, env} to this file")
    bench.add_argument("--quick", action="store_true", help="a short run (CI-sized)")
    return parser


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo":
        from realtime_rl.demo import run_demo

        run_demo(load_config(DemoConfig, args.config, args.overrides))
        return 0
    if args.command == "bench":
        from realtime_rl.bench import run_benchmark

        result = run_benchmark(args.name, quick=args.quick)
        text = json.dumps(result, indent=2)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(text + "\n")
        print(text)
        return 0
    raise AssertionError(args.command)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from realtime_rl.monitor import setup_logging

    setup_logging(args.log_level)
    try:
        return _run(args)
    except ModuleNotFoundError as e:
        print(f"rtrl: error: {e.name} is not installed; install the dev extra: pip install -e '.[dev]'",
              file=sys.stderr)
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"rtrl: error: {first_line}", file=sys.stderr)
    except KeyboardInterrupt:
        print("rtrl: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
