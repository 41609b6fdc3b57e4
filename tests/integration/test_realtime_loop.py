"""The real-time loop end to end on a real gateway (uvicorn, SQLite store, champion and candidate weight
stores) with users on the official `openai` client who post feedback through the API.

Cycle 1 trains a candidate from the settled traffic of version 0, the gate (same held-out tasks, same
seeds) passes it, and it goes out as a canary: the gateway's candidate arm hot-swaps to it and gets
users. The users of this test keep the first canary's edits and revert everyone else's, so cycle 2's
A/B promotes it: the champion arm now serves it, the registry says live. Cycle 2 also trains and canaries
the next candidate, whose edits the users revert, and cycle 3's A/B rolls it back. An operator's hand-made
registry changes are then followed. Every decision is in the registry with its evidence, in cycles.jsonl
and in report.html.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from realtime_rl.config import ABConfig, ApiKey, GateConfig, LoopConfig, RewardRules, RLConfig, ServeConfig
from realtime_rl.deploy import Registry
from realtime_rl.evaluate import analyze, decide
from realtime_rl.loop import RealtimeLoop, cycle
from realtime_rl.loop.report import write_report
from realtime_rl.model import Qwen3ForCausalLM, save_checkpoint
from realtime_rl.serve import serve_in_thread
from tests.conftest import tiny_config

KEYS = [ApiKey(name="users", key="k-users-0123456789abc", scopes=["inference", "feedback"]),
        ApiKey(name="loop", key="k-loop-admin-0123456789", scopes=["admin"])]
USERS = [f"dev-{i}" for i in range(24)]


def event(kind: str, completion_id: str, **fields: object) -> dict:
    """A feedback event in the wire format (OpenTelemetry GenAI names; docs/feedback.md)."""
    return {"log.record.uid": uuid.uuid4().hex, "event.name": kind, "gen_ai.response.id": completion_id, **fields}


class Users:
    """Users who ask, then keep or revert the answer (the test's stand-in for taste): they keep the candidate
    arm's edits until `liked_version` is set, then the edits of that version only, whichever arm serves it
    (so no switch of taste races a cycle's end). A kept edit's edit_persisted goes out once its window has
    passed (the rules measure it on the store's clock); meanwhile they go on asking."""

    WINDOW_S = 1.0

    def __init__(self, url: str) -> None:
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS[0].key, timeout=30, max_retries=2)
        self.feedback = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEYS[0].key}"}, timeout=30)
        self.liked_version: int | None = None
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        kept: collections.deque[tuple[float, dict]] = collections.deque()  # (when it is due, edit_persisted)
        for user in itertools.cycle(USERS):
            if self.stop.is_set():
                return
            try:
                raw = self.client.chat.completions.with_raw_response.create(
                    model="rtrl-policy", messages=[{"role": "user", "content": "Write a function that sorts."}],
                    max_tokens=4, user=user, metadata={"task_id": "sort", "difficulty": "1"})
                arm, completion = raw.headers["x-rtrl-arm"], raw.parse()
                liked = (arm == "candidate" if self.liked_version is None
                         else completion.system_fingerprint == f"rtrl-v{self.liked_version}")
                events = [event("edit_accepted", completion.id)]
                if liked:
                    kept.append((time.monotonic() + self.WINDOW_S,
                                 event("edit_persisted", completion.id, window_s=self.WINDOW_S)))
                else:
                    events.append(event("edit_reverted", completion.id))
                while kept and kept[0][0] <= time.monotonic():
                    events.append(kept.popleft()[1])
                r = self.feedback.post("/v1/feedback", json={"events": events})
                assert r.status_code == 200, r.text
            except Exception as e:  # noqa: BLE001 (reported by the test, never swallowed)
                self.errors.append(repr(e))
                return


def _base_and_gateway(tmp_path: Path, tokenizer) -> tuple[Path, Path, Path, ServeConfig]:
    """A tiny base checkpoint, and a gateway serving it whose arms follow the loop's weight stores."""
    model = Qwen3ForCausalLM(tiny_config(moe=True, vocab_size=tokenizer.vocab_size))
    model.reset_parameters(seed=0)
    base = save_checkpoint(tmp_path / "base", model, tokenizer)
    loop_dir, serve_dir = tmp_path / "loop", tmp_path / "serve"
    settings = ServeConfig(checkpoint=base, run_dir=serve_dir, api_keys=KEYS, port=0, max_seq_len=512,
                           weights=str(RealtimeLoop.champion_store(loop_dir)),
                           candidate_weights=str(RealtimeLoop.candidate_store(loop_dir)), weights_poll_s=0.2)
    return base, loop_dir, serve_dir, settings


@pytest.mark.slow
def test_the_loop_trains_gates_canaries_promotes_and_rolls_back(tmp_path, tokenizer):
    base, loop_dir, serve_dir, settings = _base_and_gateway(tmp_path, tokenizer)
    rules = RewardRules(version="test-v1", persist_window_s=1.0, followup_window_s=0.0, horizon_s=30.0)
    with serve_in_thread(settings) as url:
        config = LoopConfig(
            run_dir=loop_dir, base_checkpoint=base, gateway_url=url, admin_key=KEYS[1].key, store_dir=serve_dir,
            cycles=1, cycle_period_s=8.0, rewards=rules, rl=RLConfig(lr=1e-3), train_steps=2, min_trajectories=16,
            max_trajectories=24,
            gate=GateConfig(margin=0.5, concurrency=4), gate_tasks=4, canary_tasks=2,
            agent=LoopConfig().agent.model_copy(update={"max_new_tokens": 24}),
            # A 4-token completion of the tiny model takes ~10 ms, which scheduling moves by more than the
            # default 5%: the decisions here are the users' edits (the latency guardrail: test_ab.py).
            ab=ABConfig(candidate_fraction=0.5, min_completions_per_arm=10, min_edits_per_arm=8,
                        latency_tolerance_s=0.05),
            max_canary_cycles=3)
        users = Users(url)
        users.thread.start()
        loop = RealtimeLoop(config)
        try:
            first = loop.run_cycle()
            assert not users.errors, users.errors
            assert first["train"]["on_policy"] >= 16 and first["gate"]["decision"] == "canary", first
            assert set(first["seconds"]) == {"registry", "settle", "train", "gate"}  # where the time after the window went
            # the champion (v0) played the gate's suite inside the window: the gate evaluated the candidate only
            assert first["seconds_in_window"]["champion_eval"] > 0
            assert len(list((loop_dir / "evals").glob("v-000000-*.json"))) == 1
            train = first["train"]  # the newest 24 train; the rest are passed over for good
            assert train["train/trajectories"] == min(24, train["on_policy"]) == train["on_policy"] - train["passed_over"]
            candidate = first["gate"]["version"]
            users.liked_version = candidate  # they keep this canary's edits now, and after it is promoted
            assert loop.registry.get(candidate).state == "canary" and loop.registry.get(candidate).parent == 0
            assert loop.gateway.traffic()["arms"]["candidate"]["version"] == candidate

            loop.close()  # a restarted loop picks up where the registry and state.json say it was
            with Registry.open(loop_dir) as registry:  # a candidate registered just before a kill, never gated
                orphan = registry.register(base, parent=0)
            loop = RealtimeLoop(config)
            assert loop.state.canary == candidate and loop.state.cycle == 1
            assert loop.registry.get(orphan.version).state == "rolled_back"

            second = loop.run_cycle()  # users kept the canary's edits, reverted the champion's
            assert second["canary"]["decision"] == "promote", second["canary"]["reason"]
            assert set(second["seconds"]) == {"registry", "settle", "judge", "train", "gate"}
            assert loop.registry.live().version == candidate
            assert loop.gateway.traffic()["arms"]["champion"]["version"] == candidate  # delta reached the gateway

            assert second["gate"]["decision"] == "canary" and second["gate"]["champion"] == candidate
            # the users revert the next canary's edits: they like the version now live
            third = loop.run_cycle()
            assert third["canary"]["decision"] == "rollback", third["canary"]["reason"]
            rolled = third["canary"]["version"]
            assert loop.registry.get(rolled).state == "rolled_back"
            assert loop.registry.live().version == candidate  # the rollback of a canary leaves the champion live
            assert [t.to_state for t in loop.registry.history(rolled)] == ["candidate", "canary", "rolled_back"]
            assert third["gate"]["champion"] == candidate  # and the next candidate is trained from it again
            assert [t.to_state for t in loop.registry.history(candidate)] == ["candidate", "canary", "live"]
            assert loop.registry.history(candidate)[-1].evidence["ab"]["decision"] == "promote"

            # An operator acts between cycles with `rtrl registry`: the loop follows before deciding anything.
            if third["gate"]["decision"] == "canary":
                with Registry.open(loop_dir) as registry:
                    registry.rollback(third["gate"]["version"], reason="operator: by hand")
                assert loop._follow_registry() == [
                    f"canary v{third['gate']['version']} is rolled_back by hand: its traffic share is now 0"]
                assert loop.state.canary is None and loop.gateway.traffic()["candidate_fraction"] == 0.0
            with Registry.open(loop_dir) as registry:  # the live version rolled back by hand: v0 is live again
                registry.rollback(candidate, reason="operator: by hand")
            assert loop._follow_registry() == [
                f"live v0 (restored by a rollback of v{candidate}) published to the champion arm"]
            assert loop.champion_serves == 0 and loop.champion_weights.last.version > candidate
            deadline = time.monotonic() + 30  # the gateway's champion arm swaps v0's weights back in
            while loop.gateway.traffic()["arms"]["champion"]["version"] != 0:
                assert time.monotonic() < deadline, loop.gateway.traffic()
                time.sleep(0.2)
            assert loop._follow_registry() == []
        finally:
            users.stop.set()
            users.thread.join(30)
            loop.close()
    assert not users.errors, users.errors
    report = write_report(loop_dir).read_text()
    assert "<svg" in report and "Canary" in report and "promote" in report and "rollback" in report


@pytest.mark.slow
def test_a_canary_adopted_after_a_stop_before_its_traffic_share_is_deployed_again(tmp_path, tokenizer, monkeypatch):
    """The loop stopped after the registry made v1 the canary, before its weights reached the gateway and its
    share of users was raised: the restarted loop deploys it instead of judging it on no traffic."""
    base, loop_dir, serve_dir, settings = _base_and_gateway(tmp_path, tokenizer)
    model = Qwen3ForCausalLM(tiny_config(moe=True, vocab_size=tokenizer.vocab_size))
    model.reset_parameters(seed=1)
    other = save_checkpoint(tmp_path / "other", model, tokenizer)
    with serve_in_thread(settings) as url:
        config = LoopConfig(run_dir=loop_dir, base_checkpoint=base, gateway_url=url, admin_key=KEYS[1].key,
                            store_dir=serve_dir, gate_tasks=4, canary_tasks=0, ab=ABConfig(candidate_fraction=0.25),
                            agent=LoopConfig().agent.model_copy(update={"max_new_tokens": 24}))
        RealtimeLoop(config).close()  # bootstraps v0 and publishes it to the champion arm
        with RealtimeLoop(config), pytest.raises(ValueError, match="in use by another `rtrl loop`"):
            RealtimeLoop(config)  # one loop per run directory
        with Registry.open(loop_dir) as registry:  # then a cycle's gate got as far as the registry
            registry.register(other, parent=0)
            registry.transition(1, "canary", reason="gate: test")
        RealtimeLoop(config).close()  # adopts v1, to deploy; then stops again before a cycle does it
        loop = RealtimeLoop(config)
        try:
            assert loop.state.canary == 1 and not loop.state.canary_deployed
            assert loop.gateway.traffic()["candidate_fraction"] == 0.0
            window_end = time.time()  # the cycle's window ended before the canary got users
            actions = loop._follow_registry()
            assert any("canary v1" in a and "deployed" in a for a in actions), actions
            assert loop._judge_canary(window_end)["decision"] == "continue" and loop.state.canary_cycles == 0
            traffic = loop.gateway.traffic()
            assert traffic["candidate_fraction"] == 0.25 and traffic["salt"] == "canary-v1"
            assert traffic["arms"]["candidate"]["version"] == 1
            assert loop._follow_registry() == []  # once
        finally:
            loop.close()
        # Rolled back by hand while the loop is down: the restarted loop forgot the canary and left a quarter
        # of the users on it. It now sets the share to 0 before anything else.
        with Registry.open(loop_dir) as registry:
            registry.rollback(1, reason="operator: by hand")
        with RealtimeLoop(config) as loop:
            assert loop._follow_registry() == ["canary v1 is rolled_back by hand: its traffic share is now 0"]
            assert loop.state.canary is None and loop.gateway.traffic()["candidate_fraction"] == 0.0

            # An operator promotes the next canary by hand while the loop computes its A/B, which says roll
            # back: the operator's decision stands. (The loop used to roll back the version that had become
            # live, restoring v0, and a promote verdict raised.)
            with Registry.open(loop_dir) as registry:
                registry.register(other, parent=0)
                registry.transition(2, "canary", reason="operator: by hand")
            assert "canary v2 (made canary by hand" in loop._follow_registry()[0]  # deployed while the loop ran

            def operator_promotes_meanwhile(records, ab_config):
                with Registry.open(loop_dir) as registry:
                    registry.promote(2, reason="operator: by hand")
                return dataclasses.replace(analyze(records, ab_config), decision="rollback")

            monkeypatch.setattr(cycle, "analyze", operator_promotes_meanwhile)
            verdict = loop._judge_canary(time.time())
            assert verdict["decision"] == "overruled" and "is live, no longer canary" in verdict["reason"]
            assert loop.registry.live().version == 2 and loop.champion_serves == 2 and loop.state.canary is None
            assert [t.to_state for t in loop.registry.history(2)] == ["candidate", "canary", "live"]
            traffic = loop.gateway.traffic()
            assert traffic["arms"]["champion"]["version"] == 2 and traffic["candidate_fraction"] == 0.0

            # The same while the gate decides on a fresh candidate: the operator rolled it back meanwhile.
            candidate = loop.registry.register(other, parent=2)

            def operator_rolls_back_meanwhile(*args, **kwargs):
                with Registry.open(loop_dir) as registry:
                    registry.rollback(candidate.version, reason="operator: by hand")
                return decide(*args, **kwargs)

            monkeypatch.setattr(cycle, "decide", operator_rolls_back_meanwhile)
            gate = loop._gate_and_deploy(candidate)
            assert gate["decision"] == "overruled" and "is rolled_back, no longer candidate" in gate["reasons"][0]

            # A candidate trained from a version that is no longer live (rolled back by hand while it trained)
            # is not gated against the restored one: it would undo the operator's rollback if it won.
            orphan = loop.registry.register(other, parent=1)
            gate = loop._gate_and_deploy(orphan)
            assert gate["decision"] == "rejected" and "trained from v1, which is no longer live" in gate["reasons"][0]
            assert loop.registry.get(orphan.version).state == "rolled_back" and loop.state.canary is None
            assert [t.to_state for t in loop.registry.history(candidate.version)] == ["candidate", "rolled_back"]
            assert loop.state.canary is None and loop.gateway.traffic()["candidate_fraction"] == 0.0

            # A canary rolled back by hand while a window collects leaves the gateway within REGISTRY_POLL_S, not
            # at the window's end (hours later in production).
            canary = loop.registry.register(other, parent=2)
            loop.registry.transition(canary.version, "canary", reason="operator: by hand")
            loop._follow_registry()
            assert loop.gateway.traffic()["candidate_fraction"] == 0.25
            monkeypatch.setattr(cycle, "REGISTRY_POLL_S", 0.2)
            loop.state.window_start = time.time()  # the window is the config's whole cycle_period_s from now
            stop, reports = threading.Event(), []
            waiting = threading.Thread(target=lambda: reports.append(loop.run_cycle(stop)))
            waiting.start()
            try:
                with Registry.open(loop_dir) as registry:
                    registry.rollback(canary.version, reason="operator: by hand")
                deadline = time.monotonic() + 20
                while loop.gateway.traffic()["candidate_fraction"] != 0.0 and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert loop.gateway.traffic()["candidate_fraction"] == 0.0 and waiting.is_alive()  # mid-window
            finally:
                stop.set()
                waiting.join(30)
            assert reports[0]["stopped"] and any(f"canary v{canary.version} is rolled_back" in a
                                                 for a in reports[0]["registry"])

            # A canary whose parent stops being live (its lineage rolled back by hand) is rolled back, not judged:
            # its A/B's champion side mixed two versions, and a promote would undo the operator's rollback.
            stray = loop.registry.register(other, parent=1)
            loop.registry.transition(stray.version, "canary", reason="operator: by hand")
            loop._follow_registry()
            assert loop.state.canary == stray.version and loop.gateway.traffic()["candidate_fraction"] == 0.25
            verdict = loop._judge_canary(time.time())
            assert verdict["decision"] == "rollback" and "parent v1 is no longer live (v2 is)" in verdict["reason"]
            assert loop.registry.get(stray.version).state == "rolled_back" and loop.state.canary is None
            assert loop.gateway.traffic()["candidate_fraction"] == 0.0
