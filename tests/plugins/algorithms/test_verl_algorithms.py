"""verl's newer algorithm choices (issue 29): the estimators opo, gpg, grpo_passk and the vectorised aliases, the
policy losses sapo, gpg, clip_cov, kl_cov, geo_mean and cispo, the KL names kl / mse / NAME+, GSPO's clamp and the
clamped ppo_kl metric.

Expected values are worked out by hand from verl's formulas and the papers (the arithmetic is written next to each
number); gradients are checked against the derivative written out by hand, in float64, with padding that holds
garbage where a mask leaves a hole.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

from rlx.plugins.algorithms import functional as F
from rlx.plugins.algorithms.base import AlgorithmOptions
from rlx.protocols import EstimatorInputs
from rlx.records import LossContext
from rlx.registry import PluginManager

D = torch.float64


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=D)


@pytest.fixture(scope="module")
def pm() -> PluginManager:
    manager = PluginManager()
    manager.load_entry_points(strict=False, disabled=[])
    return manager


def run_estimator(pm: PluginManager, name: str, scores, groups, mask, **kwargs) -> torch.Tensor:
    """The registered estimator ``name`` on outcome rewards; returns the advantages (B, R)."""
    mask = t(mask)
    scores = t(scores)
    rewards = F.scores_to_token_rewards(scores, mask)
    inputs = EstimatorInputs(response_mask=mask, scores=scores, token_level_rewards=rewards,
                             group_index=torch.tensor(groups), **kwargs)
    adv, ret = pm.get("advantage", name).load_factory()(inputs)
    assert torch.equal(adv, ret)
    assert torch.all(adv[mask == 0] == 0)
    return adv


def per_response(adv: torch.Tensor, mask) -> list[float]:
    """The advantage each response carries (the same on each of its tokens)."""
    mask = t(mask).bool()
    out = []
    for row, m in zip(adv, mask, strict=True):
        values = row[m]
        assert torch.all(values == values[0]) if values.numel() else True
        out.append(float(values[0]) if values.numel() else 0.0)
    return out


# --------------------------------------------------------------------------------------------------
# Estimators
# --------------------------------------------------------------------------------------------------

# Group 0: three responses of 2, 4 (a hole at position 1) and 2 tokens; group 1: two responses with equal
# rewards; group 2: one response.
OPO_MASK = [[1, 1, 0, 0, 0], [1, 0, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
OPO_GROUPS = [0, 0, 0, 1, 1, 2]


def test_opo_baseline_is_the_length_weighted_mean(pm):
    adv = run_estimator(pm, "opo", [1.0, 0.0, 0.5, 2.0, 2.0, 0.7], OPO_GROUPS, OPO_MASK)
    # b_0 = (2 * 1 + 4 * 0 + 2 * 0.5) / (2 + 4 + 2) = 3 / 8; a plain mean would be 0.5
    # group 1: all equal -> exactly 0; group 2 alone: baseline 0 (verl), advantage = its reward
    assert per_response(adv, OPO_MASK) == pytest.approx([0.625, -0.375, 0.125, 0.0, 0.0, 0.7], abs=1e-12)
    assert torch.all(adv[3:5] == 0)


def test_opo_equals_grpo_without_std_when_lengths_are_equal(pm):
    mask = [[1, 1, 1]] * 4
    opo = run_estimator(pm, "opo", [0.3, 1.0, 0.0, 0.2], [0, 0, 1, 1], mask)
    drgrpo = run_estimator(pm, "grpo", [0.3, 1.0, 0.0, 0.2], [0, 0, 1, 1], mask, norm_adv_by_std=False)
    torch.testing.assert_close(opo, drgrpo, atol=1e-12, rtol=0)


def test_gpg_scales_by_batch_size_over_nonzero_rewards(pm):
    mask = [[1, 1, 0]] * 8
    scores = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    adv = run_estimator(pm, "gpg", scores, [0, 0, 0, 0, 1, 1, 1, 1], mask)
    # alpha = B / #(nonzero rewards) = 8 / 3; group 0: mean 0.5 -> +-0.5 alpha; group 1: mean 0.25
    a = 8 / 3
    expected = [0.5 * a, -0.5 * a, -0.5 * a, 0.5 * a, -0.25 * a, -0.25 * a, 0.75 * a, -0.25 * a]
    assert per_response(adv, mask) == pytest.approx(expected, abs=1e-12)


def test_gpg_singletons_and_ties(pm):
    mask = [[1, 1], [1, 0], [1, 1], [1, 1]]
    adv = run_estimator(pm, "gpg", [0.5, 1.0, 1.0, 0.0], [7, 3, 3, 9], mask)
    # alpha = 4 / 3 (three nonzero rewards); group 7 alone: mean taken as 0 (verl) -> 0.5 * 4/3; group 3 tied -> 0;
    # group 9 alone with reward 0 -> 0
    assert per_response(adv, mask) == pytest.approx([0.5 * 4 / 3, 0.0, 0.0, 0.0], abs=1e-12)
    # all rewards zero: alpha = B / max(0, 1), every advantage 0
    assert torch.all(run_estimator(pm, "gpg", [0.0, 0.0], [0, 0], [[1], [1]]) == 0)


PASSK_MASK = [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]]
PASSK_SCORES = [0.2, 0.9, 0.5, 0.1, 1.0, 0.0, 1.0, 0.4]
PASSK_GROUPS = [0, 0, 0, 0, 1, 1, 1, 2]


def test_grpo_passk_rewards_only_the_best_by_its_margin(pm):
    adv = run_estimator(pm, "grpo_passk", PASSK_SCORES, PASSK_GROUPS, PASSK_MASK, norm_adv_by_std=False)
    # group 0: best 0.9 (row 1), runner-up 0.5 -> 0.4 on row 1 only; group 1: 1.0 and 1.0 tie -> 0 everywhere;
    # group 2 alone -> 0 (verl refuses a group of one)
    assert per_response(adv, PASSK_MASK) == pytest.approx([0, 0.4, 0, 0, 0, 0, 0, 0], abs=1e-12)


def test_grpo_passk_divides_by_the_group_std(pm):
    adv = run_estimator(pm, "grpo_passk", PASSK_SCORES, PASSK_GROUPS, PASSK_MASK, norm_adv_by_std=True)
    # group 0: mean 0.425; squared deviations .050625 + .225625 + .005625 + .105625 = .3875; std = sqrt(.3875 / 3)
    std = math.sqrt(0.3875 / 3)
    assert per_response(adv, PASSK_MASK) == pytest.approx([0, 0.4 / (std + 1e-6), 0, 0, 0, 0, 0, 0], abs=1e-12)


def test_grpo_passk_breaks_ties_for_first_by_batch_order(pm):
    mask = [[1]] * 3
    adv = run_estimator(pm, "grpo_passk", [0.3, 0.8, 0.8], [0, 0, 0], mask, norm_adv_by_std=False)
    assert per_response(adv, mask) == [0.0, 0.0, 0.0]  # the top two tie: margin 0
    adv = run_estimator(pm, "grpo_passk", [0.8, 0.3, 0.1], [4, 4, 4], mask, norm_adv_by_std=False)
    assert per_response(adv, mask) == pytest.approx([0.5, 0.0, 0.0], abs=1e-12)


def test_vectorized_names_are_the_same_estimators(pm):
    for alias, name in (("grpo_vectorized", "grpo"), ("rloo_vectorized", "rloo")):
        assert pm.get("advantage", alias).load_factory() is pm.get("advantage", name).load_factory()


def test_new_estimators_are_registered_and_group_size_is_checked(pm):
    from rlx.plugins.algorithms.base import group_size_problem

    names = set(pm.names("advantage"))
    assert {"opo", "gpg", "grpo_passk", "grpo_vectorized", "rloo_vectorized"} <= names
    for name in ("grpo_passk", "grpo_vectorized", "rloo_vectorized"):
        assert group_size_problem(AlgorithmOptions(adv_estimator=name), 1) is not None
    for name in ("opo", "gpg"):  # no baseline for a group of one, as verl: they still learn
        assert group_size_problem(AlgorithmOptions(adv_estimator=name), 1) is None


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_optimal_token_baseline_validates(pm, name):
    from rlx.validate import load_config

    resolved = load_config(pm, preset="tiny", overrides=[f"algorithm.adv_estimator={name}"], check_files=False)
    assert resolved.options["algorithm"].adv_estimator == name


# --------------------------------------------------------------------------------------------------
# Policy losses: one token per row unless said otherwise, token-mean over the valid tokens
# --------------------------------------------------------------------------------------------------

def loss_and_grad(name: str, logp, old, adv, mask, **kwargs) -> tuple[float, torch.Tensor, dict[str, float]]:
    lp = t(logp).requires_grad_(True)
    mask_t = t(mask)
    # padding holds garbage: it must reach neither the value nor the gradient
    junk = torch.where(mask_t.bool(), lp, torch.full_like(lp, float("nan")))
    old_t = torch.where(mask_t.bool(), t(old), torch.full_like(lp, float("inf")))
    adv_t = torch.where(mask_t.bool(), t(adv), torch.full_like(lp, 1e30))
    loss, metrics = F.POLICY_LOSSES[name](junk, old_t, adv_t, mask_t, **kwargs)
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.isfinite(grad).all() and torch.all(grad[mask_t == 0] == 0)
    return float(loss.detach()), grad, metrics


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_sapo_soft_gate_values_and_gradients():
    # row 0: r = 1.5, A = 1 (tau_pos = 1); row 1: r = 0.5, A = -1 (tau_neg = 1.05); row 2: r = 1, A = 2; row 3 pad
    logp = [[-0.5, 0.0], [-1.0, 0.0], [-0.3, 0.0]]
    old = [[-0.5 - math.log(1.5), 0.0], [-1.0 - math.log(0.5), 0.0], [-0.3, 0.0]]
    adv = [[1.0, 0.0], [-1.0, 0.0], [2.0, 0.0]]
    mask = [[1, 0], [1, 0], [1, 0]]
    loss, grad, m = loss_and_grad("sapo", logp, old, adv, mask, agg_mode="token-mean", tau_pos=1.0, tau_neg=1.05)

    def gate(r: float, tau: float) -> float:
        return sigmoid(tau * (r - 1)) * 4 / tau

    def dgate(r: float, tau: float) -> float:  # d gate / d r = 4 s (1 - s)
        s = sigmoid(tau * (r - 1))
        return 4 * s * (1 - s)

    token_losses = [-gate(1.5, 1.0) * 1, -gate(0.5, 1.05) * -1, -gate(1.0, 1.0) * 2]
    assert loss == pytest.approx(sum(token_losses) / 3, abs=1e-12)
    # d l / d logp = -A gate'(r) r; on-policy (r = 1) gate' = 1: PPO's gradient -A
    expected = [-1 * dgate(1.5, 1.0) * 1.5 / 3, 1 * dgate(0.5, 1.05) * 0.5 / 3, -2 * 1.0 / 3]
    torch.testing.assert_close(grad[:, 0], t(expected), atol=1e-12, rtol=0)
    assert m["ppo_kl"] == pytest.approx(-(math.log(1.5) + math.log(0.5)) / 3, abs=1e-12)


def test_gpg_loss_is_minus_advantage_times_logp():
    loss, grad, _ = loss_and_grad("gpg", [[-0.5, -2.0], [-1.0, 0.0]], [[-9.0, -1.0], [0.0, 0.0]],
                                  [[1.0, -3.0], [2.0, 0.0]], [[1, 1], [1, 0]])
    assert loss == pytest.approx((0.5 * 1 + -2.0 * 3 + 1.0 * 2) / 3, abs=1e-12)  # -(A logp) summed, / 3 tokens
    torch.testing.assert_close(grad, t([[-1 / 3, 1.0], [-2 / 3, 0.0]]), atol=1e-12, rtol=0)


def test_cispo_clips_the_detached_weight_not_the_gradient():
    # row 0: r = 1.5 -> w = 1.2 (clip_high 0.2), A = 1; row 1: r = 0.5 -> w = 0.8, A = -2; row 2: r = 1.1, A = 1
    logp = [[-0.5], [-1.0], [-0.2]]
    old = [[-0.5 - math.log(1.5)], [-1.0 - math.log(0.5)], [-0.2 - math.log(1.1)]]
    loss, grad, m = loss_and_grad("cispo", logp, old, [[1.0], [-2.0], [1.0]], [[1], [1], [1]])
    assert loss == pytest.approx((-1.2 * 1 * -0.5 + -0.8 * -2 * -1.0 + -1.1 * 1 * -0.2) / 3, abs=1e-12)
    # every token keeps its gradient -w A, even the clipped ones (PPO would give rows 0 and 1 none)
    torch.testing.assert_close(grad[:, 0], t([-1.2 / 3, 1.6 / 3, -1.1 / 3]), atol=1e-12, rtol=0)
    assert m["pg_clipfrac"] == pytest.approx(2 / 3)


def test_geo_mean_clips_log_ratios_by_the_advantage_sign():
    # seq 0: A = 1, d = [0.3, -0.1, pad] -> c = [0.2 (clipped above), -0.1]; rho_0 = exp(0.05), l_0 = -exp(0.05)
    # seq 1: A = -2, d = [-0.5, 0.1, 0.0] -> c = [-0.2 (clipped below), 0.1, 0.0]; rho_1 = exp(-0.1 / 3),
    #        l_1 = 2 exp(-0.1 / 3)
    logp = [[-1.0, -1.0, 0.0], [-1.0, -1.0, -1.0]]
    old = [[-1.3, -0.9, 0.0], [-0.5, -1.1, -1.0]]
    adv = [[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0]]
    mask = [[1, 1, 0], [1, 1, 1]]
    loss, grad, m = loss_and_grad("geo_mean", logp, old, adv, mask, clip_low=0.2, clip_high=0.2,
                                  agg_mode="seq-mean-token-mean")
    l0, l1 = -math.exp(0.05), 2 * math.exp(-0.1 / 3)
    assert loss == pytest.approx((l0 + l1) / 2, abs=1e-12)
    # d l_i / d logp_t = l_i / L_i for an unclipped token (d rho / d c_t = rho / L), 0 for a clipped one; / 2 seqs
    expected = [[0.0, l0 / 2 / 2, 0.0], [0.0, l1 / 3 / 2, l1 / 3 / 2]]
    torch.testing.assert_close(grad, t(expected), atol=1e-12, rtol=0)
    assert m["pg_clipfrac_high"] == pytest.approx(1 / 5) and m["pg_clipfrac_low"] == pytest.approx(1 / 5)


def test_geo_mean_on_policy_gradient_is_the_mean_advantage():
    logp = [[-1.0, -2.0], [-0.5, -0.7]]
    _, grad, _ = loss_and_grad("geo_mean", logp, logp, [[1.0, 1.0], [-1.0, -1.0]], [[1, 1], [1, 1]])
    # rho = 1: d l_i / d logp_t = -A_i / L_i, over 2 sequences
    torch.testing.assert_close(grad, t([[-0.25, -0.25], [0.25, 0.25]]), atol=1e-12, rtol=0)


# Covariance example: A = [2, -2, 2, -2] (mean 0), logp = [-0.5, -1, -2, -0.5] (mean -1), so
# cov = (A - 0)(logp + 1) = [1, 0, -2, -1]: token 0 alone has a covariance in (0.5, 5).
COV_LOGP = [[-0.5, -1.0, -2.0, -0.5]]
COV_ADV = [[2.0, -2.0, 2.0, -2.0]]
COV_MASK = [[1, 1, 1, 1]]


def test_clip_cov_detaches_tokens_in_the_covariance_band():
    loss, grad, m = loss_and_grad("clip_cov", COV_LOGP, COV_LOGP, COV_ADV, COV_MASK, clip_cov_ratio=1.0,
                                  clip_cov_lb=0.5, clip_cov_ub=5.0)
    # on-policy, r = 1: token losses -A = [-2, 2, -2, 2], token 0 detached -> (0 + 2 - 2 + 2) / 4
    assert loss == pytest.approx(0.5, abs=1e-12)
    torch.testing.assert_close(grad, t([[0.0, 0.5, -0.5, 0.5]]), atol=1e-12, rtol=0)
    assert m["pg_covfrac"] == pytest.approx(0.25) and m["pg_clipfrac"] == 0.0


def test_clip_cov_leaves_ppo_clipped_tokens_to_ppo():
    old = [[-0.5 - math.log(1.5), -1.0, -2.0, -0.5]]  # token 0: r = 1.5 with A > 0, clipped by PPO at 1.2
    loss, grad, m = loss_and_grad("clip_cov", COV_LOGP, old, COV_ADV, COV_MASK, clip_cov_ratio=1.0,
                                  clip_cov_lb=0.5, clip_cov_ub=5.0)
    assert loss == pytest.approx((-2 * 1.2 + 2 - 2 + 2) / 4, abs=1e-12)
    torch.testing.assert_close(grad, t([[0.0, 0.5, -0.5, 0.5]]), atol=1e-12, rtol=0)  # clipped: no gradient
    assert m["pg_covfrac"] == 0.0 and m["pg_clipfrac"] == pytest.approx(0.25)


def test_clip_cov_detaches_at_most_its_share():
    # two tokens in the band (cov 1 and 1): ratio 0.25 of 4 tokens -> exactly one detached, picked at random
    adv = [[2.0, -2.0, 2.0, 2.0]]
    logp = [[-0.5, -1.0, -2.0, -0.5]]  # mean A 1: cov = [1 * .5, -3 * 0, 1 * -1, 1 * .5] = [.5, 0, -1, .5]
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        _, grad, m = loss_and_grad("clip_cov", logp, logp, adv, COV_MASK, clip_cov_ratio=0.25, clip_cov_lb=0.25,
                                   clip_cov_ub=5.0, generator=g)
        assert m["pg_covfrac"] == pytest.approx(0.25)
        assert int((grad[0, [0, 3]] == 0).sum()) == 1 and grad[0, 1] != 0 and grad[0, 2] != 0


def test_kl_cov_penalises_the_top_covariance_tokens():
    old = [[-0.7, -1.0, -2.0, -0.5]]  # token 0: log-ratio 0.2, the others on-policy
    loss, grad, m = loss_and_grad("kl_cov", COV_LOGP, old, COV_ADV, COV_MASK, kl_cov_ratio=0.25, ppo_kl_coef=0.1)
    # k = max(1, floor(0.25 * 4)) = 1: token 0 (cov 1); unclipped -A r plus 0.1 |0.2| there
    r0 = math.exp(0.2)
    assert loss == pytest.approx((-2 * r0 + 0.1 * 0.2 + 2 - 2 + 2) / 4, abs=1e-12)
    # d/dlogp_0 = -A r0 + 0.1 sign(0.2); the others -A
    torch.testing.assert_close(grad, t([[(-2 * r0 + 0.1) / 4, 0.5, -0.5, 0.5]]), atol=1e-12, rtol=0)
    assert m["pg_covfrac"] == pytest.approx(0.25)


def test_new_losses_aggregate_in_every_mode_and_take_token_weights():
    logp = t([[-0.5, -1.0, 0.0], [-0.3, -0.2, -0.9]])
    old = logp + t([[0.1, -0.05, 0.0], [0.02, 0.3, -0.1]])
    adv = t([[1.0, 1.0, 0.0], [-0.5, -0.5, -0.5]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    for name in ("sapo", "gpg", "clip_cov", "kl_cov", "cispo"):
        per_token = {}
        for mode in F.LOSS_AGG_MODES:
            per_token[mode] = float(F.POLICY_LOSSES[name](logp, old, adv, mask, agg_mode=mode, max_len=4)[0])
        # the four modes differ on these unequal lengths, and seq-mean-token-sum-norm divides by max_len
        assert per_token["seq-mean-token-sum-norm"] == pytest.approx(per_token["seq-mean-token-sum"] / 4)
        assert len({round(v, 12) for v in per_token.values()}) == 4, (name, per_token)
        w = t([[2.0, 2.0, 7.0], [2.0, 2.0, 2.0]])  # a constant weight of 2 on real tokens doubles the loss
        doubled = float(F.POLICY_LOSSES[name](logp, old, adv, mask, token_weights=w)[0])
        assert doubled == pytest.approx(2 * float(F.POLICY_LOSSES[name](logp, old, adv, mask)[0]), abs=1e-12)
    weighted = float(F.geo_mean_policy_loss(logp, old, adv, mask, token_weights=t([[2.0, 8.0, 0], [1, 1, 1]]))[0])
    plain_rows = [float(F.geo_mean_policy_loss(logp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1])[0])
                  for i in range(2)]
    assert weighted == pytest.approx((4 * plain_rows[0] + plain_rows[1]) / 2, abs=1e-12)  # geometric mean of 2, 8


def test_losses_reject_bad_knobs():
    x = t([[-1.0]])
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        F.clip_cov_policy_loss(x, x, x, t([[1]]), clip_cov_ratio=0.0)
    with pytest.raises(ValueError, match="clip_cov_lb"):
        F.clip_cov_policy_loss(x, x, x, t([[1]]), clip_cov_lb=5.0, clip_cov_ub=1.0)
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        F.kl_cov_policy_loss(x, x, x, t([[1]]), kl_cov_ratio=1.5)
    with pytest.raises(ValueError, match="tau"):
        F.sapo_policy_loss(x, x, x, t([[1]]), tau_neg=0.0)


# --------------------------------------------------------------------------------------------------
# Matching verl: GSPO's clamp, the ppo_kl metric, the KL names
# --------------------------------------------------------------------------------------------------

def test_gspo_clamps_the_sequence_log_ratio_above_at_10():
    # seq 0: mean log-ratio 12 -> ratio e^10 and no gradient; seq 1: mean log-ratio -25 -> ratio e^-25, not clamped
    logp = t([[0.0, 0.0], [0.0, 0.0]]).requires_grad_(True)
    old = t([[-12.0, -12.0], [25.0, 25.0]])
    adv = t([[-1.0, -1.0], [-1.0, -1.0]])
    mask = t([[1, 1], [1, 1]])
    loss, _ = F.gspo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    (grad,) = torch.autograd.grad(loss, logp)
    # A < 0: loss max(-A s, -A clip(s)) = s for s = e^10 and clip(s) = 0.8 for s = e^-25; seq-mean-token-mean
    assert float(loss.detach()) == pytest.approx((math.exp(10) + 0.8) / 2, rel=1e-12)
    assert torch.all(grad == 0)


def test_ppo_kl_metric_is_the_mean_of_the_clamped_log_ratio():
    logp = t([[0.0, 0.0]])
    old = t([[-30.0, 0.5]])  # log-ratios 30 (clamped to 20) and -0.5
    _, m = F.ppo_policy_loss(logp, old, t([[1.0, 1.0]]), t([[1, 1]]))
    assert m["ppo_kl"] == pytest.approx((-20.0 + 0.5) / 2, abs=1e-12)


@pytest.mark.parametrize(("name", "base"), [("kl", "k1"), ("mse", "k2")])
def test_kl_aliases(name: str, base: str):
    lp, ref, mask = t([[-0.3, -1.2, 5.0]]), t([[-0.9, -0.2, 0.0]]), t([[1, 1, 0]])
    assert torch.equal(F.kl_penalty(lp, ref, name, mask), F.kl_penalty(lp, ref, base, mask))


@pytest.mark.parametrize(("name", "base"), [("k1+", "k1"), ("k3+", "k3"), ("low_var_kl+", "low_var_kl")])
def test_straight_through_kl_has_the_value_of_one_and_the_gradient_of_k2(name: str, base: str):
    lp = t([[-0.3, -1.2, 0.0]]).requires_grad_(True)
    ref, mask = t([[-0.9, -0.2, 0.0]]), t([[1, 1, 0]])
    kl = F.kl_penalty(lp, ref, name, mask)
    torch.testing.assert_close(kl, F.kl_penalty(lp, ref, base, mask).detach(), atol=1e-15, rtol=0)
    (grad,) = torch.autograd.grad(kl.sum(), lp)
    torch.testing.assert_close(grad, t([[0.6, -1.0, 0.0]]), atol=1e-12, rtol=0)  # d = logp - ref at real tokens


# --------------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------------

def test_options_defaults_and_aggregation_defaults():
    o = AlgorithmOptions()
    assert (o.tau_pos, o.tau_neg, o.clip_cov_ratio, o.clip_cov_lb, o.clip_cov_ub, o.kl_cov_ratio, o.ppo_kl_coef) == (
        1.0, 1.05, 2e-4, 1.0, 5.0, 2e-4, 0.1)
    for name in ("sapo", "geo_mean", "gspo"):
        assert AlgorithmOptions(policy_loss=name).loss_agg_mode == "seq-mean-token-mean"
    for name in ("gpg", "clip_cov", "kl_cov", "cispo"):
        assert AlgorithmOptions(policy_loss=name).loss_agg_mode == "token-mean"
    assert AlgorithmOptions(policy_loss="sapo", tau_pos=2.0).policy_loss_knobs() == {"tau_pos": 2.0, "tau_neg": 1.05}
    assert AlgorithmOptions(policy_loss="vanilla").policy_loss_knobs() == {}
    with pytest.raises(ValidationError, match="clip_cov_lb"):
        AlgorithmOptions(clip_cov_lb=5.0, clip_cov_ub=5.0)


def test_actor_loss_hands_the_knobs_to_the_loss():
    from rlx.batch import Batch
    from rlx.plugins.algorithms.base import ActorLoss

    logp = t([[-0.5, -1.0, -2.0, -0.5]])
    old = t([[-0.7, -1.0, -2.0, -0.5]])
    mb = Batch({"response_mask": t(COV_MASK), "old_log_probs": old, "advantages": t(COV_ADV)})
    ctx = LossContext(4, 1)
    out = {"log_probs": logp, "entropy": torch.zeros_like(logp)}
    opts = AlgorithmOptions(policy_loss="kl_cov", kl_cov_ratio=0.25, ppo_kl_coef=1.0, use_kl_loss=False)
    loss, metrics = ActorLoss(opts)(out, mb, ctx)
    r0 = math.exp(0.2)
    assert float(loss) == pytest.approx((-2 * r0 + 1.0 * 0.2 + 2) / 4, abs=1e-12)  # ppo_kl_coef 1, not 0.1
    assert metrics["actor/pg_covfrac"] == pytest.approx(0.25)


def test_bad_knobs_are_config_errors_naming_the_key(tmp_path):
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    bad = ["algorithm.clip_cov_ratio=1.5", "algorithm.kl_cov_ratio=-0.1", "algorithm.tau_neg=0",
           "algorithm.ppo_kl_coef=-1", "algorithm.clip_ratio_low=-0.2", "algorithm.policy_loss=sapoo"]
    proc = subprocess.run([sys.executable, "-m", "rlx", "config", "validate", "--preset", "tiny", *bad,
                           f"trainer.output_dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    assert "Traceback" not in text
    for item in bad:
        assert item.split("=")[0] in text, (item, text)


def test_from_verl_maps_the_new_knobs(pm):
    from rlx.cli.from_verl import translate

    aa = "actor_rollout_ref.actor."
    t = translate({"algorithm.adv_estimator": "opo", aa + "policy_loss.loss_mode": "clip_cov",
                   aa + "policy_loss.clip_cov_ratio": 0.001, aa + "policy_loss.clip_cov_lb": 0.5,
                   aa + "policy_loss.clip_cov_ub": 4.0, aa + "policy_loss.kl_cov_ratio": 0.01,
                   aa + "policy_loss.ppo_kl_coef": 0.5, aa + "tau_pos": 2.0, aa + "tau_neg": 2.5,
                   "algorithm.kl_penalty": "kl", aa + "kl_loss_type": "low_var_kl+"}, pm)
    assert t.unmapped == []
    s = t.settings
    assert (s["algorithm.name"], s["algorithm.adv_estimator"], s["algorithm.policy_loss"]) == ("grpo", "opo",
                                                                                                 "clip_cov")
    assert (s["algorithm.clip_cov_ratio"], s["algorithm.clip_cov_lb"], s["algorithm.clip_cov_ub"],
            s["algorithm.kl_cov_ratio"], s["algorithm.ppo_kl_coef"], s["algorithm.tau_pos"],
            s["algorithm.tau_neg"]) == (0.001, 0.5, 4.0, 0.01, 0.5, 2.0, 2.5)
    opts = AlgorithmOptions(**{k.split(".", 1)[1]: v for k, v in s.items()
                               if k.startswith("algorithm.") and k != "algorithm.name"})
    assert opts.kl_penalty == "kl" and opts.kl_loss_type == "low_var_kl+"


def test_log_probs_and_entropy_keep_float64():
    logits = torch.tensor([[[0.0, 1e-9, 30.0], [2.0, -1.0, 0.5]]], dtype=D)
    labels = torch.tensor([[1, 0]])
    lp = F.log_probs_from_logits(logits, labels)
    assert lp.dtype == D
    # log softmax of the label, in float64: 1e-9 - logsumexp(0, 1e-9, 30); float32 would lose the 1e-9
    expected = 1e-9 - math.log(math.exp(0.0) + math.exp(1e-9) + math.exp(30.0))
    assert float(lp[0, 0]) == pytest.approx(expected, abs=1e-13)
    h = F.entropy_from_logits(logits)
    assert h.dtype == D
    p = torch.softmax(logits[0, 1], -1)
    assert float(h[0, 1]) == pytest.approx(float(-(p * p.log()).sum()), abs=1e-14)
    assert F.log_probs_from_logits(logits.float(), labels).dtype == torch.float32


# --------------------------------------------------------------------------------------------------
# Rollout correction (verl's algorithm.rollout_correction)
# --------------------------------------------------------------------------------------------------

# d = old - rollout: row 0: [0.5, -1.0, pad], row 1: [0.2, 0.1, 0.3], row 2: [-0.05, pad, pad]
RC_MASK = t([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
RC_OLD = t([[-1.0, -2.0, 9.0], [-0.5, -0.4, -0.3], [-0.2, 9.0, 9.0]])
RC_ROLLOUT = t([[-1.5, -1.0, -9.0], [-0.7, -0.5, -0.6], [-0.15, -9.0, 9.0]])


def test_rollout_is_token_and_sequence_weights():
    w, _, m = F.rollout_correction_weights(RC_OLD, RC_ROLLOUT, RC_MASK, rollout_is="token", threshold=1.5)
    want = t([[1.5, math.exp(-1.0), 0], [math.exp(0.2), math.exp(0.1), math.exp(0.3)], [math.exp(-0.05), 0, 0]])
    torch.testing.assert_close(w, want, atol=1e-12, rtol=0)
    assert m["is_clipfrac"] == pytest.approx(1 / 6) and m["is_ratio_max"] == pytest.approx(math.exp(0.5))
    # sequence: the product of each response's token ratios, exp(sum d): exp(-0.5), exp(0.6) -> capped 1.5, exp(-0.05)
    w, _, m = F.rollout_correction_weights(RC_OLD, RC_ROLLOUT, RC_MASK, rollout_is="sequence", threshold=1.5)
    want = t([[math.exp(-0.5)] * 2 + [0], [1.5] * 3, [math.exp(-0.05), 0, 0]])
    torch.testing.assert_close(w, want, atol=1e-12, rtol=0)
    assert m["is_clipfrac"] == pytest.approx(3 / 6)
    # batch-normalised: sequence weights divided by their mean over responses
    w, _, m = F.rollout_correction_weights(RC_OLD, RC_ROLLOUT, RC_MASK, rollout_is="sequence", threshold=1.5,
                                        batch_normalize=True)
    mean = (math.exp(-0.5) + 1.5 + math.exp(-0.05)) / 3
    assert m["is_batch_norm_factor"] == pytest.approx(mean, abs=1e-12)
    torch.testing.assert_close(w, want / mean, atol=1e-12, rtol=0)


def test_rollout_rejection_masks_tokens_and_sequences():
    # token_k1 band [0.5, 2]: k1 = rollout - old = -d must lie in [log 0.5, log 2] = [-0.693, 0.693]:
    # row 0 token 1 (k1 = 1.0) is rejected, the rest pass
    w, _, m = F.rollout_correction_weights(RC_OLD, RC_ROLLOUT, RC_MASK, rejection=[("token_k1", 0.5, 2.0)])
    torch.testing.assert_close(w, t([[1, 0, 0], [1, 1, 1], [1, 0, 0]]), atol=0, rtol=0)
    assert m["rs_masked_fraction"] == pytest.approx(1 / 6) and m["rs_seq_masked_fraction"] == pytest.approx(1 / 3)
    # seq_mean_k2 <= 0.02: row 0 mean of d^2/2 = (0.125 + 0.5) / 2 rejected; row 1 (0.02 + 0.005 + 0.045) / 3
    # = 0.0233 rejected; row 2 0.00125 kept
    w, _, m = F.rollout_correction_weights(RC_OLD, RC_ROLLOUT, RC_MASK, rejection=[("seq_mean_k2", None, 0.02)])
    torch.testing.assert_close(w, t([[0, 0, 0], [0, 0, 0], [1, 0, 0]]), atol=0, rtol=0)
    assert m["rs_seq_masked_fraction"] == pytest.approx(2 / 3)
    # seq_max_k3 <= 0.06, with sequence IS: k3 = e^d - 1 - d; row 1 max at d = 0.3: 0.0499 passes, row 0 at d = -1:
    # 0.368 rejected; the weights of the kept rows are the sequence weights
    w, _, _ = F.rollout_correction_weights(RC_OLD, RC_ROLLOUT, RC_MASK, rollout_is="sequence", threshold=5.0,
                                        rejection=[("seq_max_k3", None, 0.06), ("seq_sum_k1", 0.1, 10.0)])
    torch.testing.assert_close(w, t([[0, 0, 0], [math.exp(0.6)] * 3, [math.exp(-0.05), 0, 0]]), atol=1e-12, rtol=0)


def test_rejection_spec_is_parsed_and_checked():
    from rlx.plugins.algorithms.base import parse_rejection

    assert parse_rejection("token_k1", 2.0) == [("token_k1", 0.5, 2.0)]
    assert parse_rejection("token_k1, seq_max_k2", "0.8_1.25,0.01") == [("token_k1", 0.8, 1.25),
                                                                        ("seq_max_k2", None, 0.01)]
    for modes, spec, match in [("token_k1", "2_0.5", "lower bound is above"), ("token_k4", 1.0, "not one of"),
                               ("seq_max_k2", "0.1_1", "one upper bound"), ("token_k2", None, "needs"),
                               ("token_k2", "-1", "positive"), ("token_k1,token_k2", "1,2,3", "3 bounds for 2")]:
        with pytest.raises(ValueError, match=match):
            parse_rejection(modes, spec)
    with pytest.raises(ValidationError, match="lower bound is above"):
        AlgorithmOptions(rollout_correction={"rollout_rs": "token_k1", "rollout_rs_threshold": "3_2"})
    with pytest.raises(ValidationError, match="tis_cap and rollout_correction"):
        AlgorithmOptions(tis_cap=2.0, rollout_correction={"rollout_is": "token"})


def test_rollout_correction_reaches_the_actor_loss(pm):
    from rlx.batch import Batch
    from rlx.config import RLXConfig
    from rlx.context import BuildContext
    from rlx.plugins.algorithms.base import ActorLoss
    from rlx.protocols import RunInfo

    cfg = RLXConfig()
    cfg.rollout.n = 3
    comp = pm.get("algorithm", "grpo")
    opts = comp.load_config_model().model_validate(
        {"overlong_buffer_len": 0, "use_kl_loss": False,
         "rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 1.5, "rollout_rs": "token_k1",
                                "rollout_rs_threshold": "0.5_2.0"}})
    alg = comp.load_factory()(opts, BuildContext(cfg, RunInfo("", "p", "e", {}), pm))
    assert alg.old_log_probs_from_update is False  # the weights need the old log-probs before the update
    batch = Batch({"scores": t([1.0, 0.0, 0.5]), "group_index": torch.tensor([0, 0, 0]),
                   "response_mask": RC_MASK.long(), "old_log_probs": RC_OLD, "rollout_log_probs": RC_ROLLOUT})
    alg.compute_advantages(batch)
    w = batch["rollout_is_weights"]
    torch.testing.assert_close(w, t([[1.5, 0, 0], [math.exp(0.2), math.exp(0.1), math.exp(0.3)],
                                     [math.exp(-0.05), 0, 0]]).float())
    # the rejected token (row 0, token 1) left the trained mask: no advantage there, not counted
    assert batch["rejection_mask"].tolist() == [[1, 0, 0], [1, 1, 1], [1, 0, 0]]
    assert float(batch["advantages"][0, 1]) == 0.0
    metrics = alg.metrics(batch)
    assert metrics["rollout_corr/rs_masked_fraction"] == pytest.approx(1 / 6)
    mb = Batch({k: batch[k] for k in ("response_mask", "old_log_probs", "advantages", "rollout_is_weights",
                                      "rejection_mask")})
    ctx = LossContext(5, 3)  # what rlx.step counts from the trained mask: 5 tokens
    lp = RC_OLD.clone().requires_grad_(True)  # on-policy: each token's loss is -w_t A_t
    loss, _ = ActorLoss(opts)({"log_probs": lp, "entropy": torch.zeros_like(lp)}, mb, ctx)
    adv = batch["advantages"][:, 0].double()
    want = -(1.5 * adv[0] + (math.exp(0.2) + math.exp(0.1) + math.exp(0.3)) * adv[1] + math.exp(-0.05) * adv[2]) / 5
    assert float(loss.detach()) == pytest.approx(float(want), rel=1e-6)


def test_from_verl_maps_rollout_correction(pm):
    from rlx.cli.from_verl import translate

    rc = "algorithm.rollout_correction."
    t = translate({"algorithm.adv_estimator": "grpo", rc + "rollout_is": "sequence", rc + "rollout_is_threshold": 3.0,
                   rc + "rollout_rs": "token_k1", rc + "rollout_rs_threshold": "0.5_2.0",
                   rc + "rollout_is_batch_normalize": False, rc + "bypass_mode": False, rc + "loss_type": "ppo_clip"},
                  pm)
    assert t.unmapped == []
    assert t.settings[rc + "rollout_is"] == "sequence" and t.settings[rc + "rollout_rs_threshold"] == "0.5_2.0"
    bypass = translate({"algorithm.adv_estimator": "grpo", rc + "bypass_mode": True, rc + "loss_type": "reinforce"},
                       pm)
    assert bypass.unmapped == []
    assert bypass.settings[rc + "bypass_mode"] is True and bypass.settings[rc + "loss_type"] == "reinforce"
    # verl's bypass mode replaces the actor's loss_mode: said in a note, and in the translated config
    replaced = translate({"algorithm.adv_estimator": "grpo", rc + "bypass_mode": True,
                          "actor_rollout_ref.actor.policy_loss.loss_mode": "gspo"}, pm)
    assert replaced.settings["algorithm.policy_loss"] == "bypass_mode"
    assert any("replaces the actor's loss_mode=gspo" in n for n in replaced.notes)
    # verl's switch for the pass the optimal token baseline reads: rlx's pass computes it when the estimator asks
    otb = translate({"algorithm.adv_estimator": "optimal_token_baseline",
                     "actor_rollout_ref.actor.calculate_sum_pi_squared": True}, pm)
    assert otb.unmapped == [] and otb.settings["algorithm.adv_estimator"] == "optimal_token_baseline"


@pytest.mark.parametrize("name", ["sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo"])
def test_padding_garbage_reaches_neither_value_nor_gradient(name: str):
    mask = t([[1, 1, 0, 0], [1, 0, 1, 1], [1, 1, 1, 1]])  # a hole in row 1
    lp = t([[-1.0, -0.3, 0, 0], [-0.7, 0, -1.2, -0.4], [-0.5, -0.1, -3.0, -1.1]])
    old = lp + t([[0.1, -0.2, 0, 0], [0.3, 0, -0.1, 0.05], [-0.2, 0.15, 0.4, -0.3]])
    adv = t([[1.0, 1.0, 0, 0], [-2.0, 0, -2.0, -2.0], [0.5, 0.5, 0.5, 0.5]])
    # clip_cov: the band holds exactly one token PPO did not clip (row 2's second, cov = (A - mean A)(logp - mean logp)
    # = 0.594), so the choice is not random
    kwargs = {"clip_cov_ratio": 1.0, "clip_cov_lb": 0.55, "clip_cov_ub": 0.7} if name == "clip_cov" else {}
    pad = ~mask.bool()

    def run(fill_lp: float, fill_old: float, fill_adv: float) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.where(pad, torch.full_like(lp, fill_lp), lp).requires_grad_(True)
        o = torch.where(pad, torch.full_like(lp, fill_old), old)
        a = torch.where(pad, torch.full_like(lp, fill_adv), adv)
        loss, _ = F.POLICY_LOSSES[name](x, o, a, mask, **kwargs)
        (g,) = torch.autograd.grad(loss, x)
        return loss.detach(), g

    clean_loss, clean_grad = run(0.0, 0.0, 0.0)
    loss, grad = run(float("nan"), float("inf"), 1e30)
    assert torch.equal(loss, clean_loss) and torch.equal(grad, clean_grad)
    assert torch.all(grad[pad] == 0) and bool(grad.abs().sum() > 0)
    if name == "clip_cov":
        assert grad[2, 1] == 0 and grad[2, 2] != 0  # the detached token; its unclipped neighbour keeps one


VERL_NAMES = ([f"algorithm.adv_estimator={n}" for n in ("opo", "gpg", "grpo_passk", "grpo_vectorized",
                                                          "rloo_vectorized")]
              + [f"algorithm.policy_loss={n}" for n in ("sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo")]
              + [f"algorithm.{key}={n}" for key in ("kl_penalty", "kl_loss_type")
                 for n in ("kl", "mse", "k1+", "k3+", "low_var_kl+")])


def test_every_verl_name_validates_on_the_builtin_preset(pm):
    from rlx.validate import load_config

    for override in VERL_NAMES:
        resolved = load_config(pm, preset="tiny", overrides=[override], check_files=False)
        key, value = override.split("=")
        assert getattr(resolved.options["algorithm"], key.split(".")[1]) == value, override
