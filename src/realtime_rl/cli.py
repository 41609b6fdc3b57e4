"""The `rtrl` command. One entry point; each subcommand reads its config (`--config FILE.toml`,
`--set key=value`), shows progress, and exits non-zero with a one-line reason on bad input. Parsing and the configs'
checks import no torch: `rtrl --help` and bad input answer at once; a subcommand imports what it runs.

Subcommands: `demo`, `pretrain`, `train`, `eval`, `serve`, `loop`, `registry`, `simulate-users`, `bench`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from realtime_rl.config import (
    DemoConfig, EvalConfig, LoopConfig, PretrainConfig, ServeConfig, SimulateUsersConfig, TrainConfig, load_config,
)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="TOML recipe (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config field, e.g. --set model.num_experts=8 (repeatable)")


def _flag_overrides(flags: dict[str, object]) -> list[str]:
    """Command-line flags as `--set` strings (TOML literals), applied before the user's own --set."""
    return [f"{k}={json.dumps(str(v) if isinstance(v, Path) else v)}" for k, v in flags.items() if v is not None]


def _add_registry_parser(sub: argparse._SubParsersAction) -> None:
    """`registry list|show|promote|rollback --run-dir DIR` (run by deploy/registry_cli.py)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--run-dir", type=Path, required=True, help="the loop's run directory (holds registry.sqlite)")
    parser = sub.add_parser("registry", help="list, inspect, promote and roll back policy versions")
    actions = parser.add_subparsers(dest="registry_action", required=True)
    actions.add_parser("list", parents=[common], help="every version: state, parent, data window, reward, metrics")
    show = actions.add_parser("show", parents=[common], help="a version's lineage and transitions with evidence")
    show.add_argument("version", type=int)
    for name, what in (("promote", "one step up: candidate -> canary, canary -> live (the live one retires)"),
                       ("rollback", "-> rolled_back; rolling back the live version restores the last retired")):
        p = actions.add_parser(name, parents=[common], help=what)
        p.add_argument("version", type=int)
        p.add_argument("--reason", required=True, help="why (recorded in the version's history)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rtrl", description="realtime-rl: RL from the people who use your agent.")
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the most complete end-to-end job on embedded defaults")
    _add_config_args(demo)

    ev = sub.add_parser("eval", help="grade reference solutions or stubs, or run a checkpoint, on a task folder")
    _add_config_args(ev)
    ev.add_argument("--tasks", type=Path, help="a task directory or a folder of them")
    which = ev.add_mutually_exclusive_group()
    which.add_argument("--solutions", choices=["reference", "stub"], help="grade the tasks' own files")
    which.add_argument("--checkpoint", type=Path, help="run this checkpoint's model through the agent loop")
    ev.add_argument("--samples", type=int, help="episodes per task (pass@k with k = samples)")
    ev.add_argument("--workers", type=int, help="concurrent tasks")
    ev.add_argument("--limit", type=int, help="only the first N tasks")
    ev.add_argument("--json", type=Path, help="write the report here")

    pre = sub.add_parser("pretrain", help="continued pre-training of the base model on generated agent episodes")
    _add_config_args(pre)

    tr = sub.add_parser("train", help="asynchronous RL on sandboxed synthetic coding tasks (resumes from its run_dir)")
    _add_config_args(tr)
    tr.add_argument("--base", type=Path, help="base checkpoint directory (default: build or reuse the default base model)")

    serve = sub.add_parser("serve", help="the OpenAI-compatible gateway in front of the engine")
    _add_config_args(serve)
    serve.add_argument("--checkpoint", type=Path, help="the checkpoint directory to serve")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to bind (default 8000)")

    loop = sub.add_parser("loop", help="the real-time cycle against a running gateway: settle rewards, judge the "
                                       "canary, train, gate, deploy, again")
    _add_config_args(loop)
    loop.add_argument("--gateway", help="the gateway's base URL (default http://127.0.0.1:8000)")
    loop.add_argument("--cycles", type=int, help="cycles to run (default: until interrupted)")

    users = sub.add_parser("simulate-users", help="simulated developers who use the gateway (openai client) and "
                                                  "send feedback")
    _add_config_args(users)
    users.add_argument("--gateway", help="the gateway's base URL (default http://127.0.0.1:8000)")
    users.add_argument("--users", type=int, help="concurrent users")

    _add_registry_parser(sub)

    from realtime_rl.bench import BENCHMARKS, RECIPE_BENCHMARKS

    bench = sub.add_parser("bench", help="run a benchmark and write its metrics",
                           description="benchmarks: " + "; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items()))
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    bench.add_argument("--json", type=Path, help="write {name, metrics, overrides, env} to this file")
    bench.add_argument("--quick", action="store_true", help="a short run (CI-sized)")
    bench.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a field of the RL recipe the benchmark runs (" + ", ".join(RECIPE_BENCHMARKS)
                            + ": configs/train/default.toml), e.g. --set rl.kl_coef=0 (repeatable)")
    return parser


def _run(args: argparse.Namespace) -> int:
    if args.command == "registry":
        from realtime_rl.deploy.registry_cli import run_registry

        return run_registry(args)
    if args.command == "demo":
        config = load_config(DemoConfig, args.config, args.overrides)
        from realtime_rl.demo import run_demo

        run_demo(config)
        return 0
    if args.command == "eval":
        flags = {"tasks": args.tasks, "solutions": args.solutions, "checkpoint": args.checkpoint,
                 "samples": args.samples, "workers": args.workers, "limit": args.limit}
        config = load_config(EvalConfig, args.config, [*_flag_overrides(flags), *args.overrides])
        from realtime_rl.evaluate import run_eval

        report = run_eval(config)
        summary = {k: v for k, v in report.items() if k != "per_task"}
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(summary, indent=2))
        return 0
    if args.command == "pretrain":
        config = load_config(PretrainConfig, args.config, args.overrides)
        from realtime_rl.train import pretrain

        result = pretrain(config)
        print(json.dumps(result, indent=2))
        return 0
    if args.command == "train":
        overrides = _flag_overrides({"base_checkpoint": args.base})
        config = load_config(TrainConfig, args.config, [*overrides, *args.overrides])
        from realtime_rl.rollout import train

        result = train(config)
        result.pop("history")
        print(json.dumps(result, indent=2))
        return 0
    if args.command == "serve":
        flags = {"checkpoint": args.checkpoint, "host": args.host, "port": args.port}
        config = load_config(ServeConfig, args.config, [*_flag_overrides(flags), *args.overrides])
        from realtime_rl.serve import run_server

        run_server(config)
        return 0
    if args.command == "loop":
        overrides = _flag_overrides({"gateway_url": args.gateway, "cycles": args.cycles})
        config = load_config(LoopConfig, args.config, [*overrides, *args.overrides])
        from realtime_rl.loop import RealtimeLoop
        from realtime_rl.loop.report import write_report

        try:
            with RealtimeLoop(config) as loop:
                loop.run()
        finally:
            print(f"report: {write_report(config.run_dir)}")
        return 0
    if args.command == "simulate-users":
        overrides = _flag_overrides({"base_url": args.gateway, "users": args.users})
        config = load_config(SimulateUsersConfig, args.config, [*overrides, *args.overrides])
        from realtime_rl.environments.users import run_simulated_users

        summary = run_simulated_users(config)
        print(json.dumps(summary, indent=2))
        if not summary["completions"]:  # nothing answered: a wrong URL or key, or a gateway down
            print(f"rtrl: error: no completion in {summary['sessions']} sessions ({summary['errors']} errors); "
                  f"is the gateway at {config.base_url} up, and the key right?", file=sys.stderr)
            return 1
        return 0
    if args.command == "bench":
        from realtime_rl.bench import run_benchmark

        result = run_benchmark(args.name, quick=args.quick, overrides=args.overrides)
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

    try:
        setup_logging(args.log_level)
        return _run(args)
    except ModuleNotFoundError as e:
        print(f"rtrl: error: {e.name} is not installed; install the dev extra: pip install -e '.[dev]'",
              file=sys.stderr)
    except (ValueError, OSError) as e:  # a bad value, or a path that cannot be read or written
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"rtrl: error: {first_line}", file=sys.stderr)
    except KeyboardInterrupt:
        print("rtrl: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
