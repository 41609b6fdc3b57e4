"""The RL trainer: one optimizer step per batch of rewarded episodes, with router replay (R3).

    trainer = RLTrainer.open(run_dir, base_checkpoint, RLConfig())  # resumes from run_dir when it can
    metrics = trainer.step(episodes)       # GRPO advantages per group, decoupled PPO, TIS/IcePop
    trainer.save()                         # HF checkpoint + trainer_state.pt (optimizer, version, consumed ids)
    engine.update_weights(trainer.weights(), trainer.version)

A step, top to bottom: advantages per group (episodes sharing a group_id); every segment of an
episode becomes its own training sequence carrying the episode's advantage (self-summarised episodes
train each context window separately); segments are packed into micro-batches of at most
`micro_batch_tokens` computed positions (by device when unset); each micro-batch runs one forward that
replays the routing the engine recorded (so training sees the experts inference used), the loss of
losses.py on the generated tokens, and a backward; then one clipped AdamW step. The leading tokens a
micro-batch's rows share (the system prompt and tool schemas every reply of the live loop starts with,
with the same recorded routing) run once, with grad, and every row attends to them
(model/shared_prefix.py); so, on CPU by default (`shared_run_min_tokens`), does the rest of the prompt
that a run of adjacent rows shares (a GRPO group's task): the gradient is that of the separate rows.
A run's rows, sorted by length, go through as many calls over its prompt as pay for the padding they save
(`call_overhead_tokens`, train/packing.py): replies of one group differ in length by several times.
The LM head and softmax run only where a token is trained. The proximal policy is the current
weights: with one minibatch and one epoch it equals the policy being optimised at the forward, so no
extra pass is needed; otherwise a no-grad pass computes it first.

Checkpoints are written to a temporary directory and renamed, and record the policy version and, for
the last CONSUMED_VERSIONS versions, the ids of the episodes each step consumed: a trainer killed at any
instant resumes from its last checkpoint and neither retrains nor forgets an episode (the orchestrator
re-feeds the unconsumed ones from its durable log, which forgets a step's groups once the checkpoint of
that step is durable, so a resume meets at most the last step's; the run's whole record of what trained
is the log's `trained.jsonl`, not the checkpoint, which stays the same size however long the run).
Not here: sampling (rollout/), rewards beyond pass/fail, packing segments into micro-batches and forward calls
(packing.py).
"""

from __future__ import annotations

import contextlib
import math
import shutil
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from realtime_rl.config import RLConfig
from realtime_rl.model import (
    Qwen3ForCausalLM,
    Tokenizer,
    load_checkpoint,
    routing_dtype,
    save_checkpoint,
    torch_device,
)
from realtime_rl.model.checkpoint import numbered_checkpoints, publish_directory
from realtime_rl.model.shared_prefix import SharedPrefix
from realtime_rl.train.losses import (
    LossConfig, group_advantages, k3, length_normalized, pass_at_k_advantages, policy_loss,
)
from realtime_rl.train.packing import MicroBatch, forward_calls, pack_micro_batches
from realtime_rl.train.schedule import warmup_cosine
from realtime_rl.types import Episode, Segment

STATE_FILE = "trainer_state.pt"
CONSUMED_VERSIONS = 16
"""Versions whose consumed episode ids a checkpoint keeps: one would do for a resume (see above); the rest
let `step` refuse an episode given again a few steps later."""


# rl.micro_batch_tokens and rl.shared_run_min_tokens when unset, by the trainer's device. One RL step of the
# recipe's shape (32 episodes, `rtrl bench trainer`) on an H200 in bf16: 0.89 s with the CPU's values (3
# micro-batches, 22 forward calls and 22 more for the reference), 0.099 s with the GPU's (one micro-batch, 2 + 2
# calls): the default model's step there is bound by the calls' kernel launches, not by the positions the shared
# runs save; on 2 CPU cores the GPU's values made the same step 1.7x slower (BENCHMARKS.md, trainer). Tuned
# on the 2.8M-parameter default model: a large model on a GPU wants fewer micro-batch tokens (memory) and
# benefits from shared runs (its positions cost compute), so set both there.
MICRO_BATCH_TOKENS = {"cpu": 8192, "gpu": 65536}
SHARED_RUN_MIN_TOKENS = {"cpu": 16, "gpu": sys.maxsize}
# rl.call_overhead_tokens when unset: on CPU a forward call's fixed cost is about that of 150 padded positions (as
# pre-training measured its micro-batches), so a group whose replies differ in length runs as a few calls of
# similar lengths; on a GPU, where the step is bound by calls, a group stays one call.
CALL_OVERHEAD_TOKENS = {"cpu": 150, "gpu": sys.maxsize}


def episode_reward(episode: Episode, malformed_penalty: float = 0.0, partial_credit: float = 0.0) -> float:
    """The offline reward: 1 if the graded workspace passes (hidden tests included), else partial_credit times
    the fraction of its tests that passed (the worker records the counts in `metadata`), minus a penalty per
    malformed tool call. The episode's own `reward` wins when a reward stage already set it."""
    if episode.reward is not None:
        return float(episode.reward)
    if episode.passed is None:
        raise ValueError(f"episode {episode.episode_id} was never graded (passed and reward are both unset)")
    score = float(episode.passed)
    if partial_credit and not episode.passed:
        passed = episode.metadata.get("tests_passed", 0)
        tests = passed + episode.metadata.get("tests_failed", 0) + episode.metadata.get("tests_errors", 0)
        score = partial_credit * passed / tests if tests else 0.0
    return score - malformed_penalty * episode.malformed_tool_calls


def staleness(episode: Episode, version: int) -> int:
    """Versions between the trainer and the oldest token of the episode (0 when nothing was generated)."""
    oldest = min((int(s.versions[s.loss_mask].min()) for s in episode.segments if s.loss_mask.any()), default=version)
    return version - oldest


class RLTrainer:
    def __init__(self, model: Qwen3ForCausalLM, tokenizer: Tokenizer | None, config: RLConfig, run_dir: Path,
                 version: int = 0, consumed: dict[int, list[str]] | None = None,
                 optimizer_state: dict[str, Any] | None = None, reference: Qwen3ForCausalLM | None = None,
                 schedule_start: int = 0) -> None:
        self.device = torch_device(config.device)
        # Weights, gradients and AdamW state stay fp32 on the device; bf16 is the forward's compute dtype only.
        self.model = model.to(self.device, torch.float32).train()
        self.tokenizer = tokenizer
        self.config = config
        self.run_dir = Path(run_dir)
        self.version = version
        self.schedule_start = schedule_start
        """The version the learning-rate schedule counts from (the loop: the live version each cycle starts
        at, with a fresh optimizer; offline: 0, so a resume continues the schedule)."""
        window = version - CONSUMED_VERSIONS
        self.consumed = {v: list(ids) for v, ids in (consumed or {}).items() if v > window}
        """version -> the ids of the episodes the step that produced it consumed, for the last
        CONSUMED_VERSIONS versions."""
        if config.kl_coef > 0 and reference is None:
            raise ValueError(f"kl_coef={config.kl_coef} needs a reference model (RLTrainer.open loads one)")
        self.reference = reference.to(self.device, torch.float32).eval() if reference is not None else None
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=config.lr, betas=config.betas)
        if optimizer_state is not None:
            self.optimizer.load_state_dict(optimizer_state)  # brings back the saved betas and decay
            for group, decay_rate in zip(self.optimizer.param_groups, (config.weight_decay, 0.0)):
                group["betas"], group["weight_decay"] = tuple(config.betas), decay_rate
        self.loss_config = LossConfig(config.clip_low, config.clip_high, config.tis_cap, config.icepop_low,
                                      config.icepop_high, config.kl_coef, config.entropy_coef,
                                      config.kl_estimator, config.dual_clip)
        kind = "cpu" if self.device.type == "cpu" else "gpu"
        self.micro_batch_tokens = (MICRO_BATCH_TOKENS[kind] if config.micro_batch_tokens is None
                                   else config.micro_batch_tokens)
        self.shared_run_min_tokens = (SHARED_RUN_MIN_TOKENS[kind] if config.shared_run_min_tokens is None
                                      else config.shared_run_min_tokens)
        self.call_overhead_tokens = (CALL_OVERHEAD_TOKENS[kind] if config.call_overhead_tokens is None
                                     else config.call_overhead_tokens)
        self._route_dtype = routing_dtype(max(1, model.config.num_experts))
        self._replays = bool(config.router_replay and model.num_moe_layers)

    # -------------------------------------------------------------------------------- open / save

    @classmethod
    def open(cls, run_dir: Path, base_checkpoint: Path, config: RLConfig) -> RLTrainer:
        """Resume from the newest checkpoint under run_dir, or start at version 0 from base_checkpoint."""
        run_dir = Path(run_dir)
        latest = latest_checkpoint(run_dir)
        source = latest or Path(base_checkpoint)
        ckpt = load_checkpoint(source, dtype=torch.float32)
        reference = load_checkpoint(base_checkpoint, dtype=torch.float32).model if config.kl_coef > 0 else None
        if latest is None:
            return cls(ckpt.model, ckpt.tokenizer, config, run_dir, reference=reference)
        state = torch.load(latest / STATE_FILE, weights_only=True, map_location="cpu")  # the optimizer moves it
        consumed = {int(v): list(ids) for v, ids in state["consumed"].items()}
        return cls(ckpt.model, ckpt.tokenizer, config, run_dir, state["version"], consumed, state["optimizer"],
                   reference)

    def save(self, keep: int = 2) -> Path:
        """Atomically write checkpoints/v-<version> (HF directory + trainer state); keep the newest `keep`."""
        final = self.run_dir / "checkpoints" / f"v-{self.version:07d}"
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=self.run_dir, prefix=".ckpt-"))
        save_checkpoint(staging, self.model, self.tokenizer)
        torch.save({"version": self.version, "optimizer": self.optimizer.state_dict(),
                    "consumed": {str(v): ids for v, ids in self.consumed.items()}}, staging / STATE_FILE)
        publish_directory(staging, final)  # durable before the log drops the consumed groups' files
        for old in numbered_checkpoints(final.parent, "v-")[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def consumed_ids(self) -> set[str]:
        """The episodes the last CONSUMED_VERSIONS steps consumed."""
        return {i for ids in self.consumed.values() for i in ids}

    def weights(self) -> dict[str, torch.Tensor]:
        """The current parameters (detached CPU copies), for publishing to rollout engines."""
        return {name: p.detach().to("cpu", copy=True) for name, p in self.model.named_parameters()}

    def _autocast(self) -> contextlib.AbstractContextManager:
        """The forward's precision: bf16 matmuls and attention over the fp32 weights (rl.dtype), or exact fp32."""
        if self.config.dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -------------------------------------------------------------------------------- the step

    def refusal(self, episode: Episode) -> str | None:
        """Why `step` would refuse this episode (None: it would not): a non-finite reward or behaviour logprob
        (one NaN would reach every weight through the loss), greedy decoding (no sample of a policy), top_p < 1 (a
        truncation: the tail it never sampled cannot be corrected for), or, under
        router replay, a trained segment without recorded routing or naming an expert the model lacks. The
        pipeline asks before logging a group, so one bad group is set aside instead of ending every resume."""
        try:
            reward = episode_reward(episode, self.config.malformed_penalty, self.config.partial_credit)
        except ValueError as e:  # never graded
            return str(e)
        if not math.isfinite(reward):
            return f"episode {episode.episode_id} has reward {reward}"
        V = self.model.config.vocab_size  # an id past it fails in the embedding (a device assert on CUDA)
        if any(s.token_ids.size and (s.token_ids.min() < 0 or s.token_ids.max() >= V) for s in episode.segments):
            return f"episode {episode.episode_id} has a token id outside the vocabulary 0..{V - 1}"
        trained = [s for s in episode.segments if s.loss_mask.any()]
        if not all(np.isfinite(s.logprobs[s.loss_mask]).all() for s in trained):
            return f"episode {episode.episode_id} has a non-finite behaviour logprob"
        if any(s.temperature == 0 for s in trained):
            return f"episode {episode.episode_id} was decoded greedily: no sample of a policy"
        if any(s.top_p < 1 for s in trained):
            return (f"episode {episode.episode_id} was sampled from a top_p nucleus: its tail was never sampled, "
                    f"so no ratio corrects the logprobs")
        if self._replays:
            if any(s.routing is None for s in trained):
                return (f"episode {episode.episode_id}: router replay is on but a segment has no recorded "
                        "routing (rl.router_replay = false trains on the trainer's own routing)")
            E, k = self.model.config.num_experts, self.model.config.num_experts_per_tok
            shape = (self.model.num_moe_layers, k)
            if any(s.routing.ndim != 3 or s.routing.shape[1:] != shape for s in trained):
                return (f"episode {episode.episode_id}: a segment's recorded routing is not "
                        f"[tokens, {shape[0]} MoE layers, top-{k}] as this model's")
            if any(s.routing.size and (s.routing.min() < 0 or s.routing.max() >= E) for s in trained):
                return f"episode {episode.episode_id}: a segment's recorded routing names an expert outside 0..{E - 1}"
        return None

    def step(self, episodes: list[Episode]) -> dict[str, float]:
        """One policy version: consume `episodes` (whole groups) and update the weights once per minibatch."""
        if not episodes:
            raise ValueError("a step needs at least one episode")
        ids = [e.episode_id for e in episodes]
        repeated = sorted({i for i, n in Counter(ids).items() if n > 1} | (self.consumed_ids() & set(ids)))
        if repeated:
            raise ValueError(f"episodes given twice or already consumed by an earlier step: {', '.join(repeated[:5])}"
                             + (f" and {len(repeated) - 5} more" if len(repeated) > 5 else ""))
        cfg = self.config
        for e in episodes:
            if (why := self.refusal(e)) is not None:
                raise ValueError(why)
        rewards = {e.episode_id: episode_reward(e, cfg.malformed_penalty, cfg.partial_credit) for e in episodes}
        groups: dict[str, list[Episode]] = defaultdict(list)
        for e in episodes:
            groups[e.group_id or e.episode_id].append(e)
        trained: list[tuple[Episode, float]] = []
        for members in groups.values():
            rewards_G = torch.tensor([rewards[e.episode_id] for e in members])
            adv = (pass_at_k_advantages(rewards_G, cfg.pass_at_k, cfg.std_normalize) if cfg.pass_at_k > 1
                   else group_advantages(rewards_G, cfg.leave_one_out, cfg.std_normalize))
            adv = torch.where(adv < 0, adv * cfg.negative_weight, adv)
            # zero-advantage episodes (and those that generated nothing) carry no policy gradient: skip their
            # forward, unless the entropy term covers them
            trained += [(e, a) for e, a in zip(members, adv.tolist())
                        if (a != 0.0 or cfg.entropy_coef) and e.num_generated]
        signal = [(e, a) for e, a in trained if a != 0.0]  # the entropy term's extra episodes change no weight
        if cfg.loss_aggregation == "episode" and signal:
            scaled = dict(zip((e.episode_id for e, _ in signal), length_normalized(
                torch.tensor([a for _, a in signal]), torch.tensor([e.num_generated for e, _ in signal])).tolist()))
            trained = [(e, scaled.get(e.episode_id, 0.0)) for e, _ in trained]
        # each segment through its last generated token: a forward over the tool results after it trains nothing
        items = [(s.through_last_generated(), a) for e, a in trained for s in e.segments if s.loss_mask.any()]

        stale = [staleness(e, self.version) for e in episodes]
        metrics: dict[str, float] = {
            "train/reward_mean": float(np.mean(list(rewards.values()))),
            "train/pass_rate": float(np.mean([bool(e.passed) for e in episodes])),
            "train/episodes": float(len(episodes)),
            "train/groups": float(len(groups)),
            "train/groups_with_signal": float(sum(len({rewards[e.episode_id] for e in m}) > 1
                                                  for m in groups.values())),
            "train/generated_tokens": float(sum(e.num_generated for e in episodes)),
            "train/malformed_tool_calls": float(np.mean([e.malformed_tool_calls for e in episodes])),
            "train/staleness_mean": float(np.mean(stale)),
            "train/staleness_max": float(max(stale)),
        }
        for k, n in zip(*np.unique(stale, return_counts=True)):
            metrics[f"train/staleness_hist/{int(k)}"] = float(n)

        if items:
            metrics |= self._optimize(items)
        else:
            metrics["train/skipped_no_signal"] = 1.0
        self.version += 1
        self.consumed[self.version] = ids
        self.consumed.pop(self.version - CONSUMED_VERSIONS, None)
        return metrics

    def _optimize(self, items: list[tuple[Segment, float]]) -> dict[str, float]:
        cfg = self.config
        lr = warmup_cosine(self.version - self.schedule_start, cfg.lr, cfg.warmup_steps, cfg.lr_decay_steps,
                           cfg.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # The proximal policy is the weights at the step start. The first minibatch's forward runs at them, so its
        # own logprobs, detached, are the proximal ones exactly (a separate forward packs rows otherwise, and in
        # bf16 a ratio that should be 1 would not be), and later epochs reuse them: one proximal value per token
        # for the whole step. The other minibatches' are computed up front.
        minibatches = [list(range(mb, len(items), cfg.minibatches)) for mb in range(min(cfg.minibatches, len(items)))]
        later = [items[i] for mb in minibatches[1:] for i in mb]
        prox = self._logprobs_no_grad(later) if later else {}
        totals: dict[str, float] = defaultdict(float)  # over the updates taken
        mismatch = {"tokens": 0, "k3": 0.0, "max": 0.0}  # over tokens of the current version, first pass only
        num_updates, micro_batches, norms = 0, 0, []
        positions = {"computed": 0, "padded": 0}  # input positions through the model: run, and in padded rows
        for epoch in range(cfg.ppo_epochs):
            for mb, chosen in enumerate(minibatches):
                # The divisor counts the tokens with a policy gradient: segments of zero-advantage episodes, which
                # only the entropy term brings in, must not scale down the others' (a tiny entropy_coef did so)
                all_tokens = sum(items[i][0].num_generated for i in chosen)
                num_tokens = sum(items[i][0].num_generated for i in chosen if items[i][1] != 0.0) or all_tokens
                self.optimizer.zero_grad(set_to_none=True)
                update: dict[str, float] = defaultdict(float)
                for micro in pack_micro_batches([(items[i][0], items[i][1]) for i in chosen], self.micro_batch_tokens,
                                            self._replays):
                    sums, fresh, (computed, padded) = self._micro_step(micro, num_tokens, prox,
                                                                       record_prox=epoch == mb == 0)
                    micro_batches += 1
                    positions["computed"] += computed
                    positions["padded"] += padded
                    for k, v in sums.items():  # the loss is the objective's; the metrics average their tokens
                        update[k] += v / (num_tokens if k == "loss" else all_tokens)
                    if epoch == 0:  # the proximal logprobs are those of the weights at the step start
                        mismatch["tokens"] += fresh[0]
                        mismatch["k3"] += fresh[1]
                        mismatch["max"] = max(mismatch["max"], fresh[2])
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                    norms.append(float(grad_norm))
                    for k, v in update.items():  # a skipped update's loss is NaN or inf: not in the means
                        totals[k] += v
                num_updates += 1
        out = {f"train/{k}": v / max(len(norms), 1) for k, v in totals.items()}
        if norms:  # of the updates taken: a skipped one's inf or NaN would hide the others'
            out["train/grad_norm"], out["train/grad_norm_max"] = sum(norms) / len(norms), max(norms)
        if len(norms) < num_updates:  # an overflow (bf16) or a NaN: those minibatches changed nothing
            out["train/skipped_nonfinite_updates"] = float(num_updates - len(norms))
        out["train/updates"] = float(num_updates)
        out["train/lr"] = lr
        out["train/trained_sequences"] = float(len(items))
        out["train/micro_batches"] = float(micro_batches)
        if mismatch["tokens"]:
            # Engine vs trainer on tokens the current weights generated (verl/slime rollout-correction metrics):
            # with R3 in fp32 this is numerical noise; staleness shows in offpolicy_k3 instead.
            out["train/mismatch_k3"] = mismatch["k3"] / mismatch["tokens"]
            out["train/mismatch_max_abs_logprob_diff"] = mismatch["max"]
        # What the shared prefixes saved: input positions run through the model in one pass, against padded rows.
        out["train/forward_token_fraction"] = positions["computed"] / positions["padded"]
        out["train/fresh_token_fraction"] = mismatch["tokens"] / sum(s.num_generated for s, _ in items)
        return out

    def _batch(self, micro: list[tuple[Segment, float]]) -> MicroBatch:
        B, T = len(micro), max(len(s.token_ids) for s, _ in micro) - 1
        ids = torch.zeros((B, T), dtype=torch.long)
        where = torch.zeros((B, T), dtype=torch.bool)
        routing = None
        if self._replays:  # each segment's routing is there and names experts the model has (`refusal`, on the host)
            L, k = micro[0][0].routing.shape[1:]
            routing = torch.zeros((B, T, L, k), dtype=self._route_dtype)
        targets, behaviour, advantages, fresh, temperature, rows = [], [], [], [], [], []
        for b, (seg, a) in enumerate(micro):
            n = len(seg.token_ids) - 1
            trained = seg.loss_mask[1:]
            ids[b, :n] = torch.from_numpy(seg.token_ids[:-1].astype(np.int64))
            where[b, :n] = torch.from_numpy(trained)
            if routing is not None:
                routing[b, :n] = torch.from_numpy(seg.routing[:-1].astype(np.int64)).to(self._route_dtype)
            targets.append(seg.token_ids[1:][trained].astype(np.int64))
            behaviour.append(seg.logprobs[1:][trained].astype(np.float32))
            rows.append(int(trained.sum()))
            advantages.append(np.full(rows[-1], a, dtype=np.float32))
            # Rows whose every generated token came from the current weights: their whole context was then
            # computed by them too (the engine drops cached prefixes at a swap), so any difference between
            # the engine's logprobs and ours is numerical. A row that spanned a swap is off-policy instead.
            fresh.append(np.full(rows[-1], bool((seg.versions[seg.loss_mask] == self.version).all())))
            temperature.append(np.full(rows[-1], seg.temperature, dtype=np.float32))
        prefix, calls = forward_calls([seg for seg, _ in micro], routing is not None, self.shared_run_min_tokens,
                                      self.call_overhead_tokens)
        arrays = {"targets": targets, "behaviour": behaviour, "advantages": advantages, "fresh": fresh,
                  "temperature": temperature}
        dev = self.device
        trained_at = [torch.nonzero(where[rows, q:width].flatten())[:, 0].to(dev) for rows, q, width, _ in calls]
        return MicroBatch(ids_BT=ids.to(dev), routing_BTLK=None if routing is None else routing.to(dev), prefix=prefix,
                          calls=calls, trained_at=trained_at, rows=rows,
                          **{k: torch.from_numpy(np.concatenate(x)).to(dev) for k, x in arrays.items()})

    def _logprobs(self, batch: MicroBatch, model: Qwen3ForCausalLM | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprob of each trained target [N], log-distribution there [N, V]), replaying the recorded routing:
        the KL's reference too, so the KL is to the base on the experts the rollout chose (the base routing itself
        lifted held-out pass@1 less, BENCHMARKS.md learn, "The KL reference's routing").

        The micro-batch's shared prefix runs once (one row); each run of rows sharing a longer prompt records
        the rest of it once (one row continuing the prefix); the rows continue from their run's prompt. The
        LM head and softmax run only where a token is trained.
        """
        model = model or self.model
        ids, routing, P = batch.ids_BT, batch.routing_BTLK, batch.prefix

        def forward(rows: list[int], start: int, end: int, prefix: SharedPrefix | None) -> torch.Tensor:
            # Positions follow from the prefix (start..end-1); the routing was checked on the host (`_batch`).
            at = slice(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1)) else rows
            return model.hidden_states(ids[at, start:end], shared_prefix=prefix, check_replay=False,
                                       replay_routing=None if routing is None else routing[at, start:end])[0]

        shared = None
        trained: list[torch.Tensor | None] = [None] * len(batch.rows)  # each row's trained positions' states
        with self._autocast():
            if P:
                shared = SharedPrefix()
                forward([0], 0, P, shared)
            prefix = shared
            for (rows, q, width, first), at in zip(batch.calls, batch.trained_at):
                if first:  # a run's prompt beyond the shared prefix, computed once for its calls
                    prefix = shared
                    if q > P:
                        prefix = SharedPrefix() if shared is None else shared.extended()
                        forward(rows[:1], P, q, prefix)
                hidden_NC = forward(rows, q, width, prefix).flatten(0, 1)[at]
                for b, states in zip(rows, hidden_NC.split([batch.rows[b] for b in rows])):
                    trained[b] = states
            logits_NV = model.lm_head(torch.cat(trained))
        logits_NV = logits_NV.float() / batch.temperature[:, None]
        logp_NV = torch.log_softmax(logits_NV, dim=-1)
        return logp_NV.gather(-1, batch.targets[:, None])[:, 0], logp_NV

    @torch.no_grad()
    def _logprobs_no_grad(self, items: list[tuple[Segment, float]]) -> dict[int, torch.Tensor]:
        """Proximal logprobs (current weights) of each segment's trained tokens, keyed by id(segment)."""
        out = {}
        for micro in pack_micro_batches(items, self.micro_batch_tokens, self._replays):
            batch = self._batch(micro)
            lp, _ = self._logprobs(batch)
            for (seg, _), part in zip(micro, lp.split(batch.rows)):
                out[id(seg)] = part
        return out

    def _micro_step(self, micro: list[tuple[Segment, float]], num_tokens: int, prox: dict[int, torch.Tensor],
                    record_prox: bool = False) -> tuple[dict[str, float], tuple[int, float, float], tuple[int, int]]:
        """Forward, loss, backward of one micro-batch: (metric sums, (fresh tokens, their k3 sum, max |diff|),
        (input positions computed, padded)). record_prox: the weights are the step start's, so this forward's
        logprobs, detached, are the proximal ones; they are stored in `prox` for later epochs."""
        batch = self._batch(micro)
        new_lp, logp = self._logprobs(batch)
        if record_prox:
            prox_lp = new_lp.detach()
            prox.update({id(seg): part for (seg, _), part in zip(micro, prox_lp.split(batch.rows))})
        else:
            prox_lp = torch.cat([prox[id(seg)] for seg, _ in micro])
        ref_lp = None
        if self.reference is not None and self.config.kl_coef > 0:
            with torch.no_grad():
                ref_lp, _ = self._logprobs(batch, self.reference)
        with torch.set_grad_enabled(bool(self.config.entropy_coef)):
            entropy_N = -(logp.exp() * logp).sum(-1)
        loss, sums = policy_loss(new_lp, prox_lp, batch.behaviour, batch.advantages, num_tokens, self.loss_config,
                                 ref_lp, entropy_N)
        loss.backward()
        with torch.no_grad():
            entropy = entropy_N.detach().sum()
            recomputed, engine = prox_lp[batch.fresh], batch.behaviour[batch.fresh]
            fresh_stats = (int(batch.fresh.sum()), float(k3(engine, recomputed).sum()),
                           float((recomputed - engine).abs().max()) if batch.fresh.any() else 0.0)
        metrics = {"loss": float(loss.detach()) * num_tokens, "entropy": float(entropy),
                   **{k: float(v) for k, v in sums.items()}}
        return metrics, fresh_stats, batch.positions


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint under run_dir/checkpoints (incomplete ones never have the name)."""
    ckpts = numbered_checkpoints(Path(run_dir) / "checkpoints", "v-")
    return ckpts[-1] if ckpts else None
