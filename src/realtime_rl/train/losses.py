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

    loss = -sum_t is_t * min(ratio_t * A_t, clip(ratio_t) * A_t) / num_tokens + kl_coef * kl(new, ref)
                (for A_t < 0 the term is also bounded below at dual_clip * A_t: the dual clip)
           - entropy_coef * H_t / num_tokens       (H_t: the new policy's entropy at t; masked as IcePop masks)

The KL term is a per-token function of d = ref_t - new_t on the policy's own tokens, and which divergence
its gradient descends depends on the function, not on what its value estimates (Tang & Munos 2025). At each
position, given the sampled context, k3 = exp(d) - 1 - d (GRPO's, verl's "low_var_kl", the default) has the
expected gradient of KL(ref || new) over the next token, the forward, mass-covering direction: it pulls
probability back onto tokens the reference likes and the policy left; k2 = d^2 / 2 has that of KL(new || ref),
the reverse. Neither is the gradient of the sequence-level KL, which would also move earlier tokens for the
contexts they lead to (the future log-ratios, as a reward-to-go). The logged `kl_ref` is the k3 value either
way: an estimate of the sequence-level KL(new || ref), per token.

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

import math
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


def pass_at_k_advantages(rewards_G: torch.Tensor, k: int, std_normalize: bool = True,
                         eps: float = 1e-6) -> torch.Tensor:
    """Advantages for the best of k episodes instead of each episode (pass@k training: Chen et al. 2025,
    "Pass@k Training for Adaptively Balancing Exploration and Exploitation"; Walder & Karkhanis 2025, PKPO).

    The objective is the expected max reward of k episodes drawn from the group without replacement (pass@k
    for 0/1 rewards). Episode i's advantage is what a k-subset holding it scores, in expectation, minus what
    any k-subset scores: A_i = E[max S | i in S] - E[max S]; std_normalize divides by the std of max S over
    the subsets. Exact, from the sorted rewards (no enumeration): the max of a random k-subset is the j-th
    smallest reward with probability C(j-1, k-1) / C(G, k). The advantages sum to 0.

    With 0/1 rewards and P passes of G this is Chen et al.'s closed form: a pass gets (1 - p_k) / sigma, a
    failure (1 - p_k - C(G-P-1, k-1) / C(G-1, k-1)) / sigma, p_k = 1 - C(G-P, k) / C(G, k). Two reward
    levels leave one zero-sum shape, so within a group these are GRPO's advantages times a factor that falls
    as the passes rise (G = 8, k = 4: 0.40 at one pass, 0.32, 0.23, 0.13 at four, 0 above G - k, where every
    k-subset holds a pass): the step leans on the tasks the policy rarely solves. k = 1 is the mean baseline
    over the population std. Where a loop grades the best of several fresh attempts (the agent loop's
    `attempts`, `rtrl bench learn`'s evaluation), this trains what is measured.
    """
    rewards_G = rewards_G.double()
    G = rewards_G.numel()
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    k = min(k, G)
    if G < 2 or bool(rewards_G.max() == rewards_G.min()):
        return torch.zeros(G)
    order = torch.argsort(rewards_G, stable=True)
    r = rewards_G[order]  # ascending
    p_max = torch.tensor([math.comb(j - 1, k - 1) for j in range(1, G + 1)], dtype=torch.float64) / math.comb(G, k)
    baseline = (p_max * r).sum()
    sigma = torch.sqrt((p_max * (r - baseline) ** 2).sum())
    if bool(sigma <= eps):  # every k-subset scores the same (e.g. each holds a pass)
        return torch.zeros(G)
    if k == 1:
        expected = r
    else:
        # E[max S | i in S]: the other k - 1 come from the G - 1 others; the max of those is the m-th smallest of
        # them with probability C(m-1, k-2) / C(G-1, k-1), and S's max is the larger of it and r_i.
        p_other = torch.tensor([math.comb(m - 1, k - 2) for m in range(1, G)], dtype=torch.float64)
        p_other = p_other / math.comb(G - 1, k - 1)
        expected = torch.stack([(p_other * torch.maximum(torch.cat([r[:i], r[i + 1:]]), r[i])).sum()
                                for i in range(G)])
    adv = expected - baseline
    if std_normalize:
        adv = adv / (sigma + eps)
    out = torch.empty_like(adv)
    out[order] = adv
    return out.float()


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


K3_CLAMP_D, K3_CLAMP = 20.0, 10.0
"""k3 clamps d to +-20 and its value to 10 (as verl's low_var_kl): a token the policy has made far less likely than
the reference (d = 11.5: gradient 1 - e^d, about -1e5) would otherwise set the direction of the whole clipped update,
and past d ~ 88 make it infinite. Such a token then adds a constant, no gradient."""


def k3(logp_sample: torch.Tensor, logp_other: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(sample || other) per token, from tokens drawn from `sample`:
    exp(d) - 1 - d with d = logp_other - logp_sample (clamped: K3_CLAMP). Non-negative, unbiased, low variance.
    As a loss term its expected gradient with respect to logp_sample is that of KL(other || sample) at each
    position, given the context (module docstring)."""
    d = torch.clamp(logp_other - logp_sample, -K3_CLAMP_D, K3_CLAMP_D)
    return torch.clamp(torch.expm1(d) - d, max=K3_CLAMP)


def k2(logp_sample: torch.Tensor, logp_other: torch.Tensor) -> torch.Tensor:
    """d^2 / 2 with d = logp_other - logp_sample per token: as a loss term on tokens drawn from `sample`,
    its expected gradient is that of KL(sample || other) at each position, given the context."""
    return 0.5 * (logp_other - logp_sample) ** 2


KL_ESTIMATORS = {"k3": k3, "k2": k2}


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 2.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    kl_estimator: str = "k3"
    dual_clip: float | None = 3.0


def policy_loss(new_N: torch.Tensor, prox_N: torch.Tensor, behav_N: torch.Tensor, adv_N: torch.Tensor,
                num_tokens: int, cfg: LossConfig, ref_N: torch.Tensor | None = None,
                entropy_N: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The summed (not yet averaged) loss of N generated tokens, divided by the step's num_tokens.

    entropy_N: the new policy's entropy at each token (with gradient), needed when cfg.entropy_coef != 0.
    Returns (loss, sums) where sums are per-metric token sums (clipped, masked, k3 of behaviour vs
    proximal, KL to the reference) over all N tokens, to be divided by the step's token count (every token
    trained, not num_tokens: with entropy_coef set, zero-advantage episodes' tokens are summed too).
    """
    prox_N = prox_N.detach()
    with torch.no_grad():
        is_N = torch.exp(prox_N - behav_N)
        keep_N = (is_N >= cfg.icepop_low) & (is_N <= cfg.icepop_high)
        weight_N = torch.clamp(is_N, max=cfg.tis_cap) * keep_N
    ratio_N = torch.exp(new_N - prox_N)
    clipped_N = torch.clamp(ratio_N, 1 - cfg.clip_low, 1 + cfg.clip_high)
    surrogate_N = torch.minimum(ratio_N * adv_N, clipped_N * adv_N)
    if cfg.dual_clip is not None:  # dual clip (Ye et al. 2020): a negative advantage's term is bounded below too
        surrogate_N = torch.where(adv_N < 0, torch.maximum(surrogate_N, cfg.dual_clip * adv_N), surrogate_N)
    loss = -(weight_N * surrogate_N).sum() / num_tokens
    kl_sum = torch.zeros((), device=new_N.device)
    if ref_N is not None and cfg.kl_coef > 0:
        ref_N = ref_N.detach()  # tokens were drawn (approximately) from the current policy
        kl_N = KL_ESTIMATORS[cfg.kl_estimator](new_N, ref_N)
        kl_sum = (k3(new_N.detach(), ref_N) * keep_N).sum()  # the metrics count the tokens the loss counts
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
