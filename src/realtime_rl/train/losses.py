"""The RL objective in one file: group-relative advantages, the decoupled PPO loss with truncated
importance sampling and IcePop masking, KL to a reference, and the mismatch/entropy metrics.

Three policies meet in one token t of a generated segment (all logprobs of the sampled token):

    behav_t   the policy that sampled it: the engine's record, possibly several versions old
    prox_t    the proximal policy: the trainer's weights when this step began (no gradient)
    new_t     the weights being optimised (gradient)

    is_t      = exp(prox_t - behav_t)   behaviour -> proximal correction (decoupled PPO, AReaL)
                truncated at tis_cap (TIS); tokens with is_t outside [icepop_low, icepop_high] are
                masked out entirely (IcePop): a token that far off-policy carries noise, not signal
    ratio_t   = exp(new_t - prox_t)     the PPO ratio, clipped to [1 - clip_low, 1 + clip_high]

    loss = -sum_t is_t * min(ratio_t * A_t, clip(ratio_t) * A_t) / num_tokens + kl_coef * k3(new, ref)
           - entropy_coef * H_t / num_tokens       (H_t: the new policy's entropy at t; masked as IcePop masks)

Aggregation is token-level (every trained token of the step weighs the same, DAPO), the divisor being
the generated-token count of the step's episodes with a non-zero advantage (rl.py runs only those: the
others carry no policy gradient; with entropy_coef set it runs every episode, for the entropy term), so
micro-batching does not change the gradient. The KL term covers the
same tokens: a group whose rewards are all equal adds nothing to the step, its KL included. Episode-level
aggregation (verl's "seq-mean-token-mean") rescales each episode's advantage by the step's mean episode
length over its own (`length_normalized`), so every episode weighs the same whatever its length.
Everything here is tensor math on [N] token vectors or [G] group vectors; the trainer (rl.py) does
the forward passes. Not here: reward shaping (rewards/), the policy forward (rl.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards_G: torch.Tensor, leave_one_out: bool = False, std_normalize: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages of one group of episodes on the same task.

    Mean baseline: A_i = r_i - mean(r). Leave-one-out (RLOO): A_i = r_i - mean(r_j, j != i), which is
    G/(G-1) times the mean-baseline advantage and unbiased. std_normalize divides by the group's std
    (GRPO); a group whose rewards are all equal gets zero advantage either way.
    """
    rewards_G = rewards_G.float()
    G = rewards_G.numel()
    if G < 2 or bool(rewards_G.max() == rewards_G.min()):  # exactly: float32 rounding of the mean is not a
        return torch.zeros_like(rewards_G)                 # signal (it gave an all-equal group one sign)
    centered = rewards_G - rewards_G.mean()
    if leave_one_out:
        centered = centered * G / (G - 1)
    if std_normalize:
        centered = centered / (rewards_G.std() + eps)
    return centered


def length_normalized(adv_E: torch.Tensor, tokens_E: torch.Tensor) -> torch.Tensor:
    """Advantages of E episodes with tokens_E generated tokens each, rescaled so that under the token-mean
    loss each episode's tokens together weigh |A| times an average episode's: A_e * mean(tokens) / tokens_e.

    Token-level aggregation lets length decide: in multi-turn agent episodes the failures that run out of
    turns generate several times the tokens of the passes, so a group whose advantages sum to zero still
    pushes down, on balance, every token the two kinds share (the tool-call format first of all).
    """
    tokens_E = tokens_E.float()
    if (tokens_E <= 0).any():
        raise ValueError("every episode given must have generated tokens")
    return adv_E * tokens_E.mean() / tokens_E


def k3(logp_sample: torch.Tensor, logp_other: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(sample || other) per token, from tokens drawn from `sample`:
    exp(d) - 1 - d with d = logp_other - logp_sample. Non-negative, unbiased, low variance."""
    d = logp_other - logp_sample
    return torch.expm1(d) - d


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 2.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0


def policy_loss(new_N: torch.Tensor, prox_N: torch.Tensor, behav_N: torch.Tensor, adv_N: torch.Tensor,
                num_tokens: int, cfg: LossConfig, ref_N: torch.Tensor | None = None,
                entropy_N: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The summed (not yet averaged) loss of N generated tokens, divided by the step's num_tokens.

    entropy_N: the new policy's entropy at each token (with gradient), needed when cfg.entropy_coef != 0.
    Returns (loss, sums) where sums are per-metric token sums (clipped, masked, k3 of behaviour vs
    proximal, KL to the reference), to be divided by num_tokens once all micro-batches are done.
    """
    prox_N = prox_N.detach()
    with torch.no_grad():
        is_N = torch.exp(prox_N - behav_N)
        keep_N = (is_N >= cfg.icepop_low) & (is_N <= cfg.icepop_high)
        weight_N = torch.clamp(is_N, max=cfg.tis_cap) * keep_N
    ratio_N = torch.exp(new_N - prox_N)
    clipped_N = torch.clamp(ratio_N, 1 - cfg.clip_low, 1 + cfg.clip_high)
    surrogate_N = torch.minimum(ratio_N * adv_N, clipped_N * adv_N)
    loss = -(weight_N * surrogate_N).sum() / num_tokens
    kl_sum = torch.zeros((), device=new_N.device)
    if ref_N is not None and cfg.kl_coef > 0:
        kl_N = k3(new_N, ref_N.detach())  # tokens were drawn (approximately) from the current policy
        kl_sum = (kl_N.detach() * keep_N).sum()  # the metrics count the tokens the loss counts
        loss = loss + cfg.kl_coef * (kl_N * keep_N).sum() / num_tokens
    if cfg.entropy_coef:
        if entropy_N is None:
            raise ValueError("entropy_coef is set but no entropy was given")
        loss = loss - cfg.entropy_coef * (entropy_N * keep_N).sum() / num_tokens
    with torch.no_grad():
        sums = {
            "clip_fraction": (((ratio_N * adv_N) != surrogate_N) & keep_N).float().sum(),
            "icepop_masked_fraction": (~keep_N).float().sum(),
            "tis_truncated_fraction": ((is_N > cfg.tis_cap) & keep_N).float().sum(),
            "offpolicy_k3": k3(behav_N, prox_N).sum(),
            "kl_ref": kl_sum,
        }
    return loss, sums
