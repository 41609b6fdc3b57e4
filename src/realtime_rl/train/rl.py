"""The RL trainer: one optimizer step per batch of rewarded episodes, with router replay (R3).

    trainer = RLTrainer.open(run_dir, base_checkpoint, RLConfig())  # resumes from run_dir when it can
    metrics = trainer.step(episodes)       # GRPO advantages per group, decoupled PPO, TIS/IcePop
    trainer.save()                         # HF checkpoint + trainer_state.pt (optimizer, version, consumed ids)
    engine.update_weights(trainer.weights(), trainer.version)

A step, top to bottom: advantages per group (episodes sharing a group_id); every segment of an
episode becomes its own training sequence carrying the episode's advantage (self-summarised episodes
train each context window separately); segments are packed into micro-batches of at most
`micro_batch_tokens` padded tokens; each micro-batch runs one full-sequence forward that replays
the routing the engine recorded (so training sees the experts inference used), the loss of losses.py
on the generated tokens, and a backward; then one clipped AdamW step. The proximal policy is the
current weights: with one minibatch and one epoch it equals the policy being optimised at the
forward, so no extra pass is needed; otherwise a no-grad pass computes it first.

Checkpoints are written to a temporary directory and renamed, and record the policy version and, per
version, the ids of the episodes that step consumed: a trainer killed at any instant resumes from
its last checkpoint and neither retrains nor forgets an episode (the orchestrator re-feeds the
unconsumed ones from its durable log). Not here: sampling (rollout/), rewards beyond pass/fail.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from realtime_rl.config import RLConfig
from realtime_rl.model import Qwen3ForCausalLM, Tokenizer, load_checkpoint, routing_dtype, save_checkpoint
from realtime_rl.train.losses import LossConfig, group_advantages, k3, policy_loss
from realtime_rl.types import Episode, Segment

STATE_FILE = "trainer_state.pt"


def episode_reward(episode: Episode, malformed_penalty: float = 0.0) -> float:
    """The offline reward: 1 if the graded workspace passes (hidden tests included), minus a penalty
    per malformed tool call. The episode's own `reward` wins when a reward stage already set it."""
    if episode.reward is not None:
        return float(episode.reward)
    return float(bool(episode.passed)) - malformed_penalty * episode.malformed_tool_calls


def staleness(episode: Episode, version: int) -> int:
    """Versions between the trainer and the oldest token of the episode (0 when nothing was generated)."""
    oldest = min((int(s.versions[s.loss_mask].min()) for s in episode.segments if s.loss_mask.any()), default=version)
    return version - oldest


def _micro_batches(items: list[tuple[Segment, float]], max_tokens: int) -> list[list[tuple[Segment, float]]]:
    """Pack segments (longest first) so that rows x longest row <= max_tokens, one row at least."""
    items = sorted(items, key=lambda it: -len(it[0].token_ids))
    batches: list[list[tuple[Segment, float]]] = []
    for it in items:
        if batches and len(batches[-1][0][0].token_ids) * (len(batches[-1]) + 1) <= max_tokens:
            batches[-1].append(it)
        else:
            batches.append([it])
    return batches


class RLTrainer:
    def __init__(self, model: Qwen3ForCausalLM, tokenizer: Tokenizer | None, config: RLConfig, run_dir: Path,
                 version: int = 0, consumed: dict[int, list[str]] | None = None,
                 optimizer_state: dict[str, Any] | None = None, reference: Qwen3ForCausalLM | None = None) -> None:
        self.model = model.train()
        self.tokenizer = tokenizer
        self.config = config
        self.run_dir = Path(run_dir)
        self.version = version
        self.consumed: dict[int, list[str]] = dict(consumed or {})
        """version -> the ids of the episodes the step that produced it consumed."""
        self.reference = reference.eval() if reference is not None else None
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=config.lr, betas=config.betas)
        if optimizer_state is not None:
            self.optimizer.load_state_dict(optimizer_state)
        self.loss_config = LossConfig(config.clip_low, config.clip_high, config.tis_cap, config.icepop_low,
                                      config.icepop_high, config.kl_coef)
        self._route_dtype = routing_dtype(max(1, model.config.num_experts))

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
        state = torch.load(latest / STATE_FILE, weights_only=True)
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
        with open(staging / STATE_FILE, "rb") as f:
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        for old in sorted(final.parent.glob("v-*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def consumed_ids(self) -> set[str]:
        return {i for ids in self.consumed.values() for i in ids}

    def weights(self) -> dict[str, torch.Tensor]:
        """The current parameters (detached copies), for publishing to rollout engines."""
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}

    # -------------------------------------------------------------------------------- the step

    def step(self, episodes: list[Episode]) -> dict[str, float]:
        """One policy version: consume `episodes` (whole groups) and update the weights once per minibatch."""
        if not episodes:
            raise ValueError("a step needs at least one episode")
        ids = [e.episode_id for e in episodes]
        if len(set(ids)) != len(ids) or self.consumed_ids() & set(ids):
            raise ValueError("an episode was given twice (or was already consumed by an earlier step)")
        cfg = self.config
        rewards = {e.episode_id: episode_reward(e, cfg.malformed_penalty) for e in episodes}
        groups: dict[str, list[Episode]] = defaultdict(list)
        for e in episodes:
            groups[e.group_id or e.episode_id].append(e)
        items: list[tuple[Segment, float]] = []
        for members in groups.values():
            adv = group_advantages(torch.tensor([rewards[e.episode_id] for e in members]),
                                   cfg.leave_one_out, cfg.std_normalize)
            adv = torch.where(adv < 0, adv * cfg.negative_weight, adv)
            for e, a in zip(members, adv.tolist()):
                if a != 0.0:  # zero-advantage episodes carry no gradient: skip their forward
                    items += [(s, a) for s in e.segments if s.loss_mask.any()]

        stale = [staleness(e, self.version) for e in episodes]
        metrics: dict[str, float] = {
            "train/reward_mean": float(np.mean(list(rewards.values()))),
            "train/pass_rate": float(np.mean([bool(e.passed) for e in episodes])),
            "train/episodes": float(len(episodes)),
            "train/groups": float(len(groups)),
            "train/groups_with_signal": float(sum(len({rewards[e.episode_id] for e in m}) > 1 for m in groups.values())),
            "train/generated_tokens": float(sum(s.num_generated for e in episodes for s in e.segments)),
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
        return metrics

    def _optimize(self, items: list[tuple[Segment, float]]) -> dict[str, float]:
        cfg = self.config
        lr = cfg.lr * min(1.0, (self.version + 1) / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        recompute_prox = cfg.minibatches > 1 or cfg.ppo_epochs > 1
        prox = self._logprobs_no_grad(items) if recompute_prox else None
        order = list(range(len(items)))
        totals: dict[str, float] = defaultdict(float)
        mismatch = {"tokens": 0, "k3": 0.0, "max": 0.0}  # over tokens of the current version, first pass only
        num_updates = 0
        for epoch in range(cfg.ppo_epochs):
            for mb in range(cfg.minibatches):
                chosen = order[mb :: cfg.minibatches]
                if not chosen:
                    continue
                num_tokens = sum(items[i][0].num_generated for i in chosen)
                self.optimizer.zero_grad(set_to_none=True)
                for micro in _micro_batches([(items[i][0], items[i][1]) for i in chosen], cfg.micro_batch_tokens):
                    sums, fresh = self._micro_step(micro, num_tokens, prox)
                    for k, v in sums.items():
                        totals[k] += v / num_tokens
                    if epoch == 0:  # the proximal logprobs are those of the weights at the step start
                        mismatch["tokens"] += fresh[0]
                        mismatch["k3"] += fresh[1]
                        mismatch["max"] = max(mismatch["max"], fresh[2])
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
                self.optimizer.step()
                totals["grad_norm"] += float(grad_norm)
                num_updates += 1
        out = {f"train/{k}": v / num_updates for k, v in totals.items()}
        out["train/lr"] = lr
        out["train/trained_sequences"] = float(len(items))
        if mismatch["tokens"]:
            # Engine vs trainer on tokens the current weights generated (verl/slime rollout-correction metrics):
            # with R3 in fp32 this is numerical noise; staleness shows in offpolicy_k3 instead.
            out["train/mismatch_k3"] = mismatch["k3"] / mismatch["tokens"]
            out["train/mismatch_max_abs_logprob_diff"] = mismatch["max"]
        out["train/fresh_token_fraction"] = mismatch["tokens"] / sum(s.num_generated for s, _ in items)
        return out

    def _batch(self, micro: list[tuple[Segment, float]]) -> tuple[torch.Tensor, ...]:
        """Right-padded [B, T] ids, loss mask (of targets), behaviour logprobs, advantages, versions, routing."""
        B, T = len(micro), max(len(s.token_ids) for s, _ in micro)
        ids = torch.zeros((B, T), dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.bool)
        behav = torch.zeros((B, T), dtype=torch.float32)
        adv = torch.zeros((B, T), dtype=torch.float32)
        versions = torch.full((B, T), -1, dtype=torch.long)
        routing = None
        if self.config.router_replay and self.model.num_moe_layers and micro[0][0].routing is not None:
            L, k = micro[0][0].routing.shape[1:]
            routing = torch.zeros((B, T, L, k), dtype=self._route_dtype)
        for b, (seg, a) in enumerate(micro):
            n = len(seg.token_ids)
            ids[b, :n] = torch.from_numpy(seg.token_ids.astype(np.int64))
            mask[b, :n] = torch.from_numpy(seg.loss_mask)
            behav[b, :n] = torch.from_numpy(seg.logprobs.astype(np.float32))
            adv[b, :n] = a
            versions[b, :n] = torch.from_numpy(seg.versions.astype(np.int64))
            if routing is not None:
                if seg.routing is None:
                    raise ValueError("router replay is on but a segment has no recorded routing")
                routing[b, :n] = torch.from_numpy(seg.routing.astype(np.int64)).to(self._route_dtype)
        return ids, mask, behav, adv, versions, routing

    def _forward(self, ids: torch.Tensor, routing: torch.Tensor | None, model: Qwen3ForCausalLM | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprob of ids[:, 1:] [B, T-1], logits [B, T-1, V]) from one full-sequence forward."""
        model = model or self.model
        replay = routing[:, :-1] if routing is not None else None
        logits = model(ids[:, :-1], replay_routing=replay).logits_BTV.float()
        logp = torch.log_softmax(logits, dim=-1)
        return logp.gather(-1, ids[:, 1:, None])[..., 0], logp

    @torch.no_grad()
    def _logprobs_no_grad(self, items: list[tuple[Segment, float]]) -> dict[int, torch.Tensor]:
        """Proximal logprobs (current weights) of each segment's tokens, keyed by id(segment)."""
        out = {}
        for micro in _micro_batches(items, self.config.micro_batch_tokens):
            ids, *_, routing = self._batch(micro)
            lp, _ = self._forward(ids, routing)
            for b, (seg, _) in enumerate(micro):
                out[id(seg)] = lp[b, : len(seg.token_ids) - 1]
        return out

    def _micro_step(self, micro: list[tuple[Segment, float]], num_tokens: int, prox: dict[int, torch.Tensor] | None
                    ) -> tuple[dict[str, float], tuple[int, float, float]]:
        """Forward, loss, backward of one micro-batch: (metric sums, (fresh tokens, their k3 sum, max |diff|))."""
        ids, mask, behav, adv, versions, routing = self._batch(micro)
        new_lp, logp = self._forward(ids, routing)
        target_mask = mask[:, 1:]
        if prox is None:
            prox_lp = new_lp.detach()
        else:
            prox_lp = torch.zeros_like(new_lp)
            for b, (seg, _) in enumerate(micro):
                prox_lp[b, : len(seg.token_ids) - 1] = prox[id(seg)]
        ref_lp = None
        if self.reference is not None and self.config.kl_coef > 0:
            with torch.no_grad():
                ref_lp, _ = self._forward(ids, routing, self.reference)
            ref_lp = ref_lp[target_mask]
        loss, sums = policy_loss(new_lp[target_mask], prox_lp[target_mask], behav[:, 1:][target_mask],
                                 adv[:, 1:][target_mask], num_tokens, self.loss_config, ref_lp)
        loss.backward()
        with torch.no_grad():
            p = logp[target_mask].exp()
            entropy = -(p * logp[target_mask]).sum(-1).sum()
            # Rows whose every generated token came from the current weights: their whole context was then
            # computed by them too (the engine drops cached prefixes at a swap), so any difference between
            # the engine's logprobs and ours is numerical. A row that spanned a swap is off-policy instead.
            row_fresh = torch.tensor([bool((seg.versions[seg.loss_mask] == self.version).all()) for seg, _ in micro])
            fresh = row_fresh[:, None].expand_as(target_mask)[target_mask]
            recomputed, engine = prox_lp[target_mask][fresh], behav[:, 1:][target_mask][fresh]
            fresh_stats = (int(fresh.sum()), float(k3(engine, recomputed).sum()),
                           float((recomputed - engine).abs().max()) if fresh.any() else 0.0)
        metrics = {"loss": float(loss.detach()) * num_tokens, "entropy": float(entropy),
                   **{k: float(v) for k, v in sums.items()}}
        return metrics, fresh_stats


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint under run_dir/checkpoints (incomplete ones never have the name)."""
    ckpts = sorted((Path(run_dir) / "checkpoints").glob("v-*"))
    return ckpts[-1] if ckpts else None
