"""The RL objective: advantages, decoupled PPO with TIS and IcePop, k3."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from realtime_rl.train import LossConfig, group_advantages, k3, pass_at_k_advantages, policy_loss
from realtime_rl.train.losses import KL_ESTIMATORS, length_normalized


def test_group_advantages_mean_and_leave_one_out():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    mean_adv = group_advantages(r, std_normalize=False)
    torch.testing.assert_close(mean_adv, r - 0.6)
    loo = group_advantages(r, leave_one_out=True, std_normalize=False)
    for i in range(5):  # r_i minus the mean of the others
        others = torch.cat([r[:i], r[i + 1:]]).mean()
        assert loo[i].item() == pytest.approx((r[i] - others).item())
    normed = group_advantages(r)
    assert normed.mean().abs() < 1e-6 and normed.std().item() == pytest.approx(1.0, rel=1e-3)


def test_equal_rewards_give_no_signal():
    assert group_advantages(torch.ones(4)).abs().max() == 0
    assert group_advantages(torch.tensor([3.0])).abs().max() == 0


def test_equal_rewards_give_exactly_zero_whatever_the_rounding_of_their_mean():
    """Groups of 6 rewards of 1.2 (say) have a float32 mean one ulp off, which std normalisation blew up into
    advantages near +-1 of one sign for the whole group (228 of these 378 groups did)."""
    for size in range(2, 65):
        for reward in (0.1, 0.2, 0.3, 0.7, 1.2, -0.6):
            for loo in (False, True):
                adv = group_advantages(torch.full((size,), reward), leave_one_out=loo)
                assert adv.abs().max() == 0, (size, reward, loo)


def _best_of_k_by_enumeration(rewards: list[float], k: int) -> list[float]:
    subsets = list(itertools.combinations(range(len(rewards)), k))
    best = {s: max(rewards[i] for i in s) for s in subsets}
    mean = sum(best.values()) / len(subsets)
    std = math.sqrt(sum((b - mean) ** 2 for b in best.values()) / len(subsets))
    return [(sum(b for s, b in best.items() if i in s) / math.comb(len(rewards) - 1, k - 1) - mean) / std
            for i in range(len(rewards))]


@pytest.mark.parametrize(("size", "k"), [(8, 4), (8, 2), (6, 3), (8, 1), (5, 4)])
def test_pass_at_k_advantages_are_the_best_of_k_subsets_enumerated(size, k):
    rewards = torch.randn(size, generator=torch.Generator().manual_seed(size * 10 + k))
    rewards[1] = rewards[0]  # a tie
    adv = pass_at_k_advantages(rewards, k)
    assert adv.tolist() == pytest.approx(_best_of_k_by_enumeration(rewards.tolist(), k), rel=1e-4, abs=1e-5)
    assert float(adv.sum()) == pytest.approx(0.0, abs=1e-5)


def test_pass_at_k_on_pass_fail_rewards_is_the_closed_form():
    factors = []
    for passes in range(1, 8):
        rewards = torch.tensor([1.0] * passes + [0.0] * (8 - passes))
        adv = pass_at_k_advantages(rewards, 4)
        p_k = 1 - math.comb(8 - passes, 4) / math.comb(8, 4)
        if passes > 8 - 4:  # every 4 of the 8 hold a pass: nothing to learn
            assert adv.abs().max() == 0
            continue
        sigma = math.sqrt(p_k * (1 - p_k))
        fail = (1 - p_k - math.comb(8 - passes - 1, 3) / math.comb(7, 3)) / sigma
        assert adv[0] == pytest.approx((1 - p_k) / sigma, rel=1e-4)
        assert adv[-1] == pytest.approx(fail, rel=1e-4)
        factors.append(float(adv[0] / group_advantages(rewards)[0]))
        assert adv.tolist() == pytest.approx((group_advantages(rewards) * factors[-1]).tolist(), rel=1e-4)
    # two reward levels: GRPO's shape, scaled down as the group passes more
    assert factors == sorted(factors, reverse=True) and factors[0] == pytest.approx(0.404, abs=1e-3)


def test_pass_at_k_equal_rewards_and_k_of_the_whole_group_give_no_signal():
    assert pass_at_k_advantages(torch.ones(8), 4).abs().max() == 0
    assert pass_at_k_advantages(torch.tensor([0.3, 1.0, 0.0]), 3).abs().max() == 0  # one subset: the group
    assert pass_at_k_advantages(torch.tensor([0.3, 1.0, 0.0]), 9).abs().max() == 0  # k clipped to the group
    with pytest.raises(ValueError, match="k must be at least 1"):
        pass_at_k_advantages(torch.ones(4), 0)


def test_episode_aggregation_weighs_each_episode_the_same_whatever_its_length():
    # one pass (16 tokens) and three failures that ran long (64 tokens each)
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]))
    tokens = torch.tensor([16, 64, 64, 64])
    assert (adv * tokens).sum() < 0  # token-level: on balance the group pushes its shared tokens down
    scaled = length_normalized(adv, tokens)
    assert (scaled * tokens).sum().abs() < 1e-5  # episode-level: a zero-sum group stays zero-sum
    assert torch.allclose(scaled * tokens, adv * tokens.float().mean())
    assert torch.equal(length_normalized(adv, torch.full((4,), 7)), adv)  # equal lengths: unchanged
    with pytest.raises(ValueError, match="generated tokens"):
        length_normalized(adv, torch.tensor([16, 0, 64, 64]))


def test_k3_is_nonnegative_and_zero_on_equal():
    a = torch.randn(100)
    b = a + 0.3 * torch.randn(100)
    assert (k3(a, b) >= 0).all()
    assert k3(a, a).abs().max() == 0


def test_k3_is_clamped_so_one_collapsed_token_cannot_dominate_or_overflow():
    from realtime_rl.train.losses import K3_CLAMP

    new = torch.tensor([-12.0, -100.0, -0.5]).requires_grad_(True)
    ref = torch.tensor([-0.5, -0.5, -0.6])
    value = k3(new, ref)
    assert torch.isfinite(value).all() and value[0] == value[1] == K3_CLAMP  # e^99.5 used to be inf
    value.sum().backward()
    assert new.grad[0] == new.grad[1] == 0 and new.grad[2] != 0  # past the clamp: a constant, no gradient


def test_dual_clip_bounds_a_negative_advantages_term_where_the_ratio_has_run_away():
    prox = torch.log(torch.tensor([0.1, 0.1, 0.1]))
    new = prox + torch.log(torch.tensor([10.0, 2.0, 10.0]))  # ratios 10, 2, 10
    adv = torch.tensor([-1.0, -1.0, 1.0])
    grad, _ = _grad(new, prox, prox, adv)
    assert grad[0] == 0  # 10 x -1 is past 3 x -1: bounded, no gradient
    assert grad[1] != 0  # ratio 2: 2 x -1 is inside the dual bound
    assert grad[2] == 0  # a positive advantage past 1 + clip_high: PPO's clip, as before
    free, _ = _grad(new, prox, prox, adv, LossConfig(dual_clip=None))
    assert free[0] != 0


def _grad(new, prox, behav, adv, cfg=LossConfig()):
    new = new.clone().requires_grad_(True)
    loss, sums = policy_loss(new, prox, behav, adv, num_tokens=new.numel(), cfg=cfg)
    loss.backward()
    return new.grad, sums


def test_on_policy_gradient_raises_logprob_of_positive_advantage_tokens():
    lp = torch.log(torch.tensor([0.2, 0.5, 0.3]))
    grad, sums = _grad(lp, lp, lp, torch.tensor([1.0, -1.0, 0.0]))
    assert grad[0] < 0 and grad[1] > 0 and grad[2] == 0  # descending the loss raises token 0, lowers token 1
    assert sums["clip_fraction"] == 0 and sums["icepop_masked_fraction"] == 0 and sums["offpolicy_k3"] == 0


def test_ppo_clip_stops_the_gradient_past_the_band():
    prox = torch.log(torch.tensor([0.2, 0.2]))
    new = prox + torch.tensor([0.5, 0.1])  # ratios 1.65 (past 1 + 0.28) and 1.1 (inside)
    grad, sums = _grad(new, prox, prox, torch.tensor([1.0, 1.0]))
    assert grad[0] == 0 and grad[1] != 0
    assert sums["clip_fraction"] == 1


def test_icepop_masks_and_tis_truncates_off_policy_tokens():
    prox = torch.log(torch.tensor([0.5, 0.5, 0.5]))
    behav = prox - torch.log(torch.tensor([1.0, 1.8, 3.0]))  # behaviour->proximal weights 1, 1.8, 3
    cfg = LossConfig(tis_cap=1.5, icepop_low=0.5, icepop_high=2.0)
    grad, sums = _grad(prox, prox, behav, torch.ones(3), cfg)
    assert grad[2] == 0  # weight 3 is outside [0.5, 2]: masked
    assert grad[1].item() == pytest.approx(1.5 * grad[0].item())  # weight 1.8 truncated at 1.5
    # The masked token is truncated by nothing the loss uses: the metrics count the tokens the loss counts.
    assert sums["icepop_masked_fraction"] == 1 and sums["tis_truncated_fraction"] == 1


def test_kl_to_reference_pulls_back():
    new = torch.log(torch.tensor([0.6, 0.4]))
    ref = torch.log(torch.tensor([0.3, 0.7]))
    x = new.clone().requires_grad_(True)
    loss, sums = policy_loss(x, new, new, torch.zeros(2), 2, LossConfig(kl_coef=1.0), ref)
    loss.backward()
    assert sums["kl_ref"] > 0
    assert x.grad[0] > 0 and x.grad[1] < 0  # descent lowers the token the reference likes less


@pytest.mark.parametrize("estimator", ["k3", "k2"])
def test_each_kl_estimator_descends_the_divergence_it_names(estimator):
    """On the policy's own tokens (sampled, not differentiated through), the k3 term's expected gradient is
    that of KL(ref || policy), the k2 term's that of KL(policy || ref): exact over a 5-token distribution."""
    logits = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([1.0, 0.5, -0.5, 0.2, 0.0], dtype=torch.float64), -1)
    logp = torch.log_softmax(logits, -1)
    cfg = LossConfig(kl_coef=1.0, kl_estimator=estimator)
    loss, sums = policy_loss(logp, logp.detach(), logp.detach(), torch.zeros(5), 1, cfg, ref)
    expected_grad, = torch.autograd.grad(  # the expectation: each token's term weighted by its probability
        (logp.exp().detach() * KL_ESTIMATORS[estimator](logp, ref)).sum(), logits, retain_graph=True)
    p, q = logp.exp(), ref.exp()
    divergence = (q * (ref - logp)).sum() if estimator == "k3" else (p * (logp - ref)).sum()
    true_grad, = torch.autograd.grad(divergence, logits, retain_graph=True)
    torch.testing.assert_close(expected_grad, true_grad)
    other = (p * (logp - ref)).sum() if estimator == "k3" else (q * (ref - logp)).sum()
    assert not torch.allclose(torch.autograd.grad(other, logits, retain_graph=True)[0], true_grad, atol=1e-3)
    term, = torch.autograd.grad(loss, logits, retain_graph=True)  # policy_loss uses the estimator asked for
    torch.testing.assert_close(term, torch.autograd.grad(KL_ESTIMATORS[estimator](logp, ref).sum(), logits)[0])
    torch.testing.assert_close(sums["kl_ref"], k3(logp, ref).sum().detach())  # the logged value: k3 either way


@pytest.mark.parametrize("coef", [-0.5, 0.5])
def test_the_entropy_term_sharpens_or_spreads_the_distribution(coef):
    """A negative entropy_coef moves probability onto the likeliest token; a positive one away from it. Zero
    advantages: the entropy term is the whole step."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], requires_grad=True)
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    lp = logp[:, 0]
    loss, _ = policy_loss(lp, lp.detach(), lp.detach(), torch.zeros(1), 1, LossConfig(entropy_coef=coef),
                          entropy_N=entropy)
    loss.backward()
    with torch.no_grad():
        stepped = torch.softmax(logits - 0.5 * logits.grad, -1)
        after = -(stepped * stepped.log()).sum()
    assert (after < entropy if coef < 0 else after > entropy)
    assert (stepped[0, 0] > logp.exp()[0, 0]) == (coef < 0)
    with pytest.raises(ValueError, match="no entropy"):
        policy_loss(lp, lp.detach(), lp.detach(), torch.zeros(1), 1, LossConfig(entropy_coef=coef))
