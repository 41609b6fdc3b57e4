"""What each candidate of the real-time loop trains on: the settled traffic its parent's lineage has not
trained on. A rolled-back candidate's data goes to the next candidate of the same parent (with the traffic
that came since); a promoted one's is never trained again; and a state.json written before this was kept
per version still bounds the live version's candidates. With batch_trajectories, more traffic buys more
optimizer steps."""

from __future__ import annotations

import json
import time

from realtime_rl.collect import FeedbackEvent, open_event_store
from realtime_rl.config import LoopConfig, RewardRules, RLConfig
from realtime_rl.deploy import PolicyVersion
from realtime_rl.loop import RealtimeLoop
from realtime_rl.model import Qwen3ForCausalLM, save_checkpoint
from tests.conftest import tiny_config
from tests.unit.test_rewards_ledger import record

RULES = RewardRules(version="test-v1", persist_window_s=1.0, followup_window_s=0.0, horizon_s=10.0)


def serve(store, prefix: str, n: int, version: int, at: float) -> None:
    """n kept edits served by `version` a persist window before `at` (the ledger settles them once their
    windows closed; the store's clock must show the window passed before an edit_persisted decides)."""
    for i in range(n):
        cid = f"{prefix}-{i}"
        store.add_completion(record(cid, "edit", at - RULES.persist_window_s, model_version=version))
        store.add_events([FeedbackEvent(event_id=f"{cid}-a", type="edit_accepted", completion_id=cid),
                          FeedbackEvent(event_id=f"{cid}-p", type="edit_persisted", completion_id=cid, window_s=1.0)])


def settle_and_train(loop: RealtimeLoop, now: float) -> tuple[PolicyVersion | None, dict]:
    """What a cycle does after its window: settle the rewards, then train a candidate (or not)."""
    loop.ledger.update(loop.store, RULES, now)
    report: dict = {}
    return loop._train(report, now), report["train"]


def train(loop: RealtimeLoop, now: float) -> tuple[int, dict]:
    candidate, report = settle_and_train(loop, now)
    assert candidate is not None, report
    return candidate.version, report


def test_a_rolled_back_candidates_data_trains_its_sibling_and_a_promoted_ones_never_again(tmp_path, tokenizer):
    model = Qwen3ForCausalLM(tiny_config(vocab_size=tokenizer.vocab_size))
    model.reset_parameters(seed=0)
    base = save_checkpoint(tmp_path / "base", model, tokenizer)
    config = LoopConfig(run_dir=tmp_path / "loop", base_checkpoint=base, store_dir=tmp_path / "serve",
                        rewards=RULES, rl=RLConfig(lr=1e-3), train_steps=2, batch_trajectories=4, min_trajectories=4,
                        max_staleness=1, gate_tasks=4, canary_tasks=0)
    t0 = time.time()
    with open_event_store(tmp_path / "serve", "sqlite") as store:
        loop = RealtimeLoop(config, store=store)
        try:
            serve(store, "w1", 3, version=0, at=t0)
            candidate, report = settle_and_train(loop, t0 + 50)  # too little traffic: it waits for the next cycle
            assert candidate is None and report["skipped"] == "3 on-policy trajectories < min_trajectories 4"
            serve(store, "w1b", 3, version=0, at=t0)
            v1, first = train(loop, t0 + 100)
            assert (first["on_policy"], first["after_seq"]) == (6, 0)
            assert first["train/steps"] == 1  # one batch of 4 or more
            loop.registry.rollback(v1, reason="test: the gate rejected it")

            serve(store, "w2", 4, version=0, at=t0 + 1)
            v2, second = train(loop, t0 + 200)  # v0's both windows: what v1 saw and what came since
            assert loop.registry.get(v2).parent == 0 and second["on_policy"] == 10 and second["after_seq"] == 0
            assert second["train/steps"] == 2  # more traffic, more steps: at most train_steps
            loop.registry.transition(v2, "canary", reason="test: gate passed")
            loop.registry.promote(v2, reason="test: A/B won")

            serve(store, "w3", 5, version=2, at=t0 + 2)
            serve(store, "w3-old", 3, version=0, at=t0 + 2)  # the champion arm's last replies: within the bound
            serve(store, "w3-gone", 2, version=1, at=t0 + 2)  # the rolled-back canary's: never
            v3, third = train(loop, t0 + 300)
            assert loop.registry.get(v3).parent == 2 and third["allowed_versions"] == [2, 0]
            assert third["on_policy"] == 8 and third["after_seq"] == loop.state.trained_through[v2] > 0
            through = loop.state.trained_through
            assert (through[v1], through[v2]) == (6, 10) and v3 in through
        finally:
            loop.close()

        # A state.json from before the per-version record: its one seq bounds the live version's candidates.
        state = tmp_path / "loop" / "state.json"
        saved = json.loads(state.read_text())
        state.write_text(json.dumps(saved | {"trained_through": 17}))
        loop = RealtimeLoop(config, store=store)
        try:
            assert loop.state.trained_through == {v2: 17}
        finally:
            loop.close()


def test_below_min_trajectories_the_cursor_passes_what_can_never_train(tmp_path, tokenizer):
    """A cycle short of min_trajectories trains nothing, and its on-policy rewards wait for the next; the
    rewards before the first of them can never train the live version's candidates (here: replies in flight
    across a rollback, holding a token of a version outside the lineage), so the cursor passes them and no
    later cycle reads them again."""
    model = Qwen3ForCausalLM(tiny_config(vocab_size=tokenizer.vocab_size))
    model.reset_parameters(seed=0)
    base = save_checkpoint(tmp_path / "base", model, tokenizer)
    config = LoopConfig(run_dir=tmp_path / "loop", base_checkpoint=base, store_dir=tmp_path / "serve",
                        rewards=RULES, rl=RLConfig(lr=1e-3), train_steps=1, min_trajectories=3, max_staleness=0,
                        gate_tasks=4, canary_tasks=0)
    t0 = time.time()
    with open_event_store(tmp_path / "serve", "sqlite") as store:
        with RealtimeLoop(config, store=store) as loop:
            for i in range(4):  # recorded under v0, with a token a rolled-back v9 sampled
                completion = record(f"mixed-{i}", "edit", t0 - RULES.persist_window_s, model_version=0)
                completion.choices[0].versions[-1] = 9
                store.add_completion(completion)
                store.add_events([
                    FeedbackEvent(event_id=f"mixed-{i}-a", type="edit_accepted", completion_id=f"mixed-{i}"),
                    FeedbackEvent(event_id=f"mixed-{i}-p", type="edit_persisted", completion_id=f"mixed-{i}",
                                  window_s=1.0)])
            candidate, first = settle_and_train(loop, t0 + 50)
            assert candidate is None and (first["settled"], first["on_policy"], first["cursor"]) == (4, 0, 4)
            assert loop.state.trained_through[0] == 4

            serve(store, "w1", 2, version=0, at=t0 + 1)  # on-policy, too few: they wait (the cursor stays)
            candidate, second = settle_and_train(loop, t0 + 100)
            assert candidate is None and (second["after_seq"], second["on_policy"]) == (4, 2)
            assert "cursor" not in second and loop.state.trained_through[0] == 4

            serve(store, "w2", 1, version=0, at=t0 + 2)
            candidate, third = settle_and_train(loop, t0 + 150)
            assert candidate is not None and (third["after_seq"], third["settled"], third["on_policy"]) == (4, 3, 3)
        # the cursor is in state.json: a restarted loop does not read the passed rewards again either
        assert json.loads((tmp_path / "loop" / "state.json").read_text())["trained_through"]["0"] == 4
