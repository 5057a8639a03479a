"""Unit tests for rlx.plugins.algorithms.functional against hand-computed values.

Conventions used throughout: ``G`` is a huge garbage value written into padded positions
(mask == 0); every result must be identical to the one computed with clean (zero) padding.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from rlx.plugins.algorithms import functional as F

G = 1e6  # garbage written into padding


def t(data, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(data, dtype=dtype)


def close(actual, expected, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    actual_t = torch.as_tensor(actual, dtype=torch.float64)
    expected_t = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual_t, expected_t, atol=atol, rtol=rtol)


def with_padding(x: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    """Copy of x with every padded position set to ``value``."""
    return torch.where(mask.bool(), x, torch.full_like(x, value))


# Ragged mask used by many tests: 3 + 2 + 4 + 1 = 10 valid tokens.
MASK4 = t([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
# Values on the valid tokens are 1..10; rows: [1,2,3], [4,5], [6,7,8,9], [10].
X4 = t([[1, 2, 3, G], [4, 5, G, G], [6, 7, 8, 9], [10, G, G, G]])


# --------------------------------------------------------------------------------------------------
# masked reductions
# --------------------------------------------------------------------------------------------------


def test_masked_sum_and_mean() -> None:
    # sum 1..10 = 55; mean = 55 / 10 = 5.5
    close(F.masked_sum(X4, MASK4), 55.0)
    close(F.masked_mean(X4, MASK4), 5.5)
    # per row: sums [6, 9, 30, 10]; means [6/3, 9/2, 30/4, 10/1] = [2, 4.5, 7.5, 10]
    close(F.masked_sum(X4, MASK4, dim=-1), [6.0, 9.0, 30.0, 10.0])
    close(F.masked_mean(X4, MASK4, dim=-1), [2.0, 4.5, 7.5, 10.0])
    # bool mask gives the same
    close(F.masked_mean(X4, MASK4.bool()), 5.5)


def test_masked_reductions_ignore_inf_and_nan_padding() -> None:
    for bad in (math.inf, -math.inf, math.nan):
        x = with_padding(X4, MASK4, bad)
        close(F.masked_sum(x, MASK4), 55.0)
        close(F.masked_mean(x, MASK4, dim=-1), [2.0, 4.5, 7.5, 10.0])
        close(F.masked_var(x, MASK4), 82.5 / 9)


def test_masked_mean_empty_mask_is_zero_not_nan() -> None:
    empty = torch.zeros_like(MASK4)
    assert F.masked_mean(X4, empty).item() == 0.0
    mask = MASK4.clone()
    mask[1] = 0  # an empty row -> 0 for that row
    close(F.masked_mean(X4, mask, dim=-1), [2.0, 0.0, 7.5, 10.0])


def test_masked_var() -> None:
    # values 1..10, mean 5.5, sum of squared deviations = 2*(4.5^2+3.5^2+2.5^2+1.5^2+0.5^2) = 82.5
    close(F.masked_var(X4, MASK4, unbiased=False), 82.5 / 10)  # 8.25
    close(F.masked_var(X4, MASK4, unbiased=True), 82.5 / 9)  # 9.1666...
    # one valid element, or none: 0 (no NaN)
    one = torch.zeros_like(MASK4)
    one[0, 0] = 1
    assert F.masked_var(X4, one).item() == 0.0
    assert F.masked_var(X4, torch.zeros_like(MASK4)).item() == 0.0


def test_masked_whiten() -> None:
    x = t([[1.0, 2.0, 3.0, G]])
    m = t([[1, 1, 1, 0]])
    # mean 2, unbiased var ((-1)^2 + 0 + 1^2) / 2 = 1 -> [-1, 0, 1], padding 0
    close(F.masked_whiten(x, m), [[-1.0, 0.0, 1.0, 0.0]])
    # shift_mean=False adds the mean back: [1, 2, 3]
    close(F.masked_whiten(x, m, shift_mean=False), [[1.0, 2.0, 3.0, 0.0]])
    # the ragged 10-token case: (v - 5.5) / sqrt(82.5 / 9)
    w = F.masked_whiten(X4, MASK4)
    expected = torch.where(MASK4.bool(), (X4 - 5.5) / math.sqrt(82.5 / 9), torch.zeros_like(X4))
    close(w, expected)


# --------------------------------------------------------------------------------------------------
# agg_loss
# --------------------------------------------------------------------------------------------------


def test_agg_loss_modes() -> None:
    # token-mean: 55 / 10
    close(F.agg_loss(X4, MASK4, "token-mean"), 5.5)
    # seq-mean-token-sum: (6 + 9 + 30 + 10) / 4 = 13.75
    close(F.agg_loss(X4, MASK4, "seq-mean-token-sum"), 13.75)
    # seq-mean-token-mean: (2 + 4.5 + 7.5 + 10) / 4 = 6
    close(F.agg_loss(X4, MASK4, "seq-mean-token-mean"), 6.0)
    # seq-mean-token-sum-norm (max_len = T = 4): (6/4 + 9/4 + 30/4 + 10/4) / 4 = 55 / 16
    close(F.agg_loss(X4, MASK4, "seq-mean-token-sum-norm"), 55 / 16)
    # ... with max_len=5: 55 / 5 / 4 = 2.75
    close(F.agg_loss(X4, MASK4, "seq-mean-token-sum-norm", max_len=5), 2.75)
    assert set(F.LOSS_AGG_MODES) == {
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    }


def test_agg_loss_empty_sequence_not_counted() -> None:
    mask = MASK4.clone()
    mask[3] = 0  # row 3 has no valid token -> N_seqs = 3
    # (6 + 9 + 30) / 3 = 15 ; token-mean 45 / 9 = 5
    close(F.agg_loss(X4, mask, "seq-mean-token-sum"), 15.0)
    close(F.agg_loss(X4, mask, "seq-mean-token-mean"), (2 + 4.5 + 7.5) / 3)
    close(F.agg_loss(X4, mask, "token-mean"), 5.0)
    # everything masked: 0 for every mode, no NaN
    for mode in F.LOSS_AGG_MODES:
        assert F.agg_loss(X4, torch.zeros_like(MASK4), mode).item() == 0.0


def test_agg_loss_explicit_totals() -> None:
    close(F.agg_loss(X4, MASK4, "token-mean", num_tokens=20), 55 / 20)
    close(F.agg_loss(X4, MASK4, "token-mean", num_tokens=torch.tensor(20.0)), 55 / 20)
    close(F.agg_loss(X4, MASK4, "seq-mean-token-sum", num_seqs=8), 55 / 8)
    close(F.agg_loss(X4, MASK4, "seq-mean-token-mean", num_seqs=8), 24 / 8)
    with pytest.raises(ValueError, match="num_tokens"):
        F.agg_loss(X4, MASK4, "token-mean", num_tokens=0)


def test_agg_loss_unknown_mode() -> None:
    with pytest.raises(ValueError, match="token-mean") as info:
        F.agg_loss(X4, MASK4, "bogus")
    for mode in F.LOSS_AGG_MODES:
        assert mode in str(info.value)


@pytest.mark.parametrize("mode", F.LOSS_AGG_MODES)
def test_agg_loss_gradient_accumulation_matches_full_batch(mode: str) -> None:
    # per-token loss = w^2 * c; micro-batches are row [0] (trimmed to T = 3, its own length) and
    # rows [1, 2, 3] (T = 4): an uneven split (3 vs 7 tokens, 1 vs 3 sequences). With the mini-batch
    # totals (10 tokens, 4 seqs, max_len 4) the summed micro-batch losses and their gradients equal
    # the full-batch ones.
    c = t([[1.0, -2.0, 0.5, 3.0], [2.0, 1.0, 7.0, 7.0], [0.3, 0.2, -1.0, 4.0], [1.5, 9.0, 9.0, 9.0]])
    w_full = X4.clone().div(10).requires_grad_(True)  # padding holds G / 10
    full = F.agg_loss(w_full.square() * c, MASK4, mode)
    full.backward()

    w_micro = X4.clone().div(10).requires_grad_(True)
    totals = {"num_tokens": 10, "num_seqs": 4, "max_len": 4}
    loss_a = F.agg_loss(w_micro[:1, :3].square() * c[:1, :3], MASK4[:1, :3], mode, **totals)
    loss_b = F.agg_loss(w_micro[1:].square() * c[1:], MASK4[1:], mode, **totals)
    (loss_a + loss_b).backward()

    close(loss_a + loss_b, full)
    assert w_full.grad is not None and w_micro.grad is not None
    torch.testing.assert_close(w_micro.grad, w_full.grad, atol=1e-6, rtol=0)
    # padding gets exactly zero gradient
    assert torch.all(w_full.grad[~MASK4.bool()] == 0)

    # Without the totals, averaging the micro-batch losses is NOT the full-batch loss.
    naive_a = F.agg_loss(w_micro[:1, :3].square() * c[:1, :3], MASK4[:1, :3], mode)
    naive_b = F.agg_loss(w_micro[1:].square() * c[1:], MASK4[1:], mode)
    assert not torch.isclose((naive_a + naive_b) / 2, full, atol=1e-3)


# --------------------------------------------------------------------------------------------------
# KL, entropy, log-probs
# --------------------------------------------------------------------------------------------------


def test_kl_estimators() -> None:
    logp = t([[-1.0, -2.0, -5.0, -40.0]])
    ref = t([[-1.5, -1.0, -35.0, -10.0]])
    # d = logp - ref = [0.5, -1.0, 30, -30]
    close(F.kl_penalty(logp, ref, "k1"), [[0.5, -1.0, 30.0, -30.0]])
    close(F.kl_penalty(logp, ref, "abs"), [[0.5, 1.0, 30.0, 30.0]])
    close(F.kl_penalty(logp, ref, "k2"), [[0.125, 0.5, 450.0, 450.0]])  # 0.5 d^2
    # k3 = exp(-d) + d - 1:
    #   d = 0.5  -> exp(-0.5) - 0.5 = 0.6065307 - 0.5 = 0.1065307
    #   d = -1   -> e - 2 = 0.7182818
    #   d = 30   -> ~29 -> clamped to 10 ; d = -30 -> e^30 - 31 -> clamped to 10
    k3 = [[math.exp(-0.5) - 0.5, math.e - 2.0, 10.0, 10.0]]
    close(F.kl_penalty(logp, ref, "k3"), k3)
    close(F.kl_penalty(logp, ref, "low_var_kl"), k3)
    assert set(F.KL_ESTIMATORS) >= {"k1", "abs", "k2", "k3", "low_var_kl"}
    with pytest.raises(ValueError, match="k3"):
        F.kl_penalty(logp, ref, "nope")


def test_k3_zero_at_equal_and_finite_for_extremes() -> None:
    x = t([[-3.0, 1e6, -1e6]])
    out = F.kl_penalty(x, t([[-3.0, -1e6, 1e6]]), "k3")
    assert out[0, 0].item() == 0.0
    assert torch.isfinite(out).all()


def test_entropy_from_logits() -> None:
    # logits [0, ln 2, ln 3] -> p = [1/6, 2/6, 3/6]
    # H = ln6/6 + ln3/3 + ln2/2 = 0.2986266 + 0.3662041 + 0.3465736 = 1.0114043
    logits = t([[[0.0, math.log(2), math.log(3)], [5.0, 5.0, 5.0]]])
    expected = [[math.log(6) / 6 + math.log(3) / 3 + math.log(2) / 2, math.log(3)]]  # uniform -> ln 3
    close(F.entropy_from_logits(logits), expected)
    out = F.entropy_from_logits(logits.to(torch.bfloat16))
    assert out.dtype == torch.float32


def test_log_probs_from_logits() -> None:
    row = [0.0, math.log(2), math.log(3)]  # p = [1/6, 1/3, 1/2]
    logits = t([[row, row], [row, row]])  # (B=2, T=2, V=3)
    labels = torch.tensor([[2, 0], [1, -100]])
    # ln(1/2), ln(1/6), ln(1/3); label -100 (ignore index) -> 0
    expected = [[math.log(0.5), math.log(1 / 6)], [math.log(1 / 3), 0.0]]
    close(F.log_probs_from_logits(logits, labels), expected)
    # shift invariance: adding a constant to every logit changes nothing
    close(F.log_probs_from_logits(logits + 50.0, labels), expected, atol=1e-5)
    # stability: huge logits neither overflow nor NaN; p = softmax([1000, 0, -1000]) = [1, e^-1000, ~0]
    huge = F.log_probs_from_logits(t([[[1000.0, 0.0, -1000.0]] * 3]), torch.tensor([[0, 1, 2]]))
    close(huge, [[0.0, -1000.0, -2000.0]])
    # bf16 logits are computed in float32 (row by row) and give the float32 answer of the rounded input
    lp16 = F.log_probs_from_logits(logits.to(torch.bfloat16), labels)
    assert lp16.dtype == torch.float32
    close(lp16, F.log_probs_from_logits(logits.to(torch.bfloat16).float(), labels))


# --------------------------------------------------------------------------------------------------
# advantage estimators
# --------------------------------------------------------------------------------------------------

# 6 sequences, groups: ids 5 -> rows 0,1,2; id 9 -> rows 3,4; id 2 -> row 5 (a singleton)
INDEX6 = torch.tensor([5, 5, 5, 9, 9, 2])
SCORES6 = t([1.0, 0.0, 0.0, 2.0, 4.0, 7.0])
MASK6 = t([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])


def per_seq(tok: torch.Tensor) -> torch.Tensor:
    """First-token value of each row (all rows in these tests have a valid first token)."""
    return tok[:, 0]


def assert_constant_on_valid_and_zero_on_padding(tok: torch.Tensor, mask: torch.Tensor) -> None:
    m = mask.bool()
    assert torch.all(tok[~m] == 0)
    expected = torch.where(m, per_seq(tok).unsqueeze(-1).expand_as(tok), torch.zeros_like(tok))
    assert torch.equal(tok, expected)


def test_grpo_advantages() -> None:
    adv, ret = F.grpo_advantages(SCORES6, INDEX6, MASK6)
    # group 5: [1, 0, 0], mean 1/3, unbiased var ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3, std = sqrt(1/3)
    #   -> (2/3) / (0.5773503 + 1e-6) = 1.1547 ; (-1/3) / (0.5773503 + 1e-6) = -0.57735
    # group 9: [2, 4], mean 3, std = sqrt((1 + 1) / 1) = sqrt(2) -> -1/sqrt2, +1/sqrt2
    # group 2: singleton -> 0
    s3 = math.sqrt(1 / 3) + 1e-6
    s2 = math.sqrt(2) + 1e-6
    close(per_seq(adv), [(2 / 3) / s3, (-1 / 3) / s3, (-1 / 3) / s3, -1 / s2, 1 / s2, 0.0])
    assert_constant_on_valid_and_zero_on_padding(adv, MASK6)
    assert torch.equal(adv, ret)
    # advantages sum to zero within each group (per-sequence values)
    a = per_seq(adv)
    close(a[:3].sum(), 0.0)
    close(a[3:5].sum(), 0.0)


def test_grpo_no_std_and_degenerate_groups() -> None:
    adv, _ = F.grpo_advantages(SCORES6, INDEX6, MASK6, norm_by_std=False)
    # Dr. GRPO: s - mean -> group 5: [2/3, -1/3, -1/3]; group 9: [-1, 1]; singleton 0
    close(per_seq(adv), [2 / 3, -1 / 3, -1 / 3, -1.0, 1.0, 0.0])
    # all-equal group -> 0 everywhere (std 0, no blow-up)
    adv3, _ = F.grpo_advantages(t([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0]), torch.ones(3, 2))
    assert torch.all(adv3 == 0)


def test_grpo_is_permutation_equivariant_and_mask_dtype_agnostic() -> None:
    perm = torch.tensor([4, 0, 5, 2, 1, 3])
    adv, _ = F.grpo_advantages(SCORES6, INDEX6, MASK6)
    adv_p, _ = F.grpo_advantages(SCORES6[perm], INDEX6[perm], MASK6[perm])
    close(adv_p, adv[perm])
    adv_b, _ = F.grpo_advantages(SCORES6, INDEX6, MASK6.bool())
    assert torch.equal(adv_b, adv)


def test_rloo_advantages() -> None:
    adv, ret = F.rloo_advantages(SCORES6, INDEX6, MASK6)
    # group 5: 1 - (0+0)/2 = 1 ; 0 - (1+0)/2 = -0.5 (x2) ; group 9: 2 - 4 = -2, 4 - 2 = 2 ; singleton 0
    close(per_seq(adv), [1.0, -0.5, -0.5, -2.0, 2.0, 0.0])
    assert_constant_on_valid_and_zero_on_padding(adv, MASK6)
    assert torch.equal(adv, ret)


def test_reinforce_plus_plus() -> None:
    mask = t([[1, 1, 1], [1, 1, 0]])
    rewards = t([[-0.1, 0.0, 1.0], [0.0, 2.0, G]])
    # gamma = 1: reverse cumulative sums -> [[0.9, 1, 1], [2, 2, 0]]
    _, ret1 = F.reinforce_plus_plus_advantages(rewards, mask)
    close(ret1, [[0.9, 1.0, 1.0], [2.0, 2.0, 0.0]])
    # gamma = 0.5: row 0: t2 = 1 ; t1 = 0 + 0.5*1 = 0.5 ; t0 = -0.1 + 0.5*0.5 = 0.15
    #              row 1: t1 = 2 ; t0 = 0 + 0.5*2 = 1
    adv, ret = F.reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    close(ret, [[0.15, 0.5, 1.0], [1.0, 2.0, 0.0]])
    # whitening over valid returns [0.15, 0.5, 1, 1, 2]: mean = 4.65 / 5 = 0.93;
    # squared deviations 0.6084 + 0.1849 + 0.0049 + 0.0049 + 1.1449 = 1.948; unbiased var 1.948/4 = 0.487
    sd = math.sqrt(0.487 + 1e-8)
    close(
        adv,
        [[(0.15 - 0.93) / sd, (0.5 - 0.93) / sd, (1 - 0.93) / sd], [(1 - 0.93) / sd, (2 - 0.93) / sd, 0.0]],
    )
    # garbage in padded rewards is irrelevant
    adv0, ret0 = F.reinforce_plus_plus_advantages(with_padding(rewards, mask, 0.0), mask, gamma=0.5)
    assert torch.equal(adv0, adv) and torch.equal(ret0, ret)


def test_reinforce_plus_plus_baseline() -> None:
    index = torch.tensor([0, 0, 1, 1])
    scores = t([1.0, 0.0, 3.0, 3.0])
    mask = t([[1, 1], [1, 0], [1, 1], [1, 0]])
    adv, ret = F.reinforce_plus_plus_baseline_advantages(scores, index, mask)
    # group means 0.5 and 3 -> centred [0.5, -0.5, 0, 0] broadcast:
    close(ret, [[0.5, 0.5], [-0.5, 0.0], [0.0, 0.0], [0.0, 0.0]])
    # whitening over the 6 valid tokens [0.5, 0.5, -0.5, 0, 0, 0]: mean = 0.5/6 = 1/12
    # deviations 5/12 (x2), -7/12, -1/12 (x3); sum sq = (50 + 49 + 3)/144 = 102/144; unbiased /5
    mean, sd = 1 / 12, math.sqrt(102 / 144 / 5 + 1e-8)
    a, b, z = (0.5 - mean) / sd, (-0.5 - mean) / sd, (0 - mean) / sd
    close(adv, [[a, a], [b, 0.0], [z, z], [z, 0.0]])


def test_remax() -> None:
    mask = t([[1, 1, 0], [1, 0, 0]])
    adv, ret = F.remax_advantages(t([1.0, 0.5]), t([0.5, 0.5]), mask)
    # (s - b) broadcast: [0.5, 0] ; returns = s broadcast: [1, 0.5]
    close(adv, [[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]])
    close(ret, [[1.0, 1.0, 0.0], [0.5, 0.0, 0.0]])


GAE_MASK = t([[1, 1, 1], [1, 1, 0]])
GAE_REWARDS = t([[0.0, 0.0, 1.0], [0.0, 1.0, G]])
GAE_VALUES = t([[0.5, 0.2, 0.8], [0.3, 0.6, G]])


def test_gae_gamma_lam_one_is_monte_carlo() -> None:
    adv, ret = F.gae_advantages(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=1.0, lam=1.0, whiten=False)
    # returns = reverse cumsum of rewards: [[1, 1, 1], [1, 1, 0]]; advantages = returns - values
    close(ret, [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    close(adv, [[0.5, 0.8, 0.2], [0.7, 0.4, 0.0]])
    close(adv, torch.where(GAE_MASK.bool(), ret - GAE_VALUES, torch.zeros_like(ret)))


def test_gae_hand_values() -> None:
    adv, ret = F.gae_advantages(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.9, lam=0.5, whiten=False)
    # gamma*lam = 0.45
    # row 0: t2: delta = 1 + 0 - 0.8 = 0.2 ; A = 0.2
    #        t1: delta = 0 + 0.9*0.8 - 0.2 = 0.52 ; A = 0.52 + 0.45*0.2 = 0.61
    #        t0: delta = 0 + 0.9*0.2 - 0.5 = -0.32 ; A = -0.32 + 0.45*0.61 = -0.0455
    # row 1 (last valid t1; its next value is 0, the garbage at t2 is never used):
    #        t1: delta = 1 + 0 - 0.6 = 0.4 ; A = 0.4
    #        t0: delta = 0 + 0.9*0.6 - 0.3 = 0.24 ; A = 0.24 + 0.45*0.4 = 0.42
    close(adv, [[-0.0455, 0.61, 0.2], [0.42, 0.4, 0.0]])
    close(ret, [[-0.0455 + 0.5, 0.61 + 0.2, 0.2 + 0.8], [0.42 + 0.3, 0.4 + 0.6, 0.0]])
    # whitened: masked_whiten of the raw advantages; mean 0 / unbiased std 1 on valid tokens
    adv_w, ret_w = F.gae_advantages(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.9, lam=0.5)
    close(adv_w, F.masked_whiten(adv, GAE_MASK))
    close(F.masked_mean(adv_w, GAE_MASK), 0.0)
    close(F.masked_var(adv_w, GAE_MASK), 1.0, atol=1e-5)
    assert torch.equal(ret_w, ret)
    # clean padding gives bit-identical results
    adv0, ret0 = F.gae_advantages(
        with_padding(GAE_REWARDS, GAE_MASK, 0.0),
        with_padding(GAE_VALUES, GAE_MASK, 0.0),
        GAE_MASK,
        gamma=0.9,
        lam=0.5,
        whiten=False,
    )
    assert torch.equal(adv0, adv) and torch.equal(ret0, ret)


def test_scores_to_token_rewards() -> None:
    mask = t([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    out = F.scores_to_token_rewards(t([1.0, 2.0, 3.0]), mask)
    close(out, [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]])


# --------------------------------------------------------------------------------------------------
# policy losses
# --------------------------------------------------------------------------------------------------

PPO_MASK = t([[1, 1, 1], [1, 1, 0]])
# tokens a, b, c | d, e (, padding): ratios [1.5, 0.7, 1.0 | 0.5, 5.0], advantages [1, 1, -1 | -2, -1]
PPO_RATIO = t([[1.5, 0.7, 1.0], [0.5, 5.0, 1.0]])
PPO_OLD = t([[-1.0, -2.0, -0.5], [-1.5, -3.0, G]])
PPO_LOGP = torch.where(PPO_MASK.bool(), PPO_OLD + PPO_RATIO.log(), torch.full_like(PPO_OLD, G))
PPO_ADV = t([[1.0, 1.0, -1.0], [-2.0, -1.0, G]])


def test_ppo_policy_loss_clip() -> None:
    loss, m = F.ppo_policy_loss(PPO_LOGP, PPO_OLD, PPO_ADV, PPO_MASK, clip_ratio_c=None)
    # l = max(-A r, -A clip(r, 0.8, 1.2)):
    #   a: max(-1.5, -1.2) = -1.2 (clipped)   b: max(-0.7, -0.8) = -0.7
    #   c: max(1.0, 1.0) = 1.0                d: max(1.0, 1.6) = 1.6 (clipped)
    #   e: max(5.0, 1.2) = 5.0
    # token-mean: (-1.2 - 0.7 + 1.0 + 1.6 + 5.0) / 5 = 5.7 / 5 = 1.14
    close(loss, 1.14)
    assert m["pg_clipfrac"] == pytest.approx(2 / 5)  # a, d
    assert m["pg_clipfrac_low"] == pytest.approx(1 / 5)  # d (b has r < 0.8 but A > 0)
    assert m["pg_clipfrac_high"] == pytest.approx(1 / 5)  # a (e has r > 1.2 but A < 0)
    assert m["pg_clipfrac_dual"] == 0.0
    # ppo_kl = mean(old - new) = -(ln 1.5 + ln 0.7 + ln 1 + ln 0.5 + ln 5) / 5
    expected_kl = -(math.log(1.5) + math.log(0.7) + math.log(0.5) + math.log(5.0)) / 5
    assert m["ppo_kl"] == pytest.approx(expected_kl, abs=1e-6)
    assert all(isinstance(v, float) for v in m.values())
    assert set(m) == {"pg_clipfrac", "pg_clipfrac_low", "pg_clipfrac_high", "pg_clipfrac_dual", "ppo_kl"}


def test_ppo_policy_loss_dual_clip_and_gradient() -> None:
    """Dual clip with c = 3 is the default, as in verl (which always applies it)."""
    logp = PPO_LOGP.clone().requires_grad_(True)
    loss, m = F.ppo_policy_loss(logp, PPO_OLD, PPO_ADV, PPO_MASK)
    # dual clip for A < 0: l = min(l, -A * 3): c: min(1, 3) = 1 ; d: min(1.6, 6) = 1.6 ; e: min(5, 3) = 3
    # (-1.2 - 0.7 + 1.0 + 1.6 + 3.0) / 5 = 3.7 / 5 = 0.74
    close(loss, 0.74)
    assert m["pg_clipfrac_dual"] == pytest.approx(1 / 5)  # e
    close(F.ppo_policy_loss(PPO_LOGP, PPO_OLD, PPO_ADV, PPO_MASK, clip_ratio_c=3.0)[0], 0.74)
    # c = 4: e: min(5, 4) = 4 -> (-1.2 - 0.7 + 1.0 + 1.6 + 4.0) / 5 = 0.94
    close(F.ppo_policy_loss(PPO_LOGP, PPO_OLD, PPO_ADV, PPO_MASK, clip_ratio_c=4.0)[0], 0.94)
    loss.backward()
    # d l / d logp = -A r on unclipped tokens, 0 on clipped ones; / 5 tokens
    #   a: 0 ; b: -0.7/5 = -0.14 ; c: 1.0/5 = 0.2 ; d: 0 ; e: 0 (dual-clipped) ; padding: 0
    assert logp.grad is not None
    close(logp.grad, [[0.0, -0.14, 0.2], [0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="clip_ratio_c"):
        F.ppo_policy_loss(PPO_LOGP, PPO_OLD, PPO_ADV, PPO_MASK, clip_ratio_c=0.9)


def test_ppo_policy_loss_asymmetric_clip_and_padding() -> None:
    # clip-higher (DAPO): clip_high = 0.28 -> a: max(-1.5, -1.28) = -1.28 ; rest unchanged
    loss, _ = F.ppo_policy_loss(PPO_LOGP, PPO_OLD, PPO_ADV, PPO_MASK, clip_high=0.28, clip_ratio_c=None)
    close(loss, (-1.28 - 0.7 + 1.0 + 1.6 + 5.0) / 5)
    # clean padding -> identical loss and metrics
    clean = [with_padding(x, PPO_MASK, 0.0) for x in (PPO_LOGP, PPO_OLD, PPO_ADV)]
    for kwargs in ({}, {"clip_ratio_c": None}, {"agg_mode": "seq-mean-token-sum-norm"}):
        l_g, m_g = F.ppo_policy_loss(PPO_LOGP, PPO_OLD, PPO_ADV, PPO_MASK, **kwargs)
        l_c, m_c = F.ppo_policy_loss(*clean, PPO_MASK, **kwargs)
        assert torch.equal(l_g, l_c)
        assert m_g == m_c
    # seq-mean-token-sum, dual clip (e: 3): ((-1.2 - 0.7 + 1.0) + (1.6 + 3.0)) / 2 = (-0.9 + 4.6) / 2 = 1.85
    loss_s, _ = F.ppo_policy_loss(PPO_LOGP, PPO_OLD, PPO_ADV, PPO_MASK, agg_mode="seq-mean-token-sum")
    close(loss_s, 1.85)


def test_ppo_policy_loss_micro_batches_with_totals() -> None:
    logp = PPO_LOGP.clone().requires_grad_(True)
    full, _ = F.ppo_policy_loss(logp, PPO_OLD, PPO_ADV, PPO_MASK)
    (g_full,) = torch.autograd.grad(full, logp)
    parts = [
        F.ppo_policy_loss(
            logp[i : i + 1], PPO_OLD[i : i + 1], PPO_ADV[i : i + 1], PPO_MASK[i : i + 1], num_tokens=5
        )[0]
        for i in range(2)
    ]
    (g_micro,) = torch.autograd.grad(sum(parts), logp)
    close(sum(parts), full)
    torch.testing.assert_close(g_micro, g_full, atol=1e-6, rtol=0)


def test_gspo_policy_loss() -> None:
    mask = t([[1, 1, 1], [1, 1, 0]])
    old = t([[-1.0, -1.0, -1.0], [-2.0, -2.0, G]])
    delta = t([[0.1, 0.2, 0.3], [-0.4, 0.2, G]])
    logp = (old + delta).requires_grad_(True)
    adv = t([[1.0, 1.0, 1.0], [-1.0, -1.0, G]])
    loss, m = F.gspo_policy_loss(logp, old, adv, mask)
    # s_0 = exp(mean(0.1, 0.2, 0.3)) = e^0.2 = 1.2214 > 1.2 -> clipped, l = -1.2 on each token
    # s_1 = exp(mean(-0.4, 0.2)) = e^-0.1 = 0.904837 (inside [0.8, 1.2]) -> l = +0.904837
    # seq-mean-token-mean: (-1.2 + 0.904837) / 2 = -0.1475813
    close(loss, (-1.2 + math.exp(-0.1)) / 2)
    assert m["pg_clipfrac"] == pytest.approx(3 / 5)
    assert m["pg_clipfrac_high"] == pytest.approx(3 / 5)
    assert m["pg_clipfrac_low"] == 0.0
    assert m["pg_clipfrac_dual"] == 0.0
    assert m["ppo_kl"] == pytest.approx(-(0.1 + 0.2 + 0.3 - 0.4 + 0.2) / 5, abs=1e-6)  # -0.08
    loss.backward()
    # row 0 clipped -> 0 ; row 1: d/dlogp_t = -A * s_1 * (1 / 2 seqs) * (1 / 2 tokens) = e^-0.1 / 4
    assert logp.grad is not None
    g = math.exp(-0.1) / 4
    close(logp.grad, [[0.0, 0.0, 0.0], [g, g, 0.0]])


def test_gspo_unclipped_gradient_is_sequence_level() -> None:
    mask = t([[1, 1, 1], [1, 1, 0]])
    old = t([[-1.0, -1.0, -1.0], [-2.0, -2.0, 0.0]])
    logp = (old + t([[0.1, 0.2, 0.3], [-0.4, 0.2, 0.0]])).requires_grad_(True)
    adv = t([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    loss, m = F.gspo_policy_loss(logp, old, adv, mask, clip_low=10.0, clip_high=10.0)
    # no clipping: (-e^0.2 + e^-0.1) / 2 ; grads: row 0: -e^0.2 / (2*3), row 1: e^-0.1 / (2*2)
    close(loss, (-math.exp(0.2) + math.exp(-0.1)) / 2)
    assert m["pg_clipfrac"] == 0.0
    loss.backward()
    assert logp.grad is not None
    g0, g1 = -math.exp(0.2) / 6, math.exp(-0.1) / 4
    close(logp.grad, [[g0, g0, g0], [g1, g1, 0.0]])


def test_policy_loss_registry() -> None:
    assert F.POLICY_LOSSES["vanilla"] is F.ppo_policy_loss
    assert F.POLICY_LOSSES["gspo"] is F.gspo_policy_loss


# --------------------------------------------------------------------------------------------------
# value loss, explained variance
# --------------------------------------------------------------------------------------------------


def test_value_loss() -> None:
    mask = t([[1, 1], [1, 0]])
    values = t([[0.5, 0.1], [0.5, G]])
    old = t([[0.0, 0.0], [1.0, G]])
    returns = t([[1.0, 0.0], [1.0, G]])
    loss, m = F.value_loss(values, old, returns, mask, clip_range=0.2)
    # token 1: (0.5-1)^2 = 0.25 ; v_c = 0 + 0.2 -> (0.2-1)^2 = 0.64 -> 0.5*0.64 = 0.32 (clipped larger)
    # token 2: (0.1-0)^2 = 0.01 ; v_c = 0.1 -> 0.01 -> 0.005 (tie: not counted as clipped)
    # token 3: (0.5-1)^2 = 0.25 ; v_c = 1 - 0.2 = 0.8 -> 0.04 -> 0.5*0.25 = 0.125
    # token-mean: (0.32 + 0.005 + 0.125) / 3 = 0.15
    close(loss, 0.15)
    assert m["vf_clipfrac"] == pytest.approx(1 / 3)
    assert m["vf_loss"] == pytest.approx(0.15)
    # no clipping: 0.5 * (0.25 + 0.01 + 0.25) / 3 = 0.085
    loss_nc, m_nc = F.value_loss(values, old, returns, mask, clip_range=None)
    close(loss_nc, 0.085)
    assert m_nc["vf_clipfrac"] == 0.0


def test_explained_variance() -> None:
    mask = t([[1, 1, 0], [1, 1, 0]])
    returns = t([[1.0, 2.0, G], [3.0, 4.0, G]])
    values = t([[1.0, 2.0, -G], [3.0, 3.0, G]])
    # Var(R) over [1,2,3,4] = 1.25 ; residuals [0,0,0,1]: mean 0.25, var (3*0.0625 + 0.5625)/4 = 0.1875
    # EV = 1 - 0.1875 / 1.25 = 0.85
    ev = F.explained_variance(values, returns, mask)
    assert isinstance(ev, float)
    assert ev == pytest.approx(0.85, abs=1e-6)
    assert F.explained_variance(returns, returns, mask) == pytest.approx(1.0)
    # constant returns: 0.0 rather than NaN
    assert F.explained_variance(values, torch.ones_like(returns), mask) == 0.0


# --------------------------------------------------------------------------------------------------
# KL controllers and reward shaping
# --------------------------------------------------------------------------------------------------


def test_fixed_kl_controller() -> None:
    ctl = F.FixedKLController(0.1)
    ctl.update(current_kl=123.0, n_steps=1000)
    assert ctl.value == 0.1


def test_adaptive_kl_controller() -> None:
    ctl = F.AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    # kl 9: error 9/6 - 1 = 0.5 -> clipped to 0.2 ; mult = 1 + 0.2 * 256 / 10000 = 1.00512
    ctl.update(current_kl=9.0, n_steps=256)
    assert ctl.value == pytest.approx(0.2 * 1.00512)
    # kl 3: error -0.5 -> -0.2 ; mult = 1 - 0.2 * 500 / 10000 = 0.99
    ctl.update(current_kl=3.0, n_steps=500)
    assert ctl.value == pytest.approx(0.2 * 1.00512 * 0.99)
    # kl 6.6: error 0.1 (inside the clip) ; mult = 1 + 0.1 * 1000 / 10000 = 1.01
    before = ctl.value
    ctl.update(current_kl=6.6, n_steps=1000)
    assert ctl.value == pytest.approx(before * 1.01)


def test_apply_kl_in_reward() -> None:
    mask = t([[1, 1, 1], [1, 1, 0]])
    scores = t([[0.0, 0.0, 1.0], [0.0, 2.0, G]])
    logp = t([[-1.0, -1.0, -1.0], [-2.0, -2.0, G]])
    ref = t([[-1.5, -1.0, -0.5], [-2.0, -3.0, -G]])
    rewards, mean_kl = F.apply_kl_in_reward(scores, logp, ref, mask, kl_coef=0.1)
    # k1 = logp - ref: row 0 [0.5, 0, -0.5], row 1 [0, 1, -]
    # rewards = score - 0.1*kl: row 0 [-0.05, 0, 1.05], row 1 [0, 1.9, 0]
    close(rewards, [[-0.05, 0.0, 1.05], [0.0, 1.9, 0.0]])
    # per-sequence mean kl: [0, 0.5] -> mean 0.25
    assert isinstance(mean_kl, float)
    assert mean_kl == pytest.approx(0.25)
    # k2: row 0 [0.125, 0, 0.125] (mean 1/12), row 1 [0, 0.5] (mean 0.25) -> (1/12 + 1/4) / 2 = 1/6
    _, mean_k2 = F.apply_kl_in_reward(scores, logp, ref, mask, kl_coef=0.1, estimator="k2")
    assert mean_k2 == pytest.approx(1 / 6)


def test_overlong_penalty() -> None:
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    # max_len 20, buffer 4 -> expected length 16:
    # 10, 16 -> 0 ; 17 -> -1/4 ; 18 -> -2/4 ; 20 -> -4/4 ; 25 -> clamped -1
    out = F.overlong_penalty(lengths, max_len=20, buffer_len=4)
    close(out, [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    close(
        F.overlong_penalty(lengths, max_len=20, buffer_len=4, penalty_factor=0.5),
        [0, 0, -0.125, -0.25, -0.5, -0.5],
    )
    # buffer 0: hard cut-off beyond max_len
    close(F.overlong_penalty(lengths, max_len=20, buffer_len=0), [0, 0, 0, 0, 0, -1.0])
    with pytest.raises(ValueError):
        F.overlong_penalty(lengths, max_len=20, buffer_len=30)


def test_group_all_equal() -> None:
    index = torch.tensor([0, 0, 1, 1, 1, 2])
    scores = t([1.0, 1.0, 0.0, 1.0, 0.0, 5.0])
    # group 0: {1, 1} equal ; group 1: {0, 1, 0} not ; group 2: singleton -> equal
    out = F.group_all_equal(scores, index)
    assert out.dtype == torch.bool
    assert out.tolist() == [True, True, False, False, False, True]


def test_count_equal_score_groups() -> None:
    index = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3])
    scores = t([1.0, 1.0, 0.0, 1.0, 0.0, 5.0, 0.5, 0.5])
    # groups of two or more: 0 {1, 1} equal, 1 {0, 1, 0} not, 3 {0.5, 0.5} equal; 2 is a singleton
    assert F.count_equal_score_groups(scores, index) == (3, 2)
    assert F.count_equal_score_groups(t([1.0, 2.0]), torch.tensor([0, 1])) == (0, 0)


# --------------------------------------------------------------------------------------------------
# Group statistics at float32: a group whose scores are all equal gets exactly 0
# --------------------------------------------------------------------------------------------------


def _grpo(s, i, m):
    return F.grpo_advantages(s, i, m)


def _grpo_no_std(s, i, m):
    return F.grpo_advantages(s, i, m, norm_by_std=False)


GROUP_ESTIMATORS = {"grpo": _grpo, "grpo_no_std": _grpo_no_std, "rloo": F.rloo_advantages,
                    "reinforce_plus_plus_baseline": F.reinforce_plus_plus_baseline_advantages}


@pytest.mark.parametrize("name", list(GROUP_ESTIMATORS))
@pytest.mark.parametrize(("n", "value", "dtype"), [(8, 0.7, torch.float32), (16, 123.456, torch.float32),
                                                   (3, 0.1, torch.float64), (5, -1e-3, torch.float32)])
def test_all_equal_group_gets_exactly_zero(name: str, n: int, value: float, dtype: torch.dtype) -> None:
    """full(8, 0.7) gave 0.056 and full(16, 123.456) gave -0.93 with float32 group statistics:
    the mean was off by a rounding error and the std was that same error."""
    scores = torch.full((n,), value, dtype=dtype)
    adv, ret = GROUP_ESTIMATORS[name](scores, torch.zeros(n, dtype=torch.long), torch.ones(n, 3))
    assert adv.dtype == dtype
    assert torch.equal(adv, torch.zeros_like(adv)), adv[:, 0]
    assert torch.equal(ret, torch.zeros_like(ret))


@pytest.mark.parametrize("name", ["grpo", "grpo_no_std", "rloo"])
def test_all_equal_group_next_to_a_mixed_group(name: str) -> None:
    # group 0: eight times float32(0.7) -> exactly 0; group 1: [1, 2, 3] -> hand values below
    scores = torch.cat([torch.full((8,), 0.7), t([1.0, 2.0, 3.0])])
    index = torch.tensor([0] * 8 + [1] * 3)
    adv, _ = GROUP_ESTIMATORS[name](scores, index, torch.ones(11, 2))
    assert torch.equal(adv[:8], torch.zeros(8, 2))
    # mean 2, unbiased std 1: grpo (s - 2) / (1 + 1e-6); Dr. GRPO s - 2; rloo s - mean(others)
    want = {"grpo": [-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6)], "grpo_no_std": [-1.0, 0.0, 1.0],
            "rloo": [1 - 2.5, 2 - 2.0, 3 - 1.5]}[name]
    close(adv[8:, 0], want)


def test_reinforce_plus_plus_baseline_all_equal_group_is_centred_to_exactly_zero() -> None:
    # The equal group's centred score c is exactly 0; whitening over the batch then shifts every token
    # by the batch mean (as in the paper), so only c, not A, is 0 for that group.
    scores = torch.cat([torch.full((16,), 123.456), t([1.0, 3.0])])
    index = torch.tensor([0] * 16 + [1] * 2)
    _, centred = F.reinforce_plus_plus_baseline_advantages(scores, index, torch.ones(18, 1))
    assert torch.equal(centred[:16], torch.zeros(16, 1))
    close(centred[16:, 0], [-1.0, 1.0])


def test_reinforce_plus_plus_baseline_whitening_eps_is_verls_1e_8() -> None:
    # c = [-1e-4, 1e-4]: unbiased var 2e-8, so A = c / sqrt(2e-8 + eps) = -+1/sqrt(3) with eps = 1e-8
    # (with eps = 1e-6 it would be -+0.099).
    scores = t([0.0, 2e-4], dtype=torch.float64)
    adv, _ = F.reinforce_plus_plus_baseline_advantages(scores, torch.tensor([0, 0]), torch.ones(2, 1))
    close(adv[:, 0], [-1 / math.sqrt(3), 1 / math.sqrt(3)], atol=1e-9)


# --------------------------------------------------------------------------------------------------
# The padding promise, with autograd: inf/nan at padded positions never reach a gradient
# --------------------------------------------------------------------------------------------------

PAD_MASK = t([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
NAN, INF = float("nan"), float("inf")
# Garbage for the first, second and third input of a loss: each padded position mixes kinds, e.g.
# finite log-probs with an infinite advantage (the case that gave NaN gradients through -A * ratio).
JUNK = [t([[0, 0, 0, 0.5, NAN], [0, 0, INF, -2.0, 1e30], [0, 0, 0, 0, 0]]),
        t([[0, 0, 0, -1.0, 0.3], [0, 0, -INF, NAN, 0.0], [0, 0, 0, 0, 0]]),
        t([[0, 0, 0, INF, 2.0], [0, 0, NAN, -INF, 1e30], [0, 0, 0, 0, 0]])]


def _junk(x: torch.Tensor, which: int = 0) -> torch.Tensor:
    return torch.where(PAD_MASK.bool(), x, JUNK[which])


def _clean(x: torch.Tensor) -> torch.Tensor:
    return torch.where(PAD_MASK.bool(), x, torch.zeros_like(x))


LP = t([[-1.0, -0.3, -2.0, 0, 0], [-0.7, -1.2, 0, 0, 0], [-0.5, -0.1, -3.0, -1.1, -0.9]])
OLD = t([[-1.2, -0.2, -2.5, 0, 0], [-0.1, -1.3, 0, 0, 0], [-0.5, -0.6, -2.0, -1.0, -0.2]])
ADV = t([[1.0, -1.0, 2.0, 0, 0], [-2.0, 0.5, 0, 0, 0], [1.5, -0.5, -1.0, 0.3, -3.0]])

def _kl_loss(lp: torch.Tensor, ref: torch.Tensor, _unused: torch.Tensor, est: str) -> torch.Tensor:
    return F.agg_loss(F.kl_penalty(lp, ref, est, PAD_MASK), PAD_MASK, "token-mean")


LOSSES = {
    "ppo_clip": lambda lp, old, adv: F.ppo_policy_loss(lp, old, adv, PAD_MASK, clip_ratio_c=None)[0],
    "ppo_dual_clip": lambda lp, old, adv: F.ppo_policy_loss(lp, old, adv, PAD_MASK, clip_ratio_c=3.0)[0],
    "ppo_clip_higher": lambda lp, old, adv: F.ppo_policy_loss(lp, old, adv, PAD_MASK, clip_high=0.28)[0],
    "ppo_seq_mean": lambda lp, old, adv: F.ppo_policy_loss(lp, old, adv, PAD_MASK,
                                                            agg_mode="seq-mean-token-mean")[0],
    "gspo": lambda lp, old, adv: F.gspo_policy_loss(lp, old, adv, PAD_MASK, clip_low=1.0, clip_high=1.0)[0],
    "gspo_clipped": lambda lp, old, adv: F.gspo_policy_loss(lp, old, adv, PAD_MASK)[0],
    "value": lambda v, old, ret: F.value_loss(v, old, ret, PAD_MASK, clip_range=0.2)[0],
    "value_unclipped": lambda v, old, ret: F.value_loss(v, old, ret, PAD_MASK, clip_range=None)[0],
    **{f"kl_{est}": functools.partial(_kl_loss, est=est) for est in F.KL_ESTIMATORS},
    "entropy": lambda h, _a, _b: F.agg_loss(h, PAD_MASK, "seq-mean-token-mean"),
    "whiten": lambda x, _a, _b: (F.masked_whiten(x, PAD_MASK) * ADV).sum(),
    "var": lambda x, _a, _b: F.masked_var(x, PAD_MASK),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_padding_garbage_never_reaches_a_gradient(name: str) -> None:
    """Every padded entry of every input holds nan, inf, -inf or 1e30; the loss and its gradient
    with respect to the differentiated input equal those with zero padding: finite, 0 at padding."""
    fn = LOSSES[name]
    clean_x = _clean(LP).requires_grad_(True)
    clean_loss = fn(clean_x, _clean(OLD), _clean(ADV))
    (clean_grad,) = torch.autograd.grad(clean_loss, clean_x)
    x = _junk(LP).requires_grad_(True)
    loss = fn(x, _junk(OLD, 1), _junk(ADV, 2))
    (grad,) = torch.autograd.grad(loss, x)
    assert torch.isfinite(grad).all(), grad
    assert torch.equal(grad[~PAD_MASK.bool()], torch.zeros(int((PAD_MASK == 0).sum())))
    assert torch.equal(grad, clean_grad)
    assert torch.equal(loss, clean_loss)
    assert bool(grad.abs().sum() > 0)  # the loss does depend on the real tokens


def test_gradients_reach_old_and_advantage_inputs_only_at_real_tokens() -> None:
    """The inputs that usually carry no gradient are guarded too (e.g. a learned advantage)."""
    for name in ("ppo_dual_clip", "gspo", "value"):
        old = _junk(OLD, 1).requires_grad_(True)
        adv = _junk(ADV, 2).requires_grad_(True)
        grads = torch.autograd.grad(LOSSES[name](_junk(LP), old, adv), (old, adv), allow_unused=True)
        for g in grads:
            if g is not None:
                assert torch.isfinite(g).all(), (name, g)
                assert torch.all(g[~PAD_MASK.bool()] == 0), (name, g)


# --------------------------------------------------------------------------------------------------
# Gradients of every loss term against an independent reference (issue: values alone hide a
# missing or detached gradient). log_probs differ from old and ref log-probs throughout.
# --------------------------------------------------------------------------------------------------

REF = t([[-0.4, -0.9, -1.0, 0, 0], [-1.5, -0.2, 0, 0, 0], [-0.2, -0.3, -2.2, -1.8, -0.1]])


def _reference_kl(lp: torch.Tensor, ref: torch.Tensor, est: str) -> torch.Tensor:
    """The KL estimators written from their definitions (Schulman's k1, k2, k3 and |log ratio|)."""
    ratio_ref = torch.exp(ref - lp)  # pi_ref / pi
    return {"k1": torch.log(1 / ratio_ref), "abs": torch.log(ratio_ref).abs(),
            "k2": torch.log(ratio_ref) ** 2 / 2, "k3": ratio_ref - 1 - torch.log(ratio_ref),
            "low_var_kl": ratio_ref - 1 - torch.log(ratio_ref)}[est]


@pytest.mark.parametrize("est", F.KL_ESTIMATORS)
def test_kl_penalty_gradient_matches_reference_and_finite_differences(est: str) -> None:
    lp = LP.double().requires_grad_(True)
    ref = REF.double()
    (g,) = torch.autograd.grad(F.kl_penalty(lp, ref, est, PAD_MASK).sum(), lp)
    lp_r = LP.double().requires_grad_(True)
    (g_ref,) = torch.autograd.grad((_reference_kl(lp_r, ref, est) * PAD_MASK.double()).sum(), lp_r)
    torch.testing.assert_close(g, g_ref, atol=1e-12, rtol=1e-9)
    # analytic: d/dlogp of k1 = 1, |d| = sign(d), k2 = d, k3 = 1 - exp(-d), with d = logp - ref
    d = LP.double() - REF.double()
    analytic = {"k1": torch.ones_like(d), "abs": d.sign(), "k2": d, "k3": 1 - torch.exp(-d),
                "low_var_kl": 1 - torch.exp(-d)}[est] * PAD_MASK.double()
    torch.testing.assert_close(g, analytic, atol=1e-12, rtol=1e-9)
    assert bool(g.abs().sum() > 0)
    assert torch.autograd.gradcheck(lambda x: F.kl_penalty(x, ref, est, PAD_MASK), (LP.double().requires_grad_(True),))


def test_entropy_from_logits_gradient() -> None:
    """entropy_from_logits works in float32 whatever the input dtype, hence the float32 tolerance."""
    logits = torch.tensor([[[1.0, -2.0, 0.5, 3.0], [0.0, 0.1, -0.2, 0.3]]], dtype=torch.float64,
                          requires_grad=True)
    weights = torch.tensor([[0.7, -1.3]], dtype=torch.float64)
    (g,) = torch.autograd.grad((F.entropy_from_logits(logits) * weights).sum(), logits)
    z = logits.detach().clone().requires_grad_(True)
    log_p = z - torch.log(torch.exp(z).sum(-1, keepdim=True))
    (g_ref,) = torch.autograd.grad((-(log_p.exp() * log_p).sum(-1) * weights).sum(), z)
    torch.testing.assert_close(g, g_ref, atol=1e-6, rtol=1e-5)
    # dH/dz_j = -p_j (log p_j + H)
    p = torch.softmax(logits.detach(), -1)
    h = -(p * p.log()).sum(-1, keepdim=True)
    torch.testing.assert_close(g, -p * (p.log() + h) * weights.unsqueeze(-1), atol=1e-6, rtol=1e-5)


def _reference_ppo_loss(lp, old, adv, mask, clip_low, clip_high, c):
    """PPO's clipped objective as in the paper, min(r A, clip(r) A), negated; dual clip (Ye et al.):
    for A < 0 the objective is at least c A."""
    r = torch.exp(lp - old)
    obj = torch.min(r * adv, torch.clamp(r, 1 - clip_low, 1 + clip_high) * adv)
    if c is not None:
        obj = torch.where(adv < 0, torch.max(obj, c * adv), obj)
    return (-obj * mask).sum() / mask.sum()


@pytest.mark.parametrize(("clip_low", "clip_high", "c"), [(0.2, 0.2, None), (0.2, 0.2, 3.0), (0.2, 0.28, 3.0),
                                                          (0.1, 0.3, 1.5)])
def test_ppo_policy_loss_gradient_matches_reference(clip_low, clip_high, c) -> None:
    # ratios exp(lp - old) from 0.55 to 2.7: some tokens in the clip range, some clipped, some dual-clipped
    lp = LP.double().requires_grad_(True)
    loss, _ = F.ppo_policy_loss(lp, OLD.double(), ADV.double(), PAD_MASK, clip_low=clip_low, clip_high=clip_high,
                                clip_ratio_c=c)
    (g,) = torch.autograd.grad(loss, lp)
    lp_r = LP.double().requires_grad_(True)
    ref_loss = _reference_ppo_loss(lp_r, OLD.double(), ADV.double(), PAD_MASK.double(), clip_low, clip_high, c)
    (g_ref,) = torch.autograd.grad(ref_loss, lp_r)
    torch.testing.assert_close(loss, ref_loss, atol=1e-12, rtol=1e-9)
    torch.testing.assert_close(g, g_ref, atol=1e-12, rtol=1e-9)
    assert int((g != 0).sum()) >= 4 and int(((g == 0) & PAD_MASK.bool()).sum()) >= 1  # both kinds of token


def test_value_loss_gradient_matches_reference() -> None:
    values = t([[0.5, 1.5, -0.2, 0, 0], [2.0, 0.0, 0, 0, 0], [0.3, 0.9, 1.0, -1.0, 0.1]], dtype=torch.float64)
    old = t([[0.4, 1.0, -0.1, 0, 0], [1.0, 0.1, 0, 0, 0], [0.3, 1.2, 0.2, -0.5, 0.0]], dtype=torch.float64)
    ret = t([[1.0, 0.0, 0.0, 0, 0], [0.0, 1.0, 0, 0, 0], [0.0, 1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    m = PAD_MASK.double()
    for clip in (0.2, None):
        v = values.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(F.value_loss(v, old, ret, PAD_MASK, clip_range=clip)[0], v)
        v_r = values.clone().requires_grad_(True)
        clipped = v_r if clip is None else torch.min(torch.max(v_r, old - clip), old + clip)
        per_token = 0.5 * torch.max((v_r - ret) ** 2, (clipped - ret) ** 2)
        (g_ref,) = torch.autograd.grad((per_token * m).sum() / m.sum(), v_r)
        torch.testing.assert_close(g, g_ref, atol=1e-12, rtol=1e-9)
        assert bool(g.abs().sum() > 0)
