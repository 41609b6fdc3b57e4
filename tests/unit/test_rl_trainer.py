"""The RL trainer on engine-sampled episodes: it learns, replays routing, trains segments, resumes exactly."""

from __future__ import annotations

import copy
import dataclasses
import math
import random

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from realtime_rl.config import RLConfig
from realtime_rl.engine import Engine, SamplingParams
from realtime_rl.model import Qwen3ForCausalLM
from realtime_rl.rollout import StalenessBuffer, TrajectoryLog
from realtime_rl.train import RLTrainer, episode_reward
from realtime_rl.train.packing import pack_micro_batches
from realtime_rl.train.rl import (
    CALL_OVERHEAD_TOKENS,
    CONSUMED_VERSIONS,
    MICRO_BATCH_TOKENS,
    SHARED_RUN_MIN_TOKENS,
    STATE_FILE,
    latest_checkpoint,
)
from realtime_rl.types import Episode, Segment, episode_from_bytes, episode_to_bytes
from tests.conftest import tiny_config

GOOD = 128  # reward: the first generated token is one of the 128 lowest ids (a quarter of the vocabulary)
PROMPTS = [[5, 17, 42], [9, 3, 77], [250, 11], [30, 31, 32, 33]]


def _episodes(engine: Engine, step: int, group_size: int = 8, max_tokens: int = 4, temperature: float = 1.0
              ) -> list[Episode]:
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, n=group_size, seed=1000 * step,
                            ignore_eos=True)
    out = []
    for p, req in enumerate(engine.generate(PROMPTS, params)):
        for s in req.samples:
            n = len(req.prompt_ids)
            seg = Segment(
                token_ids=np.array(req.prompt_ids + s.token_ids, dtype=np.int32),
                loss_mask=np.array([False] * n + [True] * len(s.token_ids)),
                logprobs=np.array([0.0] * n + s.logprobs, dtype=np.float32),
                versions=np.array([-1] * n + s.versions, dtype=np.int32),
                routing=None if s.routing is None else np.concatenate([s.routing, np.zeros_like(s.routing[:1])]),
                temperature=temperature,
            )
            out.append(Episode(f"s{step}-p{p}-{s.index}", f"prompt-{p}", [seg], "answer", 1, 0, 0, 0,
                               group_id=f"s{step}-p{p}", passed=s.token_ids[0] < GOOD))
    return out


def _good_mass(model: Qwen3ForCausalLM) -> float:
    device = next(model.parameters()).device
    with torch.no_grad():
        probs = [torch.softmax(model(torch.tensor([p], device=device)).logits_BTV[0, -1].float(), -1)[:GOOD].sum()
                 for p in PROMPTS]
    return float(torch.stack(probs).mean())


def _model(seed: int = 0) -> Qwen3ForCausalLM:
    model = Qwen3ForCausalLM(tiny_config(moe=True))
    model.reset_parameters(seed=seed)
    return model


def _logprobs_and_grads(trainer: RLTrainer, batches: list) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The trained targets' logprobs over `batches` and the gradient of their advantage-weighted sum."""
    trainer.model.zero_grad()
    lps = []
    for batch in batches:
        lp, _ = trainer._logprobs(batch)
        (lp * batch.advantages).sum().backward()
        lps.append(lp.detach())
    return torch.cat(lps), [p.grad.clone() for p in trainer.model.parameters()]


def test_reward_goes_up_with_router_replay_and_matching_logprobs(tmp_path):
    model = _model()
    trainer = RLTrainer(model, None, RLConfig(lr=1e-2, group_size=8, groups_per_step=4), tmp_path)
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    engine.update_weights(trainer.weights(), 0)
    before = _good_mass(model)
    rewards = []
    for step in range(15):
        metrics = trainer.step(_episodes(engine, step))
        engine.update_weights(trainer.weights(), trainer.version)
        rewards.append(metrics["train/reward_mean"])
        if "train/mismatch_k3" in metrics:  # R3: the trainer reproduces the engine's logprobs in fp32
            assert metrics["train/mismatch_k3"] < 1e-6
            assert metrics["train/staleness_max"] == 0
    after = _good_mass(model)
    assert after > before + 0.3, (before, after)
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3])


def test_router_replay_is_what_the_trainer_uses(tmp_path):
    """Forcing a different routing than the engine recorded changes the trainer's logprobs."""
    model = _model()
    trainer = RLTrainer(model, None, RLConfig(), tmp_path)
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    engine.update_weights(trainer.weights(), 0)
    seg = _episodes(engine, 0)[0].segments[0]
    batch = trainer._batch([(seg, 1.0)])
    replayed, _ = trainer._logprobs(batch)
    torch.testing.assert_close(replayed, batch.behaviour, atol=1e-5, rtol=0)
    batch.routing_BTLK = (batch.routing_BTLK + 1) % model.config.num_experts
    shuffled, _ = trainer._logprobs(batch)
    assert (shuffled - replayed).abs().max() > 1e-3


def test_a_shared_prompt_runs_once_with_the_logprobs_and_gradients_of_separate_rows(tmp_path):
    model = _model()
    trainer = RLTrainer(model, None, RLConfig(), tmp_path)
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    engine.update_weights(trainer.weights(), 0)
    prompt = list(range(40, 60))
    [req] = engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=6, n=4, seed=3, ignore_eos=True))
    micro = []
    for s in req.samples:
        k = 3 + s.index  # rows of different lengths: the suffixes are right-padded
        n = len(prompt)
        micro.append((Segment(
            token_ids=np.array(prompt + s.token_ids[:k], dtype=np.int32),
            loss_mask=np.array([False] * n + [True] * k),
            logprobs=np.array([0.0] * n + s.logprobs[:k], dtype=np.float32),
            versions=np.array([-1] * n + s.versions[:k], dtype=np.int32),
            routing=np.concatenate([s.routing[: n + k - 1], np.zeros_like(s.routing[:1])])), 1.0 - 0.5 * s.index))

    shared = trainer._batch(micro)
    assert shared.prefix == len(prompt) - 1  # the prompt but its last token, which predicts a trained one
    separate = [trainer._batch([it]) for it in micro]
    assert all(b.prefix == 0 for b in separate)
    lp_shared, grads_shared = _logprobs_and_grads(trainer, [shared])
    lp_separate, grads_separate = _logprobs_and_grads(trainer, separate)
    torch.testing.assert_close(lp_shared, lp_separate, atol=1e-5, rtol=0)
    torch.testing.assert_close(lp_shared, shared.behaviour, atol=1e-5, rtol=0)  # the engine's, under replay
    for g, h in zip(grads_shared, grads_separate):
        torch.testing.assert_close(g, h, atol=1e-5, rtol=1e-3)  # float summation order only

    micro[2][0].routing[7, 0] = (micro[2][0].routing[7, 0] + 1) % model.config.num_experts
    assert trainer._batch(micro).prefix == 7  # where the recorded routing differs, rows stop sharing
    # ... and packing counts it: a budget that holds the four rows behind the shared prompt does not hold them
    # behind 7 shared positions, so the row that routed differently is packed apart.
    longest = max(len(s.token_ids) for s, _ in micro) - 1
    budget = shared.prefix + len(micro) * (longest - shared.prefix)
    packed = pack_micro_batches(micro, budget, by_version=True)
    assert len(packed) > 1 and all(trainer._batch(b).positions[0] <= budget for b in packed)

    # Rows another version generated routed the prompt its own way: they are packed apart, each batch keeping
    # its whole shared prompt.
    micro[2][0].routing[7, 0] = (micro[2][0].routing[7, 0] - 1) % model.config.num_experts
    micro[1][0].versions[len(prompt):] = 1
    micro[3][0].versions[len(prompt):] = 1
    batches = pack_micro_batches(micro, 8192, by_version=True)
    assert [sorted(int(s.versions[-1]) for s, _ in b) for b in batches] == [[0, 0], [1, 1]]
    assert len(pack_micro_batches(micro, 8192)) == 1


@pytest.mark.parametrize("system_len", [20, 0])
def test_each_group_prompt_runs_once_after_the_shared_system_prompt(tmp_path, system_len):
    """Two groups whose prompts share a first part (or none) with two lone rows: that part runs once for the
    micro-batch, each group's own part once for its rows, the lone rows in one forward, and the logprobs and
    gradients are those of separate rows."""
    model = _model()
    trainer = RLTrainer(model, None, RLConfig(), tmp_path)
    engine = Engine(_model(), max_batch=32, max_seq_len=96)
    engine.update_weights(trainer.weights(), 0)
    system = list(range(40, 40 + system_len))
    prompts = [(system + list(range(100, 120)), 3), (system + list(range(200, 224)), 3),
               (system + list(range(300, 318)), 1), (system + list(range(400, 421)), 1)]
    micro = []
    for g, (prompt, n_samples) in enumerate(prompts):
        [req] = engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=6, n=n_samples, seed=g,
                                                               ignore_eos=True))
        for s in req.samples:
            n, k = len(prompt), 3 + s.index + g % 2
            micro.append((Segment(
                token_ids=np.array(prompt + s.token_ids[:k], dtype=np.int32),
                loss_mask=np.array([False] * n + [True] * k),
                logprobs=np.array([0.0] * n + s.logprobs[:k], dtype=np.float32),
                versions=np.array([-1] * n + s.versions[:k], dtype=np.int32),
                routing=np.concatenate([s.routing[: n + k - 1], np.zeros_like(s.routing[:1])])),
                1.0 - 0.5 * s.index + g))
    random.Random(0).shuffle(micro)
    [packed] = pack_micro_batches(micro, 8192, by_version=True)
    batch = trainer._batch(packed)
    assert batch.prefix == len(system)
    # One forward per group, continuing its prompt but the last token; one for the lone rows, continuing the prefix.
    assert sorted((len(rows), q) for rows, q, _, _ in batch.calls) == sorted([(3, len(system) + 19), (3, len(system) + 23),
                                                                          (2, len(system))])
    # Computed: the system prompt once, each group's rest of its prompt once (19, 23 inputs); then each row from
    # where its forward starts to its forward's longest row (groups: 5 and 6 inputs; lone rows: 21 + 4 - 1).
    assert batch.positions[0] == len(system) + 19 + 23 + 3 * 5 + 3 * 6 + 2 * 24
    lp_shared, grads_shared = _logprobs_and_grads(trainer, [batch])
    lp_separate, grads_separate = _logprobs_and_grads(trainer, [trainer._batch([it]) for it in packed])
    torch.testing.assert_close(lp_shared, lp_separate, atol=1e-5, rtol=0)
    torch.testing.assert_close(lp_shared, batch.behaviour, atol=1e-5, rtol=0)  # the engine's, under replay
    for g, h in zip(grads_shared, grads_separate):
        torch.testing.assert_close(g, h, atol=1e-5, rtol=1e-3)
    # Calls at no cost: each run's rows cut by length, so no row is padded; each group's prompt still runs once.
    trainer.call_overhead_tokens = 0
    cut = trainer._batch(packed)
    q_of = {b: q for rows, q, _, _ in batch.calls for b in rows}
    assert len(cut.calls) > len(batch.calls) and sum(first for *_, first in cut.calls) == len(batch.calls)
    assert cut.positions[0] == len(system) + 19 + 23 + sum(len(seg.token_ids) - 1 - q_of[b]
                                                           for b, (seg, _) in enumerate(packed))
    lp_cut, grads_cut = _logprobs_and_grads(trainer, [cut])
    torch.testing.assert_close(lp_cut, lp_separate, atol=1e-5, rtol=0)
    for g, h in zip(grads_cut, grads_separate):
        torch.testing.assert_close(g, h, atol=1e-5, rtol=1e-3)
    # A GPU's defaults: no group's prompt is worth a forward call of its own, nor is padding; every row continues
    # the prefix in one call.
    trainer.shared_run_min_tokens = SHARED_RUN_MIN_TOKENS["gpu"]
    trainer.call_overhead_tokens = CALL_OVERHEAD_TOKENS["gpu"]
    flat = trainer._batch(packed)
    assert [(len(rows), q) for rows, q, _, _ in flat.calls] == [(8, len(system))]
    lp_flat, grads_flat = _logprobs_and_grads(trainer, [flat])
    torch.testing.assert_close(lp_flat, lp_separate, atol=1e-5, rtol=0)
    for g, h in zip(grads_flat, grads_separate):
        torch.testing.assert_close(g, h, atol=1e-5, rtol=1e-3)


class _DeviceReads(TorchFunctionMode):
    """Counts reads of a tensor's value into Python (each a wait for the device on a GPU), but those of `host`
    tensors (AdamW's step counters, which stay on the host whatever the device)."""

    READS = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__"}

    def __init__(self, host: set[int]) -> None:
        super().__init__()
        self.host, self.count = host, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS and not (args and id(args[0]) in self.host):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_steps_reads_of_device_values_do_not_grow_with_depth(tmp_path):
    """On a GPU a small model's step is bound by launches and by the host waiting for the device: a step's reads
    of device values must not grow with its layers (they did: the replayed routing's range checked in every MoE
    layer, the experts' counts read in every one)."""
    counts = {}
    for layers in (2, 4):
        model = Qwen3ForCausalLM(tiny_config(moe=True, num_hidden_layers=layers))
        model.reset_parameters(seed=0)
        engine = Engine(Qwen3ForCausalLM(model.config), max_batch=32, max_seq_len=16)
        trainer = RLTrainer(model, None, RLConfig(group_size=4, groups_per_step=4), tmp_path / str(layers))
        engine.update_weights(trainer.weights(), 0)
        trainer.step(_episodes(engine, 0, group_size=4))  # AdamW's state exists from here
        episodes = _episodes(engine, 1, group_size=4)
        with _DeviceReads({id(state["step"]) for state in trainer.optimizer.state.values()}) as reads:
            trainer.step(episodes)
        counts[layers] = reads.count
    assert counts[2] == counts[4] > 0, counts


def test_the_kl_reference_replays_the_rollouts_routing(tmp_path):
    """The KL's reference logprobs are the reference's weights on the experts the rollout chose, which differ from
    the reference routing itself."""
    from realtime_rl.model.qwen3 import sequence_logprobs

    reference = _model(seed=1)
    trainer = RLTrainer(_model(), None, RLConfig(kl_coef=0.1), tmp_path, reference=reference)
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    engine.update_weights(trainer.weights(), 0)
    seg = _episodes(engine, 0)[0].segments[0]
    batch = trainer._batch([(seg, 1.0)])
    with torch.no_grad():
        replayed, _ = trainer._logprobs(batch, trainer.reference)
    tokens = torch.as_tensor(seg.token_ids, dtype=torch.long)
    trained = torch.as_tensor(seg.loss_mask[1:])
    want, _ = sequence_logprobs(reference, tokens, replay_routing=torch.as_tensor(seg.routing))
    torch.testing.assert_close(replayed, want[trained], atol=1e-5, rtol=0)
    own, routing = sequence_logprobs(reference, tokens)
    assert (routing.numpy() != seg.routing[:-1]).any() and (own[trained] - replayed).abs().max() > 1e-3
    metrics = trainer.step(_episodes(engine, 1))
    assert metrics["train/kl_ref"] > 0


def test_a_recorded_routing_naming_a_missing_expert_is_refused_on_the_host(tmp_path):
    """The trainer checks the replayed routing before it reaches the device (where an index out of range ends a
    CUDA process in a device-side assert), and the forward then reads nothing back to check it again."""
    model = _model()
    engine = Engine(_model(), max_batch=32, max_seq_len=16)
    trainer = RLTrainer(model, None, RLConfig(group_size=4), tmp_path)
    engine.update_weights(trainer.weights(), 0)
    episodes = _episodes(engine, 0, group_size=4)
    episodes[3].segments[0].routing[2, 0, 1] = model.config.num_experts
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="outside 0..7"):
        trainer.step(episodes)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and trainer.version == 0


def test_micro_batch_size_and_shared_runs_default_by_device(tmp_path):
    trainer = RLTrainer(_model(), None, RLConfig(), tmp_path / "cpu")
    assert (trainer.micro_batch_tokens, trainer.shared_run_min_tokens, trainer.call_overhead_tokens) == (8192, 16, 150)
    assert (MICRO_BATCH_TOKENS["cpu"], SHARED_RUN_MIN_TOKENS["cpu"], CALL_OVERHEAD_TOKENS["cpu"]) == (8192, 16, 150)
    chosen = RLTrainer(_model(), None, RLConfig(micro_batch_tokens=512, shared_run_min_tokens=4,
                                                call_overhead_tokens=0), tmp_path / "set")
    assert (chosen.micro_batch_tokens, chosen.shared_run_min_tokens, chosen.call_overhead_tokens) == (512, 4, 0)


def test_each_segment_trains_with_the_episode_advantage(tmp_path):
    trainer = RLTrainer(_model(), None, RLConfig(group_size=8), tmp_path)
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    engine.update_weights(trainer.weights(), 0)
    episodes = _episodes(engine, 0)
    for e in episodes:  # a self-summarised episode: two context windows, one reward
        e.segments = [e.segments[0], e.segments[0]]
    metrics = trainer.step(episodes)
    with_signal = sum(1 for e in episodes if len({x.passed for x in episodes if x.group_id == e.group_id}) > 1)
    assert metrics["train/trained_sequences"] == 2 * with_signal


def test_negative_weight_scales_what_failed_and_zero_learns_only_from_what_worked(tmp_path):
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    trainers = {w: RLTrainer(_model(), None, RLConfig(group_size=8, negative_weight=w), tmp_path / str(w))
                for w in (1.0, 0.0)}
    engine.update_weights(trainers[1.0].weights(), 0)
    episodes = _episodes(engine, 0)
    signal = [e for e in episodes if len({x.passed for x in episodes if x.group_id == e.group_id}) > 1]
    above = [e for e in signal if e.passed]
    metrics = {w: t.step(episodes) for w, t in trainers.items()}
    assert metrics[1.0]["train/trained_sequences"] == len(signal)
    assert metrics[0.0]["train/trained_sequences"] == len(above)  # below-baseline episodes: no forward at all
    with pytest.raises(ValueError):
        RLConfig(negative_weight=1.5)


def test_pass_at_k_trains_only_groups_where_some_k_episodes_all_fail(tmp_path):
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    trainer = RLTrainer(_model(), None, RLConfig(group_size=8, pass_at_k=4), tmp_path)
    engine.update_weights(trainer.weights(), 0)
    passes = {"s0-p0": 6, "s0-p1": 2, "s0-p2": 4, "s0-p3": 0}  # per group; 6 > 8 - 4: every 4 hold a pass
    episodes = [dataclasses.replace(e, passed=int(e.episode_id.rsplit("-", 1)[1]) < passes[e.group_id])
                for e in _episodes(engine, 0)]
    metrics = trainer.step(episodes)
    assert metrics["train/trained_sequences"] == 16  # the groups with 2 and 4 passes
    with pytest.raises(ValueError, match="leave_one_out"):
        RLConfig(pass_at_k=4, leave_one_out=True)


def test_partial_credit_ranks_failures_by_the_tests_they_passed_and_never_above_a_pass(tmp_path):
    def graded(passed: bool, counts: tuple[int, int, int] | None, malformed: int = 0) -> Episode:
        metadata = {} if counts is None else dict(zip(("tests_passed", "tests_failed", "tests_errors"), counts))
        return Episode("e", "t", [], "submit", 1, 1, malformed, 0, passed=passed, metadata=metadata)

    assert episode_reward(graded(False, (6, 2, 0))) == 0.0  # off: pass or fail only
    assert episode_reward(graded(False, (6, 2, 0)), partial_credit=0.5) == pytest.approx(0.375)
    assert episode_reward(graded(False, (0, 0, 1)), partial_credit=0.5) == 0.0  # an import error passes nothing
    assert episode_reward(graded(False, None), partial_credit=0.5) == 0.0  # a run that answered nothing
    assert episode_reward(graded(False, (9, 1, 0), malformed=1), 0.5, 0.5) == pytest.approx(-0.05)
    assert episode_reward(graded(True, (10, 0, 0)), partial_credit=0.5) == 1.0
    with pytest.raises(ValueError):
        RLConfig(partial_credit=1.0)  # a failure worth a pass

    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    trainer = RLTrainer(_model(), None, RLConfig(group_size=8, partial_credit=0.5), tmp_path)
    engine.update_weights(trainer.weights(), 0)
    episodes = [dataclasses.replace(e, passed=False, metadata={"tests_passed": int(e.episode_id[-1]) % 2,
                                                              "tests_failed": 1})
                for e in _episodes(engine, 0)]
    metrics = trainer.step(episodes)  # no group passes; each has failures that pass a test and ones that do not
    assert metrics["train/groups_with_signal"] == 4 and metrics["train/trained_sequences"] == 32


def test_entropy_coef_trains_every_episode_and_a_negative_one_sharpens_the_policy(tmp_path):
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    trainers = {c: RLTrainer(_model(), None, RLConfig(group_size=8, lr=1e-2, entropy_coef=c), tmp_path / str(c))
                for c in (0.0, -1.0)}
    engine.update_weights(trainers[0.0].weights(), 0)

    def entropy(model: Qwen3ForCausalLM) -> float:
        with torch.no_grad():
            logp = [torch.log_softmax(model(torch.tensor([p])).logits_BTV[0, -1], -1) for p in PROMPTS]
        return float(torch.stack([-(lp.exp() * lp).sum() for lp in logp]).mean())

    before = entropy(trainers[0.0].model)
    for step in range(3):
        episodes = _episodes(engine, step)
        signal = [e for e in episodes if len({x.passed for x in episodes if x.group_id == e.group_id}) > 1]
        metrics = {c: t.step(copy.deepcopy(episodes)) for c, t in trainers.items()}
        assert metrics[0.0]["train/trained_sequences"] == len(signal)
        assert metrics[-1.0]["train/trained_sequences"] == len(episodes)  # groups without signal too
    assert entropy(trainers[-1.0].model) < min(before, entropy(trainers[0.0].model)) - 0.05
    with pytest.raises(ValueError):
        RLConfig(entropy_coef=2.0)


@pytest.mark.parametrize("aggregation", ["token", "episode"])
def test_a_tiny_entropy_coef_does_not_scale_down_the_policy_gradient(tmp_path, monkeypatch, aggregation):
    """The entropy term brings zero-advantage episodes into the step; their tokens used to join the divisor, so
    entropy_coef 1e-9 cut the policy gradient by the share of groups without signal."""
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    episodes = _episodes(engine, 0) + _episodes(engine, 1)
    for e in episodes:
        if e.group_id.startswith("s1-"):  # every episode of these groups passed: no signal; entropy brings them in
            e.passed = True
    signal = {e.group_id for e in episodes if len({x.passed for x in episodes if x.group_id == e.group_id}) > 1}
    assert signal and all(g.startswith("s0-") for g in signal)
    clip, grads = torch.nn.utils.clip_grad_norm_, []

    def recording(params, max_norm):
        params = list(params)
        grads.append(torch.cat([p.grad.flatten().clone() for p in params if p.grad is not None]))
        return clip(params, max_norm)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording)
    for coef in (0.0, 1e-9):
        RLTrainer(_model(), None, RLConfig(group_size=8, entropy_coef=coef, loss_aggregation=aggregation),
                  tmp_path / f"{coef}").step(copy.deepcopy(episodes))
    without, tiny = grads
    assert without.abs().max() > 0 and torch.allclose(without, tiny, rtol=1e-3, atol=1e-6)  # packing may differ


def test_metrics_average_over_the_tokens_they_sum(tmp_path):
    """With entropy_coef set, episodes without signal join the step for the entropy term: the metrics sum over
    their tokens too, so they divide by every token of the step (the loss keeps the policy gradient's divisor).
    Every token here is far off-policy, so IcePop masks all of them: a fraction of exactly 1."""
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    episodes = _episodes(engine, 0) + _episodes(engine, 1)
    for e in episodes:
        e.segments[0].logprobs[e.segments[0].loss_mask] = -50.0
        if e.group_id.startswith("s1-"):
            e.passed = True  # no signal: only the entropy term brings these in
    metrics = RLTrainer(_model(), None, RLConfig(group_size=8, entropy_coef=1e-9), tmp_path).step(episodes)
    assert metrics["train/trained_sequences"] == len(episodes) > metrics["train/groups_with_signal"] * 8
    assert metrics["train/icepop_masked_fraction"] == pytest.approx(1.0)


def test_episode_aggregation_changes_the_step_only_when_lengths_differ(tmp_path):
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    equal = _episodes(engine, 0)
    mixed = equal + _episodes(engine, 1, max_tokens=12)

    def trained(episodes, aggregation, name):
        trainer = RLTrainer(_model(), None, RLConfig(lr=1e-2, loss_aggregation=aggregation), tmp_path / name)
        trainer.step(episodes)
        return torch.cat([p.detach().flatten() for p in trainer.model.parameters()])

    assert torch.allclose(trained(equal, "token", "a"), trained(equal, "episode", "b"), atol=1e-7)
    assert not torch.allclose(trained(mixed, "token", "c"), trained(mixed, "episode", "d"), atol=1e-6)
    with pytest.raises(ValueError):
        RLConfig(loss_aggregation="sequence")


def test_learning_rate_warms_up_then_decays_to_its_floor(tmp_path):
    cfg = RLConfig(lr=1e-3, warmup_steps=2, lr_decay_steps=4, min_lr_ratio=0.1)
    trainer = RLTrainer(_model(), None, cfg, tmp_path)
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    rates = []
    for step in range(8):
        engine.update_weights(trainer.weights(), trainer.version)
        rates.append(trainer.step(_episodes(engine, step)).get("train/lr"))  # versions 0..7
    cosine = [1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4))) for k in range(5)]
    expected = [5e-4, 1e-3, *cosine, 1e-4]  # warmup, the decay over 4 versions, then the floor
    reported = [(rate, e) for rate, e in zip(rates, expected) if rate is not None]  # no signal: no rate
    assert len(reported) >= 6
    assert [rate for rate, _ in reported] == pytest.approx([e for _, e in reported])
    # The loop's trainer starts at the live version with a fresh optimizer: its schedule starts there too.
    cycle = RLTrainer(_model(), None, cfg, tmp_path / "cycle", version=40, schedule_start=40)
    for step in range(8):
        engine.update_weights(cycle.weights(), cycle.version)
        if (rate := cycle.step(_episodes(engine, step)).get("train/lr")) is not None:
            break
    assert rate == pytest.approx(expected[step])  # at version 40: the warmup, not the floor


@pytest.mark.parametrize("epochs", [1, 2])
def test_the_first_minibatch_is_its_own_proximal_policy_without_another_forward(tmp_path, monkeypatch, epochs):
    """The first minibatch's forward runs at the step-start weights: its logprobs, detached, are the proximal
    ones by construction. A separate forward packs rows otherwise (on a GPU in bf16 other kernels: a ratio of
    the weights to themselves that is not 1, clipping before any update) and costs a forward of those rows.
    Later epochs reuse them: one proximal value per token for the whole step, not two computed two ways."""
    from realtime_rl.train import rl

    calls, up_front = [], []

    def policy_loss(new_lp, prox_lp, *args):
        calls.append((new_lp.detach().clone(), prox_lp.clone()))
        return real(new_lp, prox_lp, *args)

    real = rl.policy_loss
    monkeypatch.setattr(rl, "policy_loss", policy_loss)
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    trainer = RLTrainer(_model(), None, RLConfig(minibatches=2, ppo_epochs=epochs, dtype="bfloat16"), tmp_path)
    no_grad = trainer._logprobs_no_grad
    monkeypatch.setattr(trainer, "_logprobs_no_grad", lambda items: up_front.append(len(items)) or no_grad(items))
    rows = int(trainer.step(_episodes(engine, 0))["train/trained_sequences"])
    assert len(calls) >= 2 * epochs and torch.equal(*calls[0])  # the first minibatch: exactly the step-start policy
    assert up_front == [rows // 2]  # up front: the second minibatch's rows alone, in every epoch count
    if epochs == 2:  # the second epoch starts with the first minibatch again, at the proximal values of epoch 0
        first, again = calls[0], calls[len(calls) // 2]
        assert torch.equal(again[1], first[1]) and not torch.equal(again[0], first[0])


def test_tool_results_after_the_last_generated_token_are_not_run_through_the_model(tmp_path):
    """An episode that ran out of turns ends with its last turn's tool results: they fed no generation and train
    nothing, and the forward ran over them (thousands of positions after a turn of many reads)."""
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    episodes = _episodes(engine, 0)
    padded = copy.deepcopy(episodes)
    for e in padded:
        seg, tail = e.segments[0], 40
        unrouted = np.zeros((tail, *seg.routing.shape[1:]), seg.routing.dtype)
        e.segments[0] = Segment(np.concatenate([seg.token_ids, np.full(tail, 7, np.int32)]),
                                np.concatenate([seg.loss_mask, np.zeros(tail, bool)]),
                                np.concatenate([seg.logprobs, np.zeros(tail, np.float32)]),
                                np.concatenate([seg.versions, np.full(tail, -1, np.int32)]),
                                np.concatenate([seg.routing, unrouted]))
    widths = []
    trainers = [RLTrainer(_model(), None, RLConfig(lr=1e-2), tmp_path / name) for name in ("plain", "padded")]
    batch = trainers[1]._batch
    trainers[1]._batch = lambda micro: widths.append(max(len(s.token_ids) for s, _ in micro)) or batch(micro)
    trainers[0].step(episodes)
    trainers[1].step(padded)
    assert widths and max(widths) == max(len(e.segments[0].token_ids) for e in episodes)
    for p, q in zip(trainers[0].model.parameters(), trainers[1].model.parameters()):
        assert torch.equal(p, q)


def test_killed_trainer_resumes_bit_exactly_and_never_retrains(tmp_path):
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    batches = [_episodes(engine, s) for s in range(4)]
    # two minibatches: exercises the proximal recomputation too; the rate's schedule continues by version
    cfg = RLConfig(lr=1e-3, minibatches=2, warmup_steps=1, lr_decay_steps=2)

    straight = RLTrainer(_model(), None, cfg, tmp_path / "a")
    for b in batches:
        straight.step(b)

    first = RLTrainer(_model(), None, cfg, tmp_path / "b")
    for b in batches[:2]:
        first.step(b)
    first.save()
    first.step(batches[2])  # trained but never checkpointed: lost with the "crash"
    del first
    resumed = RLTrainer.open(tmp_path / "b", tmp_path / "b" / "checkpoints" / "v-0000002", cfg)
    assert resumed.version == 2
    assert resumed.consumed_ids() == {e.episode_id for b in batches[:2] for e in b}
    with pytest.raises(ValueError, match="already consumed"):
        resumed.step(batches[1])
    for b in batches[2:]:
        resumed.step(b)
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name


def test_a_checkpoint_keeps_the_consumed_ids_of_the_last_versions_only(tmp_path):
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    trainer = RLTrainer(_model(), None, RLConfig(lr=1e-3), tmp_path / "run")
    batches = [_episodes(engine, s) for s in range(CONSUMED_VERSIONS + 3)]
    for b in batches:
        trainer.step(b)
    assert sorted(trainer.consumed) == list(range(4, CONSUMED_VERSIONS + 4))
    with pytest.raises(ValueError, match="already consumed"):
        trainer.step(batches[-CONSUMED_VERSIONS])
    trainer.save()
    state = torch.load(tmp_path / "run" / "checkpoints" / f"v-{trainer.version:07d}" / STATE_FILE,
                       weights_only=True)
    assert sorted(map(int, state["consumed"])) == sorted(trainer.consumed)
    # An older checkpoint that kept every version opens with the window only.
    old = RLTrainer(_model(), None, RLConfig(), tmp_path / "old", version=40,
                    consumed={v: [f"e{v}"] for v in range(1, 41)})
    assert sorted(old.consumed) == list(range(41 - CONSUMED_VERSIONS, 41))


def test_bad_episodes_and_settings_are_refused_before_any_weight_changes(tmp_path):
    trainer = RLTrainer(_model(), None, RLConfig(), tmp_path)
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    engine.update_weights(trainer.weights(), 0)
    before = [p.detach().clone() for p in trainer.model.parameters()]

    def refused(change, message):
        episodes = _episodes(engine, 0)
        change(episodes)
        with pytest.raises(ValueError, match=message):
            trainer.step(episodes)

    refused(lambda es: setattr(es[3], "reward", float("nan")), "has reward nan")
    refused(lambda es: es[5].segments[0].logprobs.__setitem__(-1, np.nan), "non-finite behaviour logprob")
    refused(lambda es: setattr(es[0], "passed", None), "never graded")
    # R3 on, and one row of a micro-batch without recorded routing: the longest row first trained the whole
    # micro-batch on the trainer's own routing, silently.
    refused(lambda es: [setattr(e.segments[0], "routing", None) for e in es[1::2]], "no recorded routing")
    refused(lambda es: setattr(es[2].segments[0], "temperature", 0.0), "decoded greedily")
    refused(lambda es: setattr(es[6].segments[0], "top_p", 0.9), "top_p nucleus")
    # Routing of another model's shape (one MoE layer or expert slot short) passed, logged, then failed inside
    # every step a resume retried.
    refused(lambda es: setattr(es[4].segments[0], "routing", es[4].segments[0].routing[:, :, :1]), "not \\[tokens")
    refused(lambda es: setattr(es[4].segments[0], "routing", es[4].segments[0].routing[:, :1]), "MoE layers")
    # A token past the vocabulary (an IndexError in the embedding; a device assert on CUDA): it passed, was
    # logged, and failed every resume's step.
    vocab = trainer.model.config.vocab_size
    refused(lambda es: es[1].segments[0].token_ids.__setitem__(3, vocab), f"outside the vocabulary 0..{vocab - 1}")
    assert trainer.version == 0 and all(torch.equal(p, q) for p, q in zip(before, trainer.model.parameters()))
    with pytest.raises(ValueError, match="needs a reference model"):
        RLTrainer(_model(), None, RLConfig(kl_coef=0.1), tmp_path / "kl")


def test_the_trainer_recomputes_logprobs_at_the_temperature_they_were_sampled_at(tmp_path):
    """At T = 0.7 the engine's logprobs are of softmax(logits / 0.7); recomputed at 1 they differed by far more
    than numerics and IcePop masked the tokens for it."""
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    metrics = {}
    for recorded in (0.7, 1.0):  # 1.0: the segments claim the wrong temperature, as before the fix
        trainer = RLTrainer(_model(), None, RLConfig(lr=1e-4), tmp_path / str(recorded))
        engine.update_weights(trainer.weights(), 0)
        episodes = _episodes(engine, 0, temperature=0.7)
        for e in episodes:
            e.segments[0].temperature = recorded
        metrics[recorded] = trainer.step(episodes)
    assert metrics[0.7]["train/mismatch_k3"] < 1e-6 and metrics[0.7]["train/icepop_masked_fraction"] == 0
    assert metrics[1.0]["train/mismatch_k3"] > 1e-3


def test_a_non_finite_gradient_skips_the_update(tmp_path, monkeypatch):
    trainer = RLTrainer(_model(), None, RLConfig(), tmp_path)
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    engine.update_weights(trainer.weights(), 0)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, max_norm: torch.tensor(math.inf))
    metrics = trainer.step(_episodes(engine, 0))
    assert metrics["train/skipped_nonfinite_updates"] == 1.0 and trainer.version == 1
    assert "train/grad_norm" not in metrics  # no update was taken: no norm to report
    assert all(torch.equal(p, q) for p, q in zip(before, trainer.model.parameters()))


def test_skipped_updates_are_counted_and_the_others_norms_kept(tmp_path, monkeypatch):
    """Four minibatches, the third's gradient not finite: three updates taken, one skipped (a count, not 0.25),
    and the mean gradient norm is of the three (the skipped one's inf made it inf, logged as null)."""
    trainer = RLTrainer(_model(), None, RLConfig(minibatches=4), tmp_path)
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    engine.update_weights(trainer.weights(), 0)
    clip, norms = torch.nn.utils.clip_grad_norm_, []

    def third_overflows(params, max_norm):
        norm = clip(params, max_norm)
        norms.append(math.inf if len(norms) == 2 else float(norm))
        return torch.tensor(norms[-1])

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", third_overflows)
    metrics = trainer.step(_episodes(engine, 0))
    taken = [n for n in norms if math.isfinite(n)]
    assert len(norms) == 4 and metrics["train/skipped_nonfinite_updates"] == 1.0
    assert metrics["train/grad_norm"] == pytest.approx(sum(taken) / 3) and metrics["train/grad_norm_max"] == max(taken)


def test_a_skipped_updates_non_finite_loss_is_left_out_of_the_step_metrics(tmp_path, monkeypatch):
    """One minibatch's loss NaN: its update is skipped, and train/loss and the other means are the updates taken
    (they were NaN, which the metrics log writes as a JSON NaN strict parsers refuse)."""
    import realtime_rl.train.rl as rl

    trainer = RLTrainer(_model(), None, RLConfig(minibatches=4), tmp_path)
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    engine.update_weights(trainer.weights(), 0)
    loss_of, calls = rl.policy_loss, []

    def second_is_nan(*args, **kwargs):
        loss, sums = loss_of(*args, **kwargs)
        calls.append(1)
        if len(calls) != 2:
            return loss, sums
        return loss * float("nan"), {k: v * float("nan") for k, v in sums.items()}

    monkeypatch.setattr(rl, "policy_loss", second_is_nan)
    metrics = trainer.step(_episodes(engine, 0))
    assert metrics["train/skipped_nonfinite_updates"] >= 1
    assert all(math.isfinite(v) for k, v in metrics.items()), metrics


def test_episodes_given_twice_are_named(tmp_path):
    trainer = RLTrainer(_model(), None, RLConfig(), tmp_path)
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    engine.update_weights(trainer.weights(), 0)
    episodes = _episodes(engine, 0)
    with pytest.raises(ValueError, match=f"given twice or already consumed .*: {episodes[0].episode_id}$"):
        trainer.step(episodes + episodes[:1])
    trainer.step(episodes)
    ids = sorted(e.episode_id for e in episodes)
    with pytest.raises(ValueError, match=f": {', '.join(ids[:5])} and {len(ids) - 5} more$"):
        trainer.step(episodes)


def test_checkpoints_are_ordered_by_version_past_seven_digits(tmp_path):
    trainer = RLTrainer(_model(), None, RLConfig(), tmp_path)
    for version in (9_999_998, 9_999_999, 10_000_000):
        trainer.version = version
        trainer.save(keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["v-10000000", "v-9999999"]  # the oldest went, not the one just written
    assert latest_checkpoint(tmp_path).name == "v-10000000"


def test_a_resumed_trainer_takes_its_betas_and_weight_decay_from_the_config(tmp_path):
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    first = RLTrainer(_model(), None, RLConfig(weight_decay=0.0, betas=(0.9, 0.99)), tmp_path)
    first.step(_episodes(engine, 0))
    first.save()
    cfg = RLConfig(weight_decay=0.1, betas=(0.8, 0.95))
    resumed = RLTrainer.open(tmp_path, tmp_path / "checkpoints" / "v-0000001", cfg)
    decay, no_decay = resumed.optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert decay["betas"] == no_decay["betas"] == (0.8, 0.95)
    assert resumed.optimizer.state  # the moments themselves are the saved ones


def test_bf16_mixed_precision_keeps_fp32_weights_and_steps_as_fp32_does(tmp_path):
    """rl.dtype = bfloat16: autocast computes the forward in bf16 over fp32 weights and AdamW state; the step
    moves the weights the way the exact fp32 step does, and the recomputed logprobs stay near the engine's."""
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    trainers = {d: RLTrainer(_model(), None, RLConfig(lr=1e-3, dtype=d), tmp_path / d) for d in ("float32", "bfloat16")}
    engine.update_weights(trainers["float32"].weights(), 0)
    episodes = _episodes(engine, 0)
    start = trainers["float32"].weights()
    metrics, moved = {}, {}
    for d, trainer in trainers.items():
        metrics[d] = trainer.step(episodes)
        after = trainer.weights()
        assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in after.values())
        assert all(next(iter(state.values())).dtype == torch.float32 for state in trainer.optimizer.state.values())
        moved[d] = torch.cat([(after[k] - start[k]).flatten() for k in start])
    assert metrics["float32"]["train/mismatch_k3"] < 1e-6
    assert 0 < metrics["bfloat16"]["train/mismatch_k3"] < 1e-3  # bf16 rounding, not a different policy
    cosine = torch.nn.functional.cosine_similarity(moved["float32"], moved["bfloat16"], dim=0)
    assert cosine > 0.95, float(cosine)
    assert math.isclose(metrics["bfloat16"]["train/loss"], metrics["float32"]["train/loss"], rel_tol=0.1, abs_tol=1e-3)


def test_a_device_that_is_not_here_is_refused_with_what_is_missing(tmp_path):
    from pydantic import ValidationError

    from realtime_rl.config import RolloutConfig
    from realtime_rl.model import torch_device

    for bad in ("gpu", "cuda:x", "CUDA"):
        with pytest.raises(ValidationError, match="device"):
            RLConfig(device=bad)
        with pytest.raises(ValidationError, match="device"):
            RolloutConfig(device=bad)
    assert torch_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA device"):
        torch_device(f"cuda:{torch.cuda.device_count()}")  # one past the last (or none at all)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="finds no CUDA device"):
            RLTrainer(_model(), None, RLConfig(device="cuda"), tmp_path)


def test_ray_rollout_actors_reserve_gpus_only_for_cuda_engines():
    from pydantic import ValidationError

    from realtime_rl.config import RolloutConfig
    from realtime_rl.rollout.ray_actors import actor_options

    four_per_gpu = RolloutConfig(backend="ray", device="cuda", gpus_per_worker=0.25, episodes_in_flight=16)
    assert actor_options(four_per_gpu, group_size=8) == {"num_cpus": 1, "num_gpus": 0.25, "max_concurrency": 4}
    assert actor_options(RolloutConfig(backend="ray"), group_size=8)["num_gpus"] == 0
    with pytest.raises(ValidationError, match="name it 'cuda'"):  # an actor sees its own GPUs only, as cuda
        RolloutConfig(backend="ray", device="cuda:1")
    assert RolloutConfig(backend="local", device="cuda:1").device == "cuda:1"


def test_staleness_buffer_admits_within_the_bound_and_drops_what_outlives_it():
    sync = StalenessBuffer(max_staleness=0, groups_per_step=2)
    starts = 0
    while sync.may_start(version=0):
        sync.started += 1
        starts += 1
    assert starts == 2  # synchronous: exactly the next batch

    buf = StalenessBuffer(max_staleness=1, groups_per_step=1, started=3)

    def group(gid: str, version: int) -> list[Episode]:
        seg = Segment(np.arange(4, dtype=np.int32), np.array([0, 0, 1, 1], bool), np.zeros(4, np.float32),
                      np.array([-1, -1, version, version + 1], np.int32))
        return [Episode(f"{gid}-0", "t", [seg], "submit", 1, 1, 0, 0, group_id=gid)]

    buf.add(group("old", 0))
    buf.add(group("older", 1))
    buf.add(group("fresh", 2))
    batch, dropped = buf.take(version=2)  # "old" is 2 versions behind: past the bound
    assert [g[0].group_id for g in dropped] == ["old"] and buf.dropped == 1 and buf.started == 2
    assert [g[0].group_id for g in batch] == ["older"]  # oldest admissible first


def test_episode_bytes_and_log_roundtrip(tmp_path):
    engine = Engine(_model(), max_batch=32, max_seq_len=64)
    episodes = _episodes(engine, 0, temperature=0.7)
    e = episodes[0]
    e.segments[0].top_p = 0.9
    back = episode_from_bytes(episode_to_bytes(e))
    assert back.episode_id == e.episode_id and back.group_id == e.group_id and back.passed == e.passed
    for a, b in zip(back.segments, e.segments):
        assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("token_ids", "loss_mask", "logprobs",
                                                                           "versions", "routing"))
        assert a.temperature == b.temperature == 0.7 and a.top_p == b.top_p
    assert back.segments[0].top_p == 0.9
    with pytest.raises(ValueError, match="not a serialized episode"):
        episode_from_bytes(b"garbage")

    log = TrajectoryLog(tmp_path / "log")
    groups = [[x for x in episodes if x.group_id == gid] for gid in dict.fromkeys(x.group_id for x in episodes)]
    for g in groups:
        log.append(g)
    assert len(log.load(consumed={})) == len(groups)
    pending = log.load(consumed={3: [groups[0][0].episode_id]})  # consumed, not yet removed: removed now
    assert [g[0].group_id for g in pending] == [g[0].group_id for g in groups[1:]]
    assert len(log) == len(groups) - 1
    assert log.trained_ids() == [e.episode_id for e in groups[0]]  # ... on the record, at version 3
    log.load(consumed={3: [groups[0][0].episode_id]})  # a second resume does not record it twice
    log.remove(groups[:1], version=3, recorded=True)
    assert len(log) == len(groups) - 1 and log.trained_ids() == [e.episode_id for e in groups[0]]
    log.drop(groups[1:2], version=5)  # dropped for staleness: out of the log, on the record
    assert len(log) == len(groups) - 2 and log.dropped_ids() == {e.episode_id for e in groups[1]}
    with open(tmp_path / "log" / "dropped.jsonl", "a") as f:
        f.write('{"group_id": "g9", "episode_ids": ["g9-')  # a trainer killed mid-append
    assert log.dropped_ids() == {e.episode_id for e in groups[1]}
    log.drop([_group("g8", 0)], version=6)  # the next append cuts the torn line off instead of running into it
    assert log.dropped_ids() == {e.episode_id for e in groups[1]} | {"g8-0"}


def test_a_kill_between_a_drop_or_reject_record_and_the_unlink_sets_the_group_aside_once(tmp_path, monkeypatch):
    log = TrajectoryLog(tmp_path / "log")
    for gid in ("stale", "bad", "kept"):
        log.append(_group(gid, 0))
    monkeypatch.setattr(TrajectoryLog, "_forget", lambda self, groups: None)  # killed before the unlink
    log.drop([_group("stale", 0)], version=4)
    log.reject(_group("bad", 0), version=4, reason="a non-finite behaviour logprob")
    monkeypatch.undo()
    resumed = TrajectoryLog(tmp_path / "log")
    assert [g[0].group_id for g in resumed.load(consumed={})] == ["kept"]  # not set aside a second time
    assert len(resumed) == 1 and resumed.dropped_ids() == {"stale-0"}
    assert len((tmp_path / "log" / "rejected.jsonl").read_text().splitlines()) == 1


def _group(gid: str, version: int) -> list[Episode]:
    """A one-episode group whose oldest generated token is of `version`."""
    seg = Segment(np.arange(4, dtype=np.int32), np.array([0, 0, 1, 1], bool), np.zeros(4, np.float32),
                  np.array([-1, -1, version, version + 1], np.int32))
    return [Episode(f"{gid}-0", "t", [seg], "submit", 1, 1, 0, 0, group_id=gid)]


def test_staleness_buffer_holds_the_step_that_would_strand_a_group_in_flight():
    buf = StalenessBuffer(max_staleness=2, groups_per_step=2)
    buf.add(_group("a", 5))
    assert not buf.stranded(version=5, in_flight=[3])  # one group ready: no batch, nothing to hold back
    buf.add(_group("b", 5))
    assert not buf.stranded(version=5, in_flight=[4, 5])  # the next steps have room for both
    assert not buf.stranded(version=5, in_flight=[])
    assert buf.stranded(version=5, in_flight=[5, 3])  # admitted at 3, due at 5: this step must train it
    assert not buf.stranded(version=5, in_flight=[2])  # due at 4, already past: not worth holding the step for
    sync = StalenessBuffer(max_staleness=0, groups_per_step=1)
    sync.add(_group("a", 0))
    assert not sync.stranded(version=0, in_flight=[0])  # both due now, one step: no order saves both


def test_staleness_buffer_waits_for_the_group_due_first_not_only_the_one_due_now():
    # max_staleness 2, one group a step. At version 1, g3 (sampled at 1, due at 3) is ready while g0 and g2,
    # admitted at 0, are in flight, both due at 2: stepping with g3 leaves two groups for the one step left
    # before their deadline. Earliest deadline first, the trainer waits and then trains all three in time.
    buf = StalenessBuffer(max_staleness=2, groups_per_step=1, started=4)
    buf.add(_group("g3", 1))
    assert buf.stranded(version=1, in_flight=[0, 0])
    buf.add(_group("g0", 0))
    assert not buf.stranded(version=1, in_flight=[0])
    assert [g[0].group_id for g in buf.take(version=1)[0]] == ["g0"]
    assert buf.stranded(version=2, in_flight=[0])  # g2 is due at 2: g3 must not take its step
    buf.add(_group("g2", 0))
    assert [g[0].group_id for g in buf.take(version=2)[0]] == ["g2"]
    batch, dropped = buf.take(version=3)
    assert [g[0].group_id for g in batch] == ["g3"] and not dropped


@pytest.mark.parametrize("max_staleness,groups_per_step", [(0, 2), (1, 1), (1, 4), (2, 1), (2, 3), (4, 2)])
def test_admission_and_earliest_deadline_first_never_drop_a_group(max_staleness, groups_per_step):
    """A pipeline simulated with random episode lengths and step times: groups admitted as `may_start`
    allows, each sampled at its admission version, the trainer stepping only when `stranded` says it
    may. Admission never lets more groups be due by a version than the steps before it can train, so
    earliest deadline first with waiting drops none."""
    rng = random.Random(max_staleness * 10 + groups_per_step)
    for _ in range(20):
        buf = StalenessBuffer(max_staleness, groups_per_step)
        version, now, flying, trained = 0, 0.0, {}, 0
        while version < 30:
            while buf.may_start(version):
                flying[f"g{buf.started}"] = (version, now + rng.expovariate(1.0) * rng.choice([1, 1, 5]))
                buf.started += 1
            if not buf.stranded(version, [v for v, _ in flying.values()]):
                batch, dropped = buf.take(version)
                assert not dropped
                if batch is not None:
                    version, now, trained = version + 1, now + rng.uniform(0.1, 2.0), trained + len(batch)
                    for gid in [g for g, (_, end) in flying.items() if end <= now]:
                        buf.add(_group(gid, flying.pop(gid)[0]))
                    continue
            gid = min(flying, key=lambda g: flying[g][1])  # wait for the next group to finish
            now = max(now, flying[gid][1])
            buf.add(_group(gid, flying.pop(gid)[0]))
        assert trained == 30 * groups_per_step and buf.dropped == 0


def test_the_log_records_tasks_handed_out_durably(tmp_path):
    log = TrajectoryLog(tmp_path / "log")
    assert log.tasks_handed_out() is None  # a log from before the counter: the orchestrator falls back
    log.hand_out(7)
    log.hand_out(8)
    assert TrajectoryLog(tmp_path / "log").tasks_handed_out() == 8
    assert len(log) == 0 and not list((tmp_path / "log").glob(".*"))  # no group counted, no temp file left


def test_train_tasks_take_the_difficulties_in_turn_from_the_easiest_asked_for():
    from pydantic import ValidationError

    from realtime_rl.config import RolloutConfig
    from realtime_rl.rollout.orchestrator import task_difficulty

    assert [task_difficulty(k, RolloutConfig(max_difficulty=2)) for k in range(5)] == [1, 2, 1, 2, 1]
    assert [task_difficulty(k, RolloutConfig(min_difficulty=3, max_difficulty=4)) for k in range(4)] == [3, 4, 3, 4]
    assert {task_difficulty(k, RolloutConfig(min_difficulty=3, max_difficulty=3)) for k in range(4)} == {3}
    with pytest.raises(ValidationError, match="exceeds max_difficulty"):
        RolloutConfig(min_difficulty=3, max_difficulty=2)


def test_a_rollout_on_the_reserved_split_draws_only_reserved_structures():
    from pydantic import ValidationError

    from realtime_rl.config import RolloutConfig
    from realtime_rl.environments.synthetic import task_set
    from realtime_rl.rollout.worker import GroupJob, job_task

    def structures(rollout):
        return {task_set(job_task(GroupJob("g", 100_000 + k, 1 + k % 2, 8, 0, 0), rollout).metadata["structure"])
                for k in range(20)}

    assert structures(RolloutConfig(split="reserved")) == {"reserved"}
    assert "train" in structures(RolloutConfig())
    with pytest.raises(ValidationError, match="split"):
        RolloutConfig(split="heldout")


def test_a_rollout_never_trains_a_held_out_structure_as_part_of_a_longer_one():
    from realtime_rl.config import RolloutConfig
    from realtime_rl.environments.synthetic import holds_heldout_part, pick
    from realtime_rl.environments.synthetic_index import structure_name, structures
    from realtime_rl.rollout.worker import GroupJob, job_task

    ops_of = {structure_name(ops): ops for ops in structures()}
    holding = [i for i in range(200) if holds_heldout_part(pick(i, "train", 0, 3).ops)]
    assert holding  # about a fifth of the three-stage train structures hold a held-out pair
    for i in holding[:5]:
        task = job_task(GroupJob("g", i, 3, 8, 0, 0), RolloutConfig(max_difficulty=3))
        assert task.metadata["difficulty"] == 3
        assert not holds_heldout_part(ops_of[task.metadata["structure"]])
        assert task.metadata["index"] not in range(i, i + 1000)  # not a task the next groups get


def _segment(tokens: list[int], prompt: int, routing: np.ndarray) -> Segment:
    n = len(tokens)
    mask = np.arange(n) >= prompt
    return Segment(np.array(tokens, dtype=np.int32), mask, np.where(mask, -1.0, 0.0).astype(np.float32),
                   np.where(mask, 0, -1).astype(np.int32), routing)


def test_shared_inputs_of_one_token_prompts_and_of_routings_that_differ():
    from realtime_rl.train.packing import shared_inputs

    routing = np.zeros((5, 2, 2), dtype=np.uint8)
    a, b = _segment([7, 1, 2, 3, 4], 1, routing), _segment([7, 5, 6, 8, 9], 1, routing)
    assert shared_inputs(a, b, routing=True) == 0  # nothing before the first trained target to share
    other = routing.copy()
    other[2, 1, 0] = 1
    a, b = _segment([7, 8, 9, 1, 2], 4, routing), _segment([7, 8, 9, 3, 4], 4, other)
    assert shared_inputs(a, b) == 3 and shared_inputs(a, b, routing=True) == 2


def test_a_segment_whose_first_token_is_generated_is_refused():
    with pytest.raises(ValueError, match="first token cannot be generated"):
        _segment([1, 2, 3], 0, np.zeros((3, 2, 2), dtype=np.uint8))


def test_a_segment_whose_loss_mask_is_not_boolean_is_refused():
    """An integer mask would index positions: the trainer would train tokens 0 and 1 over and over, and the
    buffer would measure staleness on context tokens and drop the group as stale."""
    seg = _segment([7, 8, 9, 1, 2], 3, np.zeros((5, 2, 2), dtype=np.uint8))
    for mask in (seg.loss_mask.astype(np.int64), seg.loss_mask.astype(np.float32), seg.loss_mask.tolist()):
        with pytest.raises(ValueError, match="loss_mask must be a numpy bool array"):
            Segment(seg.token_ids, mask, seg.logprobs, seg.versions, seg.routing)
    episode = Episode("e", "t", [seg], "submit", 1, 1, 0, 0)
    blob = episode_to_bytes(episode)
    assert episode_from_bytes(blob).segments[0].loss_mask.dtype == np.bool_
    seg.loss_mask = seg.loss_mask.astype(np.int8)  # what a foreign writer could serialize
    with pytest.raises(ValueError, match="not a serialized episode: a segment's loss_mask"):
        episode_from_bytes(episode_to_bytes(episode))


def test_each_difficulty_draws_consecutive_tasks_from_every_input_type():
    """Three difficulties in turn once gave each difficulty every third task index, and the index space deals its
    input-type pools in turn: every difficulty-3 task took lists of integers."""
    from realtime_rl.config import RolloutConfig
    from realtime_rl.environments.synthetic import pick
    from realtime_rl.rollout.orchestrator import task_difficulty, task_index

    rollout = RolloutConfig(min_difficulty=1, max_difficulty=3)
    jobs = [(task_difficulty(k, rollout), task_index(k, rollout)) for k in range(60)]
    assert len(set(jobs)) == 60
    assert [i for d, i in jobs if d == 3] == list(range(rollout.first_task, rollout.first_task + 20))
    takes = {pick(i, "train", 0, 3).ops[0].takes for d, i in jobs if d == 3}
    assert len(takes) == 3, takes


def test_task_mix_input_types_deals_each_input_type_in_turn():
    from realtime_rl.config import RolloutConfig
    from realtime_rl.environments.synthetic import pick
    from realtime_rl.rollout.orchestrator import task_difficulty, task_index

    rollout = RolloutConfig(min_difficulty=1, max_difficulty=2, task_mix="input_types")
    jobs = [(task_difficulty(k, rollout), task_index(k, rollout)) for k in range(120)]
    assert len(set(jobs)) == 120
    for difficulty in (1, 2):
        takes = [pick(i, "train", 0, d).ops[0].takes for d, i in jobs if d == difficulty]
        assert takes == ["ints", "nat", "text"] * 20


def test_a_group_is_sharded_into_consecutive_episode_ranges_of_near_equal_size():
    from realtime_rl.rollout.worker import GroupJob, shard

    job = GroupJob("g", 3, 1, 8, 0, 0)
    assert shard(job, 1) == [job] and list(job.indices) == list(range(8))
    parts = shard(job, 3)
    assert [list(p.indices) for p in parts] == [[0, 1, 2], [3, 4], [5, 6, 7]]
    assert all(p.group_id == "g" and p.task_index == 3 and p.seed == 0 for p in parts)
    assert [list(p.indices) for p in shard(job, 20)] == [[i] for i in range(8)]  # at most one per episode
