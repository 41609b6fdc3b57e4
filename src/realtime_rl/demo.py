"""`rtrl demo` (`make demo`): the real-time loop end to end, on embedded defaults, on a laptop.

What it runs, in order, and says so:
1. the base model: continued pre-training of a small Qwen3-MoE on generated first-turn agent documents
   (expert and novice solutions, a few clarifying questions), or the one a previous run built;
2. the gateway (OpenAI-compatible, SQLite event store) serving it as the champion, with a second arm for
   canaries; both follow weight stores the loop publishes lossless deltas to;
3. simulated developers on the official openai client: each asks for a function from a held-out
   synthetic task, applies the edit, runs the hidden tests in a bubblewrap sandbox, and keeps, reverts or
   complains through the feedback API;
4. the real-time loop, `loop.cycles` times: settle the delayed rewards, judge the canary by A/B (edits
   kept, dissatisfied follow-ups, latency, with intervals) and the hacking monitors, train a candidate on
   the served traffic (exact tokens, logprobs and routing), gate it against the champion on held-out
   tasks, deploy it as the next canary;
5. the report: per cycle the gate decision and the A/B table, and run_dir/loop/report.html with plots.
"""

from __future__ import annotations

import math
import secrets
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from realtime_rl.collect import open_event_store
from realtime_rl.config import ABConfig, ApiKey, DemoConfig, ServeConfig
from realtime_rl.environments.users import run_simulated_users
from realtime_rl.evaluate import ABRecord, ABReport, ab_records, analyze
from realtime_rl.loop import RealtimeLoop
from realtime_rl.loop.report import write_report
from realtime_rl.rewards import read_traffic
from realtime_rl.serve import serve_in_process
from realtime_rl.train import ensure_base_model


def _traffic(run_dir: Path, since: float, until: float, persist_window_s: float,
             horizon_s: float) -> tuple[dict[str, int], list[ABRecord]]:
    store = open_event_store(run_dir, "sqlite")
    try:
        as_of = store.event_horizon()
        traffic = read_traffic(store, since, until)
    finally:
        store.close()
    version = {c.completion_id: c.model_version for c in traffic.completions}
    return version, ab_records(traffic.completions, [e for evs in traffic.events.values() for e in evs],
                               persist_window_s, horizon_s, as_of=as_of)


def traffic_by_version(run_dir: Path, since: float, until: float,
                       persist_window_s: float = 0.0, horizon_s: float = math.inf) -> dict[int, dict[str, float]]:
    """Completions, edits kept and reverted, and dissatisfied follow-ups of the traffic in [since, until),
    per served version (kept and reverted as the reward rules decide an edit with these windows: ab_records)."""
    version, records = _traffic(run_dir, since, until, persist_window_s, horizon_s)
    out: dict[int, dict[str, float]] = {}
    for r in records:
        if not r.delivered:  # never reached its user: no outcome
            continue
        s = out.setdefault(version[r.completion_id], {"completions": 0, "kept": 0, "reverted": 0, "dissatisfied": 0})
        s["completions"] += 1
        s["kept"] += r.kept
        s["reverted"] += r.reverted
        s["dissatisfied"] += r.dissatisfied
    return out


def traffic_progress(run_dir: Path, base: int, live: int, since: float, until: float,
                     persist_window_s: float = 0.0, horizon_s: float = math.inf) -> ABReport:
    """Edits kept, dissatisfied follow-ups and latency of everything `live` served against everything `base`
    served, intervals clustered by user (the A/B analysis with the two versions as its arms). The two served
    at different times: a comparison of versions under the same users, not a randomised experiment."""
    version, records = _traffic(run_dir, since, until, persist_window_s, horizon_s)
    arms = {base: "champion", live: "candidate"}
    paired = [replace(r, arm=arms[version[r.completion_id]]) for r in records if version[r.completion_id] in arms]
    return analyze(paired, ABConfig(min_completions_per_arm=1, min_edits_per_arm=1, min_users_per_arm=2))


def run_demo(config: DemoConfig, console: Console | None = None) -> dict[str, Any]:
    console = console or Console()
    run_dir = Path(config.run_dir)
    if config.threads:
        torch.set_num_threads(config.threads)
    t0 = time.perf_counter()

    console.rule("1. the base model")
    base_checkpoint = ensure_base_model(config.pretrain.model_copy(update={"run_dir": run_dir / "pretrain"}))
    console.print(f"base model: {base_checkpoint}")

    console.rule("2. the gateway, 3. simulated users, 4. the real-time loop")
    loop_dir, serve_dir = run_dir / "loop", run_dir / "serve"
    for old in (loop_dir, serve_dir):  # each demo is a fresh deployment of the same base model
        shutil.rmtree(old, ignore_errors=True)
    users_key = ApiKey(name="users", key=secrets.token_hex(16), scopes=["inference", "feedback"])
    admin_key = ApiKey(name="loop", key=secrets.token_hex(16), scopes=["admin"])
    settings = ServeConfig(checkpoint=base_checkpoint, run_dir=serve_dir, api_keys=[users_key, admin_key], port=0,
                           max_batch=config.max_batch, max_seq_len=4096, default_max_tokens=400,
                           weights=str(RealtimeLoop.champion_store(loop_dir)),
                           candidate_weights=str(RealtimeLoop.candidate_store(loop_dir)), weights_poll_s=0.5)
    stop = threading.Event()
    # The gateway in its own process, one torch thread, at a lower priority: the users keep talking to it while
    # the loop trains and gates, and on two shared cores the loop's work goes first (BENCHMARKS "loop", runs
    # 10-12: in a thread of this process, or in a process at equal priority, a cycle's training ran 3-12x
    # slower than alone). In production the gateway and the trainer run on their own machines.
    with serve_in_process(settings, serve_dir / "gateway.log", threads=1, niceness=10) as url:
        loop_config = config.loop.model_copy(update={
            "run_dir": loop_dir, "base_checkpoint": base_checkpoint, "gateway_url": url, "admin_key": admin_key.key,
            "store": "sqlite", "store_dir": serve_dir, "seed": config.seed})
        users_config = config.users.model_copy(update={
            "base_url": url, "api_key": users_key.key, "tasks_dir": run_dir / "user-tasks", "seed": config.seed})
        failed: list[BaseException] = []

        def simulate() -> None:  # a failure of the users is the demo's (the loop ran on no traffic, exit 0)
            try:
                run_simulated_users(users_config, Console(quiet=True), stop=stop, progress=False)
            except BaseException as e:
                failed.append(e)
                stop.set()

        with RealtimeLoop(loop_config, console) as loop:
            users = threading.Thread(target=simulate, name="rtrl-users", daemon=True)
            users.start()
            try:
                reports = loop.run(stop)
                progress = loop.progress()
            finally:
                stop.set()
                users.join(120)
        if failed:
            raise RuntimeError(f"the simulated users failed: {failed[0]!r}") from failed[0]
        if users.is_alive():
            raise RuntimeError("the simulated users did not stop within 120 s of the loop's end")
    report_path = write_report(loop_dir)

    table = Table(title="rtrl demo: the real-time loop, cycle by cycle (traffic of each window, by served version)")
    for column in ("cycle", "live", "served", "completions", "edits kept %", "dissatisfied %", "canary verdict",
                   "gate (new candidate)"):
        table.add_column(column, justify="right")
    starts = [r["window_start"] for r in reports] + [time.time()]
    persist_window_s, horizon_s = config.loop.rewards.persist_window_s, config.loop.rewards.horizon_s
    for r, since, until in zip(reports, starts, starts[1:]):
        canary, gate = r.get("canary") or {}, r.get("gate") or {}
        verdict = f"v{canary['version']} {canary['decision']}" if canary else "-"
        if gate:
            gated = f"v{gate['version']} {gate['decision']}"
        else:
            gated = "none: too little traffic" if (r.get("train") or {}).get("skipped") else "-"
        for version, s in sorted(traffic_by_version(serve_dir, since, until, persist_window_s, horizon_s).items()):
            resolved = s["kept"] + s["reverted"]
            kept = f"{100 * s['kept'] / resolved:.1f} ({s['kept']}/{resolved})" if resolved else "-"
            table.add_row(str(r["cycle"]), f"v{r['live_version']}", f"v{version}", str(s["completions"]), kept,
                          f"{100 * s['dissatisfied'] / s['completions']:.1f}", verdict, gated)
    console.print(table)

    base, live = progress["base"], progress["live"]
    progress["traffic"] = None
    if live != base:
        served = traffic_progress(serve_dir, base, live, starts[0], starts[-1], persist_window_s, horizon_s)
        progress["traffic"] = served.to_dict()
        kept = served.metrics["edits_kept"]
        table = Table(title=f"did the agent improve? v{live} (live at the end) against v{base} (the base)")
        for column in ("measure", f"v{base}", f"v{live}", "difference [CI]", "test"):
            table.add_column(column, justify="left" if column in ("measure", "test") else "right")
        table.add_row(f"gate suite pass@1 ({progress['tasks']} tasks, paired)",
                      f"{100 * progress['champion_pass_at_1']:.1f}%", f"{100 * progress['candidate_pass_at_1']:.1f}%",
                      f"{100 * progress['difference']:+.1f} [{100 * progress['ci'][0]:+.1f}, "
                      f"{100 * progress['ci'][1]:+.1f}] ({progress['ci_level']:.0%})",
                      f"Tango one-sided p={progress['p_value']:.3g}, McNemar exact p={progress['mcnemar_exact_p']:.3g}")
        table.add_row(f"edits kept % (served traffic, {served.arms['champion']['units']} + "
                      f"{served.arms['candidate']['units']} users)",
                      kept.champion.text(100, 1), kept.candidate.text(100, 1),
                      kept.difference.text(100, 1, sign=True) + f" ({served.confidence:.0%})",
                      f"{kept.method}, p={'-' if kept.p_value is None else f'{kept.p_value:.3g}'}")
        console.print(table)
    else:
        console.print(f"no candidate was promoted: v{base} is still live")
    minutes = (time.perf_counter() - t0) / 60
    console.print(f"report: {report_path} ({minutes:.1f} min in all)")
    return {"cycles": reports, "progress": progress, "report": str(report_path), "minutes": minutes,
            "base_checkpoint": str(base_checkpoint)}
