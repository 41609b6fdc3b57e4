"""`rtrl loop`: the real-time cycle against a running gateway and its event store, again and again.

    loop = RealtimeLoop(LoopConfig(...))     # registry, ledger, store, weight stores; bootstraps version 0
    loop.run()                               # config.cycles cycles (or until stopped)
    loop.run_cycle()                         # one cycle; returns its report (also appended to cycles.jsonl)

One cycle, top to bottom (`run_cycle`):

1. collect   wait out the window while users talk to the gateway (champion, and the canary if any);
             with no canary, the live champion's gate evaluation runs in the window (once per version);
2. settle    the delayed-reward ledger settles every completion whose windows closed (late and early
             events handled there), with the configured reward rules;
3. judge     the canary deployed last cycle: A/B on this window's traffic (edits kept, dissatisfied
             follow-ups, latency, sample-ratio check) plus the hacking monitors, canary arm against
             champion arm. Promote: its weights go to the champion's weight store as a lossless delta and
             the canary's share drops to 0. Roll back: the share drops to 0. Undecided: keep collecting
             (at most max_canary_cycles);
4. train     with no canary running: the settled rewards of the live version's traffic (and of its last
             max_staleness ancestors: on-policy within the bound, importance-corrected by the trainer)
             that its lineage has not trained on (a rolled-back sibling's data included) become episodes
             with the exact served tokens, logprobs and routing; a few RL steps from the live checkpoint
             make the candidate, registered with its lineage and data window;
5. gate      candidate and live champion play the same held-out tasks with the same seeds; a paired
             non-inferiority test, hack canaries (hard tasks a dodging policy does not even try) and
             the monitors on the evaluation decide; the decision and its evidence go into the registry;
6. deploy    a candidate that passes is published to the candidate weight store (a lossless delta,
             verified and hot-swapped by the gateway) and gets ab.candidate_fraction of the users.

Everything the loop decides is written down: registry transitions carry their evidence, cycles.jsonl
one report per cycle, metrics.jsonl the numbers. A restarted loop continues from state.json, the
registry and the ledger. Not here: serving (the gateway), users (simulated or real).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from realtime_rl.collect import EventStore, open_event_store
from realtime_rl.config import LoopConfig, PretrainConfig
from realtime_rl.deploy import (
    DataWindow, FilesystemTransport, PolicyVersion, Registry, StateChanged, WeightPublisher,
)
from realtime_rl.evaluate import EpisodeOutcome, ab_records, analyze, decide, evaluate_checkpoint
from realtime_rl.loop.gateway import GatewayClient
from realtime_rl.loop.report import cycle_metrics
from realtime_rl.loop.state import LoopState
from realtime_rl.loop.suites import cached_outcomes, dodged, eval_key, interaction, suite
from realtime_rl.loop.training_data import on_policy_rewards
from realtime_rl.model import load_checkpoint, save_checkpoint
from realtime_rl.model.checkpoint import publish_directory
from realtime_rl.monitor import JsonlSink
from realtime_rl.rewards import RewardLedger, Traffic, compare, read_traffic, traffic_interactions
from realtime_rl.train import RLTrainer, ensure_base_model, run_dir_lock, traffic_episodes

REGISTRY_POLL_S = 30.0
"""How often the loop follows the registry while it waits out a collection window (an operator's rollback)."""


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    model = load_checkpoint(checkpoint, dtype=torch.float32).model
    return {name: p.detach() for name, p in model.named_parameters()}


class RealtimeLoop:
    """One loop over one run directory; close it (or use it as a context manager) to release what it opened:
    the registry, the ledger, the metrics sink, and the event store and gateway client unless they were given."""

    def __init__(self, config: LoopConfig, console: Console | None = None, gateway: GatewayClient | None = None,
                 store: EventStore | None = None) -> None:
        self.config = config
        self.console = console or Console()
        self.run_dir = Path(config.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if config.threads:
            torch.set_num_threads(config.threads)
        with contextlib.ExitStack() as opened:  # a step that raises closes what the steps before it opened
            # One loop per run directory: a second would roll back the first's candidate as interrupted, and both
            # would move trained_through, training the same rewards twice.
            opened.enter_context(run_dir_lock(self.run_dir, "`rtrl loop`"))
            self.registry = opened.enter_context(Registry.open(self.run_dir))
            self.ledger = opened.enter_context(RewardLedger(self.run_dir / "rewards.sqlite"))
            self.store = store or opened.enter_context(open_event_store(config.store_dir, config.store))
            self.gateway = gateway or GatewayClient(config.gateway_url, config.admin_key, config.http_timeout_s)
            if gateway is None:
                opened.callback(self.gateway.close)
            live = self.registry.live()
            self.state = LoopState.load(self.run_dir / "state.json", None if live is None else live.version)
            self.champion_weights = WeightPublisher(FilesystemTransport(self.champion_store(self.run_dir)), dtype=None)
            self.candidate_weights = WeightPublisher(FilesystemTransport(self.candidate_store(self.run_dir)),
                                                     dtype=None)
            self.champion_weights.resume()
            self.candidate_weights.resume()
            self.sink = JsonlSink(self.run_dir / "metrics.jsonl")
            opened.callback(self.sink.close)
            if self.registry.live() is None:
                base = config.base_checkpoint or ensure_base_model(PretrainConfig())
                live = self.registry.bootstrap(base, version=0)
                self._publish_champion(live)
            levels = range(1, config.gate_max_difficulty + 1)
            self.gate_tasks = suite(self.run_dir / "gate-tasks", config.gate_tasks, levels, config.gate_split,
                                    config.seed, config.gate_start)
            self.canary_tasks = suite(self.run_dir / "canary-tasks", config.canary_tasks, [4], "heldout", config.seed,
                                      config.gate_start)
            self._reconcile()
            self._opened = opened.pop_all()

    def __enter__(self) -> RealtimeLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def champion_store(run_dir: Path) -> Path:
        """The weight store the gateway's champion arm follows (ServeConfig.weights)."""
        return Path(run_dir) / "weights" / "champion"

    @staticmethod
    def candidate_store(run_dir: Path) -> Path:
        """The weight store the gateway's candidate arm follows (ServeConfig.candidate_weights)."""
        return Path(run_dir) / "weights" / "candidate"

    # ------------------------------------------------------------------------------------------ the cycle

    def run(self, stop: threading.Event | None = None) -> list[dict[str, Any]]:
        reports = []
        while self.config.cycles is None or len(reports) < self.config.cycles:
            if stop is not None and stop.is_set():
                break
            reports.append(self.run_cycle(stop))
        return reports

    def run_cycle(self, stop: threading.Event | None = None) -> dict[str, Any]:
        cfg, state = self.config, self.state
        state.cycle += 1
        if state.window_start is None:
            state.window_start = time.time()
        report: dict[str, Any] = {"cycle": state.cycle, "window_start": state.window_start,
                                  "live_version": self.registry.live().version}
        self.console.rule(f"cycle {state.cycle}: live v{report['live_version']}"
                          + (f", canary v{state.canary}" if state.canary is not None else ""))

        # 1. collect: users talk to the gateway while the window is open. The loop has nothing else to do
        # then, so it evaluates the live champion on the gate's suite first (cached: once per version), which
        # the gate of this cycle's candidate would otherwise wait for.
        stop = stop or threading.Event()
        lap = time.perf_counter()
        if state.canary is None and self.gate_tasks:
            self.evaluate(self.registry.live())
        in_window = {"champion_eval": round(time.perf_counter() - lap, 2)}
        followed: list[str] = []  # an operator's promote or rollback takes effect within REGISTRY_POLL_S
        while (remaining := state.window_start + cfg.cycle_period_s - time.time()) > 0:
            if stop.wait(min(remaining, REGISTRY_POLL_S)):
                state.cycle -= 1
                return report | {"stopped": True, "registry": followed}
            followed += self._follow_registry()
        window_end = time.time()
        t0 = time.perf_counter()

        seconds: dict[str, float] = {}  # where the cycle's time after the window went
        lap = time.perf_counter()
        report["registry"] = followed + self._follow_registry()
        seconds["registry"] = time.perf_counter() - lap

        # 2. settle the rewards whose windows closed
        lap = time.perf_counter()
        # at most the store's horizon: on a loop clock ahead of the store's, events still committing would be late
        update = self.ledger.update(self.store, cfg.rewards, min(window_end, self.store.event_horizon()))
        stats = self.ledger.stats()
        report["rewards"] = {"new_completions": update.completions, "settled": len(update.settled),
                             **asdict(stats), "rules": cfg.rewards.version}
        seconds["settle"] = time.perf_counter() - lap

        # 3. judge the canary on this window's traffic
        if state.canary is not None:
            lap = time.perf_counter()
            report["canary"] = self._judge_canary(window_end)
            seconds["judge"] = time.perf_counter() - lap

        # 4-6. train, gate and deploy a candidate (one canary at a time)
        if state.canary is None:
            lap = time.perf_counter()
            candidate = self._train(report, window_end)
            seconds["train"] = time.perf_counter() - lap
            if candidate is not None:
                lap = time.perf_counter()
                report["gate"] = self._gate_and_deploy(candidate)
                seconds["gate"] = time.perf_counter() - lap
        report["seconds"] = {k: round(v, 2) for k, v in seconds.items()}
        report["seconds_in_window"] = in_window

        state.window_start = time.time()  # the next window opens now: a canary deployed above gets a whole one
        self._save()
        report["minutes_after_window"] = (time.perf_counter() - t0) / 60
        report["live_version_after"] = self.registry.live().version
        with open(self.run_dir / "cycles.jsonl", "a+") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() and (f.seek(f.tell() - 1), f.read(1))[1] != "\n":  # a line cut by a stop: end it first
                f.write("\n")
            f.write(json.dumps(report, default=str) + "\n")
        self.sink.log(cycle_metrics(report), step=state.cycle)
        return report

    def _save(self) -> None:
        self.state.save(self.run_dir / "state.json")

    def _reconcile(self) -> None:
        """After a crash mid-cycle, the registry (written first, atomically) is the truth: the canary is
        whatever version it says is canary, and a candidate that never reached the gate's decision is
        rolled back (its traffic share was never raised). A canary the state did not know of yet was stopped
        somewhere between the registry and its traffic share: it is deployed again (_follow_registry)."""
        canaries = self.registry.list("canary")
        if canaries and self.state.canary != canaries[-1].version:
            self.state.start_canary(canaries[-1].version, deployed=False)
        # A canary the registry no longer lists as canary (rolled back or promoted by hand while the loop was
        # down, or promoted by a loop stopped before it set the traffic share to 0) stays in the state: the
        # cycle's _follow_registry sets its traffic share to 0 first (forgetting it here left the gateway's
        # split as it was, so its users kept being served by a version rolled back).
        for orphan in self.registry.list("candidate"):
            self.registry.transition(orphan.version, "rolled_back",
                                     reason="interrupted: the loop stopped before the gate decided")
        self._save()

    def _publish_champion(self, version: PolicyVersion) -> None:
        """Send `version`'s weights to the champion arm. The store's versions only increase, so a version older
        than the one serving (a rollback) goes out as the next store version, labelled with its own policy
        version: the gateway serves it and stamps its tokens with it."""
        last = self.champion_weights.last
        store_version = version.version if last is None else max(version.version, last.version + 1)
        label = None if store_version == version.version else version.version
        self.champion_weights.publish(_weights(version.checkpoint), store_version, policy_version=label)

    @property
    def champion_serves(self) -> int | None:
        """The policy version the champion arm's weight store holds last (None before the first publish)."""
        return None if self.champion_weights.last is None else self.champion_weights.last.serves

    def _follow_registry(self) -> list[str]:
        """`rtrl registry promote|rollback` may act while the loop waits: follow the registry before deciding.
        A canary an operator promoted or rolled back leaves the candidate arm (a promoted one reaches the
        champion arm first, so its users move over once it serves them there). A candidate an operator made
        canary is deployed, once no other canary runs. A live version other than the one the champion arm
        serves (set or rolled back by hand, or promoted by a loop stopped before it published) is published to
        it: a rollback as the next store version, labelled with the older policy version."""
        state, actions = self.state, []
        if state.canary is not None and (now := self.registry.get(state.canary).state) != "canary":
            if now == "live" and self.champion_serves != state.canary:  # its users move once the champion serves it
                self._publish_champion(self.registry.get(state.canary))
                self._await_arm("champion", state.canary)
            self.gateway.set_candidate_fraction(0.0)
            actions.append(f"canary v{state.canary} is {now} by hand: its traffic share is now 0")
            state.end_canary()
        if state.canary is None and (canaries := self.registry.list("canary")):
            state.start_canary(canaries[-1].version, deployed=False)  # made canary by hand while the loop ran
        if state.canary is not None and not state.canary_deployed:
            self._deploy_canary(state.canary)
            actions.append(f"canary v{state.canary} (made canary by hand, or adopted after a stop before it got its "
                           "traffic share) deployed; judged from the next window")
        live, served = self.registry.live(), self.champion_serves
        if live.version != served:
            self._publish_champion(live)
            how = (f"restored by a rollback of v{served}" if served is not None and live.version < served
                   else "set by hand, or promoted by a loop stopped before it published")
            actions.append(f"live v{live.version} ({how}) published to the champion arm")
        for action in actions:
            self.console.print(f"registry: {action}")
        if actions:
            self._save()
        return actions

    def _judge_canary(self, window_end: float) -> dict[str, Any]:
        state, cfg = self.state, self.config
        version = state.canary
        if state.canary_since is not None and state.canary_since >= window_end:  # deployed after this window
            reason = "deployed after this cycle's window: judged from the next"
            self.console.print(f"canary v{version}: {reason}")
            return {"version": version, "decision": "continue", "reason": reason}
        canary, live = self.registry.get(version), self.registry.live()
        if canary.parent is not None and canary.parent != live.version:
            # The live version changed under it (rolled back by hand): its A/B's champion side mixes two versions,
            # and a promote would undo the operator's rollback.
            verdict, evidence = "rollback", {}
            reason = f"its parent v{canary.parent} is no longer live (v{live.version} is)"
            return self._conclude_canary(version, verdict, reason, evidence, source="lineage")
        as_of = self.store.event_horizon()  # every event stamped before it is read below
        traffic = read_traffic(self.store, since=state.canary_since, until=window_end)
        events = [e for evs in traffic.events.values() for e in evs]
        ab = analyze(ab_records(traffic.completions, events, cfg.rewards.persist_window_s, cfg.rewards.horizon_s,
                                as_of=as_of), cfg.ab)
        champion = [c for c in traffic.completions if c.arm == "champion"]
        candidate = [c for c in traffic.completions if c.arm == "candidate"]
        by_arm = {arm: traffic_interactions(Traffic(cs, traffic.events, traffic.session_ends))
                  for arm, cs in (("champion", champion), ("candidate", candidate))}
        monitors = compare(by_arm["champion"], by_arm["candidate"], cfg.monitors)
        state.canary_cycles += 1
        evidence = {"ab": ab.to_dict(), "monitors": monitors.to_dict()}
        verdict = ab.decision
        if monitors.blocking:
            verdict = "rollback"
            reason = "hacking monitors on the canary's traffic: " + "; ".join(r.reason for r in monitors.alarms)
        elif verdict == "continue" and state.canary_cycles >= cfg.max_canary_cycles:
            verdict, reason = "rollback", f"no decision after {state.canary_cycles} cycles: " + "; ".join(ab.reasons)
        else:
            reason = "; ".join(ab.reasons)
        self.console.print(ab.table())
        return self._conclude_canary(version, verdict, reason, evidence)

    def _conclude_canary(self, version: int, verdict: str, reason: str, evidence: dict[str, Any],
                         source: str = "A/B") -> dict[str, Any]:
        state = self.state
        # The registry first, and only if the version is still the canary: a loop stopped before the weights
        # and the traffic share follow does that on restart (_follow_registry), and an operator who promoted or
        # rolled it back while the A/B was computed has the last word (their decision is followed instead).
        try:
            if verdict == "promote":
                new = self.registry.promote(version, reason=f"{source}: {reason}", evidence=evidence, expect="canary")
                if self.champion_serves != version:
                    self._publish_champion(new)  # a lossless delta to the champion arm
                self._await_arm("champion", version)  # the canary's users move over only once it serves them there
                self.gateway.set_candidate_fraction(0.0)
            elif verdict == "rollback":
                self.registry.rollback(version, reason=f"{source}: {reason}", evidence=evidence, expect="canary")
                self.gateway.set_candidate_fraction(0.0)
        except StateChanged as e:
            verdict, reason = "overruled", f"{source} said {verdict} ({reason}), but {e}"
            self._follow_registry()
        if verdict in ("promote", "rollback"):
            state.end_canary()
        self._save()
        self.console.print(f"canary v{version}: [bold]{verdict}[/bold] ({reason})")
        return {"version": version, "decision": verdict, "reason": reason, **evidence}

    def _train(self, report: dict[str, Any], window_end: float) -> PolicyVersion | None:
        cfg, state = self.config, self.state
        live = self.registry.live()
        allowed = [v.version for v in self.registry.lineage(live.version)][: cfg.max_staleness + 1]
        # What the live version's lineage has not trained on: a candidate rolled back leaves the data it saw to
        # the next candidate of the same parent, which then trains on two windows of on-policy traffic.
        after = state.trained_through.get(live.version, 0)
        settled = self.ledger.settled(after_seq=after, model_versions=allowed)
        records = {s.completion_id: self.store.get_completion(s.completion_id) for s in settled}
        on_policy = on_policy_rewards(settled, records, allowed)
        passed_over = max(0, len(on_policy) - cfg.max_trajectories) if cfg.max_trajectories else 0
        report["train"] = {"settled": len(settled), "on_policy": len(on_policy), "allowed_versions": allowed,
                           "after_seq": after, "passed_over": passed_over}
        on_policy = on_policy[passed_over:]  # settled in order: the newest are the last
        if len(on_policy) < cfg.min_trajectories:
            skipped = f"{len(on_policy)} on-policy trajectories < min_trajectories {cfg.min_trajectories}"
            report["train"]["skipped"] = skipped
            # The cursor passes what can never train the live version's candidates (rewards before its first
            # on-policy one): the next cycle re-reads only the on-policy rewards that wait, and what came since.
            first = on_policy[0].settle_seq if on_policy else None
            through = max((s.settle_seq for s in settled if first is None or s.settle_seq < first), default=after)
            if through > after:
                state.trained_through[live.version] = report["train"]["cursor"] = through
                self._save()
            self.console.print(f"no candidate this cycle: {skipped} (they wait for the next)")
            return None
        rewarded = [(records[s.completion_id], s.choice_index, s.reward) for s in on_policy]
        episodes = traffic_episodes(rewarded, group_id=f"cycle-{state.cycle}")
        version = max(v.version for v in self.registry.list()) + 1
        ckpt = load_checkpoint(live.checkpoint, dtype=torch.float32)
        # KL to the live model, a copy of the weights just loaded: each candidate stays near its parent
        reference = copy.deepcopy(ckpt.model) if cfg.rl.kl_coef > 0 else None
        trainer = RLTrainer(ckpt.model, ckpt.tokenizer, cfg.rl, self.run_dir / "train", version=live.version,
                            reference=reference, schedule_start=live.version)  # fresh optimizer, fresh warmup
        steps = cfg.train_steps
        if cfg.batch_trajectories is not None:
            steps = max(1, min(steps, len(episodes) // cfg.batch_trajectories))
        history = [trainer.step(chunk) for i in range(steps) if (chunk := episodes[i::steps])]
        out = self.run_dir / "candidates" / f"v-{version:06d}"
        out.parent.mkdir(exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
        save_checkpoint(staging, trainer.model, trainer.tokenizer)
        publish_directory(staging, out)  # whole and durable before the registry names it
        rewards = [s.reward for s in on_policy]
        metrics = {"train/trajectories": len(episodes), "train/reward_mean": sum(rewards) / len(rewards),
                   "train/steps": len(history),
                   **{k: v for k, v in history[-1].items() if k.startswith(("train/loss", "train/mismatch",
                                                                           "train/kl", "train/entropy"))}}
        report["train"].update(metrics)
        state.trained_through[version] = settled[-1].settle_seq
        self._save()
        window = DataWindow(min(s.created_at for s in on_policy), window_end, len(on_policy))
        candidate = self.registry.register(out, parent=live.version, window=window, reward_version=cfg.rewards.version,
                                           reward_digest=cfg.rewards.digest(), metrics=metrics, version=version)
        self.console.print(f"trained candidate v{version} from v{live.version} on {len(episodes)} trajectories "
                           f"(mean reward {metrics['train/reward_mean']:+.3f})")
        return candidate

    def evaluate(self, version: PolicyVersion) -> tuple[list[EpisodeOutcome], list[EpisodeOutcome]]:
        """The version's gate and canary outcomes (cached: a champion is evaluated once)."""
        cfg = self.config
        key = eval_key(self.gate_tasks, self.canary_tasks, cfg.agent, cfg.gate.seed)

        def run(tasks: list) -> list[EpisodeOutcome]:
            return evaluate_checkpoint(version.checkpoint, tasks, seed=cfg.gate.seed, agent_config=cfg.agent,
                                       threads=cfg.gate.threads, concurrency=cfg.gate.concurrency) if tasks else []

        return cached_outcomes(self.run_dir / "evals" / f"v-{version.version:06d}-{key}.json",
                               lambda: (run(self.gate_tasks), run(self.canary_tasks)))

    def progress(self) -> dict[str, Any]:
        """The live version against the first one (the base) on the gate suite: the same tasks with the same
        seeds, so their outcomes pair up task by task. The difference of pass@1 with its Tango interval and
        one-sided p (superiority: margin 0) and McNemar's exact p (evaluations are cached: usually free)."""
        base, live = min(self.registry.list(), key=lambda v: v.version), self.registry.live()
        base_gate, _ = self.evaluate(base)
        live_gate, _ = self.evaluate(live)
        evidence = decide(base_gate, live_gate, [], [], self.config.gate.model_copy(update={"margin": 0.0})).evidence
        keep = ("tasks", "champion_pass_at_1", "candidate_pass_at_1", "difference", "ci", "ci_level", "p_value",
                "mcnemar_exact_p", "candidate_only", "champion_only")
        return {"base": base.version, "live": live.version} | {k: evidence[k] for k in keep}

    def _gate_and_deploy(self, candidate: PolicyVersion) -> dict[str, Any]:
        cfg = self.config
        champion = self.registry.live()
        if candidate.parent is not None and candidate.parent != champion.version:
            # The live version changed under it (an operator's rollback while it trained): promoting it would
            # undo that rollback through the back door.
            return self._reject_stale_lineage(candidate, champion)
        champ_gate, champ_canary = self.evaluate(champion)
        cand_gate, cand_canary = self.evaluate(candidate)
        difficulty = {t.task_id: str(t.metadata.get("difficulty")) for t in self.gate_tasks}
        monitors = compare([interaction(o, difficulty.get(o.task_id)) for o in champ_gate],
                           [interaction(o, difficulty.get(o.task_id)) for o in cand_gate], cfg.monitors)
        decision = decide(champ_gate, cand_gate, [dodged(o) for o in champ_canary], [dodged(o) for o in cand_canary],
                          cfg.gate, alarms=[f"{r.metric}: {r.reason}" for r in monitors.alarms])
        evidence = decision.to_dict() | {"monitors": monitors.to_dict()}
        self.registry.set_metrics(candidate.version, {
            "gate/pass_at_1": sum(o.passed for o in cand_gate) / max(1, len(cand_gate)),
            "gate/champion_pass_at_1": sum(o.passed for o in champ_gate) / max(1, len(champ_gate)),
            "gate/canary_dodged": sum(map(dodged, cand_canary))})
        verdict, reasons = "canary" if decision.promote else "rejected", list(decision.reasons)
        try:
            self.registry.transition(candidate.version, "canary" if decision.promote else "rolled_back",
                                     reason="gate: " + "; ".join(reasons), evidence=evidence, expect="candidate")
        except StateChanged as e:  # an operator moved it while it was evaluated: theirs is the last word
            verdict, reasons = "overruled", [f"the gate said {verdict}, but {e}", *reasons]
            self._follow_registry()
        else:
            if decision.promote:
                self._deploy_canary(candidate.version)
                self._save()
        self.console.print(f"gate v{candidate.version} vs v{champion.version}: [bold]{verdict}[/bold] "
                           f"({'; '.join(reasons)})")
        return {"version": candidate.version, "champion": champion.version, "decision": verdict, **evidence,
                "reasons": reasons}

    def _reject_stale_lineage(self, candidate: PolicyVersion, champion: PolicyVersion) -> dict[str, Any]:
        reason = (f"trained from v{candidate.parent}, which is no longer live (v{champion.version} is): not gated "
                  "against another lineage")
        verdict, reasons = "rejected", [reason]
        try:
            self.registry.transition(candidate.version, "rolled_back", reason="gate: " + reason, expect="candidate")
        except StateChanged as e:
            verdict, reasons = "overruled", [f"the gate said rejected, but {e}", reason]
            self._follow_registry()
        self.console.print(f"gate v{candidate.version} vs v{champion.version}: [bold]{verdict}[/bold] ({reason})")
        return {"version": candidate.version, "champion": champion.version, "decision": verdict, "reasons": reasons}

    def _deploy_canary(self, version: int) -> None:
        """Publish the canary's weights to the candidate arm (unless they are its store's last), wait until the
        arm serves them, then give it its share of the users; its window starts now."""
        last = self.candidate_weights.last
        if last is None or last.version != version:
            self.candidate_weights.publish(_weights(self.registry.get(version).checkpoint), version)
        self._await_arm("candidate", version)
        # A fresh salt per canary: each one gets its own random half of the users, not the last one's.
        self.gateway.set_candidate_fraction(self.config.ab.candidate_fraction, salt=f"canary-v{version}")
        self.state.start_canary(version, deployed=True)

    def _await_arm(self, arm: str, version: int, timeout_s: float | None = None) -> None:
        """Wait until the gateway's `arm` serves `version` (published to its store) before users are sent to it."""
        timeout_s = timeout_s or self.config.candidate_load_timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.gateway.traffic()["arms"][arm]["version"] == version:
                return
            time.sleep(0.2)
        store = self.candidate_store(self.run_dir) if arm == "candidate" else self.champion_store(self.run_dir)
        raise TimeoutError(f"the gateway's {arm} arm did not load v{version} within {timeout_s:g} s; is it "
                           f"following {store}?")

    def close(self) -> None:
        self._opened.close()
