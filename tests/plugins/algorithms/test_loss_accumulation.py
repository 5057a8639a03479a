"""Loss terms split over micro-batches with the mini-batch's counts add up to the loss of the whole
mini-batch, for every loss and aggregation mode; the GSPO ratio is clamped on both sides; documented
defaults are the values the formulas use. (Gaps found by scripts/mutation.py in functional.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from rlx.plugins.algorithms import functional as F

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float32)
    def rand():
        return torch.randn(4, 4, generator=g, dtype=torch.float64)
    return {"a": rand(), "b": rand() * 0.3, "c": rand(), "mask": mask.double()}


def losses(name: str, d: dict, rows: slice, **counts) -> torch.Tensor:
    m = d["mask"][rows]
    if name == "gspo":
        return F.gspo_policy_loss(d["a"][rows] * 0.3, d["b"][rows], d["c"][rows], m, **counts)[0]
    if name == "ppo":
        return F.ppo_policy_loss(d["a"][rows] * 0.3, d["b"][rows], d["c"][rows], m, **counts)[0]
    return F.value_loss(d["a"][rows], d["b"][rows], d["c"][rows], m, clip_range=0.1, **counts)[0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["ppo", "gspo", "value"])
def test_micro_batch_losses_with_mini_batch_counts_sum_to_the_whole(name, mode):
    d = batch()
    # max_len 6 > the padded width 4: Dr. GRPO divides by data.max_response_length, not the batch's width
    whole = losses(name, d, slice(0, 4), agg_mode=mode, max_len=6)
    counts = {"num_tokens": float(d["mask"].sum()), "num_seqs": 4, "max_len": 6}
    parts = [losses(name, d, rows, agg_mode=mode, **counts) for rows in (slice(0, 1), slice(1, 3), slice(3, 4))]
    torch.testing.assert_close(sum(parts), whole, rtol=1e-10, atol=1e-12)
    # Without the counts each part is normalised by its own size: a different (wrong) total.
    alone = sum(losses(name, d, rows, agg_mode=mode) for rows in (slice(0, 1), slice(1, 3), slice(3, 4)))
    assert not torch.allclose(alone, whole)


def test_documented_defaults_are_the_ones_used():
    d = batch(1)
    rewards, values, mask = d["a"], d["b"], d["mask"]
    torch.testing.assert_close(F.gae_advantages(rewards, values, mask),
                               F.gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0))
    assert not torch.allclose(F.gae_advantages(rewards, values, mask)[1],
                              F.gae_advantages(rewards, values, mask, gamma=0.5, lam=1.0)[1])
    adv = d["c"]
    torch.testing.assert_close(F.gspo_policy_loss(rewards * 0.3, values, adv, mask)[0],
                               F.gspo_policy_loss(rewards * 0.3, values, adv, mask, clip_low=0.2, clip_high=0.2)[0])
    v, old, ret = d["a"], d["b"], d["c"]
    torch.testing.assert_close(F.value_loss(v, old, ret, mask)[0], F.value_loss(v, old, ret, mask, clip_range=0.2)[0])
    assert not torch.allclose(F.value_loss(v, old, ret, mask)[0], F.value_loss(v, old, ret, mask, clip_range=1.2)[0])


def test_grpo_near_equal_scores_keep_their_sign_and_stay_bounded():
    """std + eps, not std - eps: a tiny spread gives small advantages of the right sign."""
    adv, _ = F.grpo_advantages(torch.tensor([0.0, 1e-6]), torch.tensor([0, 0]), torch.ones(2, 1))
    assert adv[0, 0] < 0 < adv[1, 0] and float(adv.abs().max()) < 1.0


@pytest.mark.parametrize("mode", MODES)
def test_a_single_token_or_sequence_is_its_own_mean(mode):
    """The count floors (clamp(min=1)) only guard empty batches: one valid token is divided by one."""
    loss = torch.tensor([[2.5, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    want = {"seq-mean-token-sum-norm": 2.5 / 3}.get(mode, 2.5)
    assert float(F.agg_loss(loss, mask, mode)) == pytest.approx(want)
    assert float(F.agg_loss(loss, mask, "seq-mean-token-sum-norm", max_len=1)) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="max_len must be positive"):
        F.agg_loss(loss, mask, "seq-mean-token-sum-norm", max_len=0)


@pytest.mark.parametrize("name", ["ppo", "gspo"])
def test_policy_ratio_clamps(name):
    fn = F.ppo_policy_loss if name == "ppo" else F.gspo_policy_loss
    mask = torch.ones(1, 2, dtype=torch.float64)
    old = torch.zeros(1, 2, dtype=torch.float64)
    high, _ = fn(old + 50, old, -torch.ones(1, 2, dtype=torch.float64), mask, clip_ratio_c=None)
    low, _ = fn(old - 50, old, torch.ones(1, 2, dtype=torch.float64), mask, clip_ratio_c=None)
    if name == "ppo":  # the token log-ratio is clamped to [-20, 20]
        assert float(high) == pytest.approx(math.exp(20.0), rel=1e-9)
        assert float(low) == pytest.approx(-math.exp(-20.0), rel=1e-9)
    else:  # GSPO's sequence log-ratio only from above, at 10, as verl's
        assert float(high) == pytest.approx(math.exp(10.0), rel=1e-9)
        assert float(low) == pytest.approx(-math.exp(-50.0), rel=1e-9)


def test_argument_checks_at_their_boundaries():
    args = (torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        F.ppo_policy_loss(*args, clip_ratio_c=1.0)
    F.ppo_policy_loss(*args, clip_ratio_c=1.01)
    for bad in ({"target_kl": 0.0, "horizon": 1.0}, {"target_kl": 0.1, "horizon": 0.0}):
        with pytest.raises(ValueError, match="must be positive"):
            F.AdaptiveKLController(0.1, **bad)
    F.AdaptiveKLController(0.1, target_kl=0.1, horizon=1.0)
    lengths = torch.tensor([0, 2, 4, 5])
    torch.testing.assert_close(F.overlong_penalty(lengths, max_len=4, buffer_len=4),
                               torch.tensor([0.0, -0.5, -1.0, -1.0]))
    with pytest.raises(ValueError, match="buffer_len must be in"):
        F.overlong_penalty(lengths, max_len=4, buffer_len=5)
    assert F.overlong_penalty(lengths, max_len=4, buffer_len=0).dtype == torch.float32


def test_kl_in_reward_mean_skips_empty_responses():
    scores = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    logp = torch.tensor([[-1.0, -1.0], [-3.0, -3.0]])
    ref = torch.tensor([[-1.5, -1.5], [-1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    rewards, mean_kl = F.apply_kl_in_reward(scores, logp, ref, mask, kl_coef=0.1, estimator="k1")
    assert mean_kl == pytest.approx(0.5)  # the empty second response does not count
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.95], [0.0, 0.0]]))
