"""Pure-tensor math of PPO / GRPO-family algorithms.

Everything here is a stateless function of tensors (plus two tiny KL-coefficient controllers),
so it can be unit-tested on hand-sized inputs and shared by every algorithm plugin.

Conventions
-----------
* ``B`` sequences, ``T`` response tokens, right-padded.
* ``response_mask`` is ``(B, T)``, bool or float; a non-zero entry marks a real token.
* ``index`` is ``(B,)`` int64: a group id; samples of the same prompt share an id.
* ``scores`` are ``(B,)`` per-sequence rewards; ``token_level_rewards`` are ``(B, T)`` and carry the
  sequence reward at the last valid token (plus per-token KL penalties, if any).

Padding never leaks: every function that takes a mask replaces the padded entries of its inputs
with 0 (``torch.where``, before any arithmetic) and masks its outputs the same way, so even
``inf``/``nan`` garbage at padded positions cannot reach a loss, an advantage, a statistic or a
gradient: the gradient of a loss with respect to a padded input is exactly 0. Every
advantage/return tensor is exactly zero at padding.

Group statistics (means, stds, leave-one-out means) are computed in float64 and a group whose
scores are all equal gets advantage exactly 0, whatever the scores' dtype: a float32 group mean
is off by a rounding error, which the std would otherwise blow up to an advantage of order 1.

This module imports torch at top level; it is only imported lazily by the algorithm plugins.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rlx.plugins.modeling.logits import entropy_from_logits as entropy_from_logits
from rlx.plugins.modeling.logits import log_probs_from_logits as log_probs_from_logits

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_in_reward",
    "bypass_policy_loss",
    "cispo_policy_loss",
    "clip_cov_policy_loss",
    "count_equal_score_groups",
    "entropy_from_logits",
    "explained_variance",
    "gae_advantages",
    "geo_mean_policy_loss",
    "gpg_advantages",
    "gpg_policy_loss",
    "group_all_equal",
    "grpo_advantages",
    "grpo_passk_advantages",
    "gspo_policy_loss",
    "kl_cov_policy_loss",
    "kl_penalty",
    "log_probs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "opo_advantages",
    "optimal_token_baseline_advantages",
    "overlong_penalty",
    "ppo_policy_loss",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
    "rollout_correction_weights",
    "sapo_policy_loss",
    "scores_to_token_rewards",
    "value_loss",
]

Number = int | float

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

KL_ESTIMATORS: tuple[str, ...] = ("k1", "abs", "k2", "k3", "low_var_kl")
# verl's other names for two of them.
KL_ALIASES: dict[str, str] = {"kl": "k1", "mse": "k2"}
# Straight-through forms (verl's ``NAME+``): the value of NAME's estimate, the gradient of k2's.
KL_STRAIGHT_THROUGH: tuple[str, ...] = ("k1+", "k3+", "low_var_kl+")
KL_NAMES: tuple[str, ...] = KL_ESTIMATORS + tuple(KL_ALIASES) + KL_STRAIGHT_THROUGH

# Log-ratios are clamped to this range before ``exp``: exp(20) ~ 4.9e8 stays finite in float32.
_LOG_RATIO_CLAMP = 20.0
# GSPO's sequence log-ratio is clamped above only, at verl's 10.
_GSPO_LOG_RATIO_MAX = 10.0


# --------------------------------------------------------------------------------------------------
# Masked reductions
# --------------------------------------------------------------------------------------------------


def _bool_mask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``mask`` as a bool tensor broadcast to ``x``'s shape."""
    m = mask if mask.dtype == torch.bool else mask != 0
    return m.to(x.device).expand_as(x) if m.shape != x.shape else m.to(x.device)


def _zero_like_scalar(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=x.dtype, device=x.device)


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with its padded entries replaced by 0, so that nothing computed from it (values or
    gradients: the backward of ``where`` sends exactly 0 to the entries it did not pick) sees them."""
    return torch.where(_bool_mask(x, mask), x, _zero_like_scalar(x))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) over ``dim`` (all elements if ``None``); padded entries contribute exactly 0.

    Shapes: ``x`` (…), ``mask`` broadcastable to ``x``; result is a scalar or ``x`` reduced over ``dim``.
    """
    m = _bool_mask(x, mask)
    xm = torch.where(m, x, _zero_like_scalar(x))
    return xm.sum() if dim is None else xm.sum(dim=dim)


def _count_dtype(x: torch.Tensor) -> torch.dtype:
    """Counts and denominators are kept in float32 (float64 for float64 input): half precision
    cannot represent token counts above 256 exactly."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _mask_count(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    m = _bool_mask(x, mask).to(_count_dtype(x))
    return m.sum() if dim is None else m.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) / sum(mask) over ``dim``; an empty mask gives 0 (never NaN)."""
    total = masked_sum(x, mask, dim)
    count = _mask_count(x, mask, dim)
    return total / count.clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the valid entries of ``x`` (scalar), over all elements.

    var = sum(mask * (x - mean)^2) / n, times n / (n - 1) if ``unbiased``; n = sum(mask).
    Fewer than two valid entries give 0 (never NaN).
    """
    x = _masked(x, mask)
    mean = masked_mean(x, mask)
    centered_sq = (x - mean) ** 2
    n = _mask_count(x, mask)
    var = masked_sum(centered_sq, mask) / n.clamp(min=1.0)
    if unbiased:
        # n / (n - 1); for n <= 1 the variance is already 0, so any finite factor will do.
        var = var * n / (n - 1.0).clamp(min=1.0)
    return var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Whiten the valid entries of ``x`` with their masked mean and (unbiased) variance.

    out = (x - mean) / sqrt(var + eps); if not ``shift_mean`` the mean is added back:
    out = (x - mean) / sqrt(var + eps) + mean. Padded entries of the result are 0.
    """
    x = _masked(x, mask)
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(_bool_mask(x, mask), out, _zero_like_scalar(out))


# --------------------------------------------------------------------------------------------------
# Loss aggregation
# --------------------------------------------------------------------------------------------------


def _as_denominator(value: Number | torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device, dtype=_count_dtype(like))
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return torch.tensor(float(value), dtype=_count_dtype(like), device=like.device)


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: Number | torch.Tensor | None = None,
    num_seqs: Number | torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss matrix ``loss_mat`` (B, T) to a scalar.

    Modes (l = loss_mat, m = mask):
      * ``"token-mean"``:              sum_{i,t} l*m / N_tokens
      * ``"seq-mean-token-sum"``:      sum_i (sum_t l*m) / N_seqs
      * ``"seq-mean-token-mean"``:     sum_i (sum_t l*m / sum_t m) / N_seqs
      * ``"seq-mean-token-sum-norm"``: sum_i (sum_t l*m / max_len) / N_seqs   (Dr. GRPO)

    ``N_tokens`` defaults to sum(m); ``N_seqs`` to the number of sequences with at least one valid
    token; ``max_len`` to T. For gradient accumulation pass the *mini-batch* totals
    (``num_tokens``, ``num_seqs``, and the mini-batch ``max_len``) to every micro-batch call: the sum
    of the micro-batch losses then equals the full mini-batch loss exactly.
    An empty mask gives 0.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}")
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must be (B, T), got shape {tuple(loss_mat.shape)}")

    if mode == "token-mean":
        total = masked_sum(loss_mat, mask)  # ()
        if num_tokens is None:
            denom = _mask_count(loss_mat, mask).clamp(min=1.0)
        else:
            denom = _as_denominator(num_tokens, total, "num_tokens")
        return total / denom

    seq_sum = masked_sum(loss_mat, mask, dim=-1)  # (B,)
    tokens_per_seq = _mask_count(loss_mat, mask, dim=-1)  # (B,)
    if mode == "seq-mean-token-sum":
        per_seq = seq_sum
    elif mode == "seq-mean-token-mean":
        per_seq = seq_sum / tokens_per_seq.clamp(min=1.0)
    else:  # seq-mean-token-sum-norm
        length = loss_mat.shape[-1] if max_len is None else max_len
        if length <= 0:
            raise ValueError(f"max_len must be positive, got {length}")
        per_seq = seq_sum / float(length)

    if num_seqs is None:
        denom = (tokens_per_seq > 0).to(tokens_per_seq.dtype).sum().clamp(min=1.0)
    else:
        denom = _as_denominator(num_seqs, per_seq, "num_seqs")
    return per_seq.sum() / denom


# --------------------------------------------------------------------------------------------------
# KL, entropy, log-probs
# --------------------------------------------------------------------------------------------------


def kl_penalty(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    estimator: str,
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from sampled-token log-probs; shapes (B, T) -> (B, T).

    With d = logp - logp_ref:
      * ``"k1"``:                 d
      * ``"abs"``:                |d|
      * ``"k2"``:                 0.5 * d^2
      * ``"k3"`` / ``"low_var_kl"``: exp(-d) - (-d) - 1, clamped to [-10, 10]
      * ``"kl"`` = k1, ``"mse"`` = k2 (verl's names)
      * ``"k1+"``, ``"k3+"``, ``"low_var_kl+"``: straight-through, the value of k1 / k3 with the
        gradient of k2 (d per token)

    With ``response_mask`` both inputs are zeroed at padding first, so the result (and its
    gradient) is exactly 0 there whatever the padding holds; without it the result is not masked.
    For k3 the log-ratio is clamped to [-20, 20] before ``exp``, which does not change any output
    value (both ends already saturate the [-10, 10] clamp) but keeps it finite.
    """
    if response_mask is not None:
        log_probs, ref_log_probs = _masked(log_probs, response_mask), _masked(ref_log_probs, response_mask)
    estimator = KL_ALIASES.get(estimator, estimator)
    if estimator in KL_STRAIGHT_THROUGH:
        # value: the named estimate; gradient: k2's, d (the gradient whose expectation is KL's own gradient).
        value = kl_penalty(log_probs, ref_log_probs, estimator[:-1])
        k2 = 0.5 * (log_probs - ref_log_probs).square()
        return k2 - k2.detach() + value.detach()
    diff = log_probs - ref_log_probs  # (B, T)
    if estimator == "k1":
        return diff
    if estimator == "abs":
        return diff.abs()
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator in ("k3", "low_var_kl"):
        log_ratio = (-diff).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # logp_ref - logp
        kl = torch.exp(log_ratio) - log_ratio - 1.0
        return kl.clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; valid estimators: {', '.join(KL_NAMES)}")


# --------------------------------------------------------------------------------------------------
# Advantage estimators
# --------------------------------------------------------------------------------------------------


def _broadcast_to_tokens(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, T): ``values`` on every valid token, 0 at padding."""
    tok = values.unsqueeze(-1).expand(response_mask.shape)  # (B, T)
    return torch.where(_bool_mask(tok, response_mask), tok, _zero_like_scalar(tok))


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence score at its last valid token; (B,) -> (B, T), zero elsewhere.

    Rows without valid tokens are all zero.
    """
    m = _bool_mask(response_mask, response_mask)  # (B, T)
    T = m.shape[-1]
    positions = torch.arange(T, device=m.device).expand_as(m)  # (B, T)
    last = torch.where(m, positions, torch.full_like(positions, -1)).amax(dim=-1)  # (B,)
    at_last = positions == last.unsqueeze(-1)  # (B, T)
    tok = _float_scores(scores).unsqueeze(-1)  # (B, 1)
    return torch.where(at_last & m, tok, torch.zeros((), dtype=tok.dtype, device=tok.device))


def _group_stats(
    scores: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group size, group mean, group sum of squared deviations (float64, each (B,)) and
    whether every score of the row's group is equal ((B,) bool; True for singletons).

    float64 makes the mean of n equal float32 scores exactly that score (n * s is exact in float64
    for n < 2**29), and the equality flag lets callers give such groups exactly 0 whatever the
    input dtype (for float64 scores the mean of equal values can still be off by a rounding error).
    """
    index = torch.as_tensor(index, device=scores.device)
    if index.shape != scores.shape:
        raise ValueError(f"index shape {tuple(index.shape)} does not match scores {tuple(scores.shape)}")
    s = scores.to(torch.float64)  # (B,)
    uniq, inverse = torch.unique(index, return_inverse=True)  # inverse (B,) in [0, G)
    G = uniq.numel()
    zeros = torch.zeros(G, dtype=s.dtype, device=s.device)
    counts = zeros.index_add(0, inverse, torch.ones_like(s))  # (G,)
    mean = zeros.index_add(0, inverse, s) / counts.clamp(min=1.0)  # (G,)
    sq_dev = zeros.index_add(0, inverse, (s - mean[inverse]) ** 2)  # (G,)
    gmax = torch.full((G,), -math.inf, dtype=s.dtype, device=s.device).scatter_reduce(
        0, inverse, s, reduce="amax"
    )
    gmin = torch.full((G,), math.inf, dtype=s.dtype, device=s.device).scatter_reduce(
        0, inverse, s, reduce="amin"
    )
    return counts[inverse], mean[inverse], sq_dev[inverse], (gmax == gmin)[inverse]


def _float_scores(scores: torch.Tensor) -> torch.Tensor:
    return scores if scores.is_floating_point() else scores.to(torch.get_default_dtype())


def grpo_advantages(
    scores: torch.Tensor,
    index: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantages, broadcast to every valid token.

    A_i = (s_i - mean_g) / (std_g + eps) with std the unbiased (n - 1) group std; with
    ``norm_by_std=False`` (Dr. GRPO) A_i = s_i - mean_g. A group whose scores are all equal gets
    exactly A = 0, and so does a singleton group (no baseline can be formed from one sample).
    Statistics in float64, result in the scores' dtype. Returns ``(advantages, returns)``, both
    (B, T) and equal.
    """
    s = _float_scores(scores)  # (B,)
    n, mean, sq_dev, equal = _group_stats(s, index)  # (B,) each, float64
    adv = s.to(torch.float64) - mean  # (B,)
    if norm_by_std:
        std = torch.sqrt(sq_dev / (n - 1.0).clamp(min=1.0))  # (B,)
        adv = adv / (std + eps)
    adv = torch.where(equal, torch.zeros_like(adv), adv).to(s.dtype)  # singletons are "equal" too
    tok = _broadcast_to_tokens(adv, response_mask)  # (B, T)
    return tok, tok.clone()


def rloo_advantages(
    scores: torch.Tensor, index: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: A_i = s_i - (sum_g - s_i) / (n_g - 1), the mean of the *other* samples of the group.

    Groups whose scores are all equal, and singleton groups, get exactly 0. Statistics in float64.
    Returns ``(advantages, returns)`` (B, T), equal.
    """
    s = _float_scores(scores)  # (B,)
    n, mean, _, equal = _group_stats(s, index)  # float64
    s64 = s.to(torch.float64)
    loo_mean = (mean * n - s64) / (n - 1.0).clamp(min=1.0)  # (B,)
    adv = torch.where(equal, torch.zeros_like(s64), s64 - loo_mean).to(s.dtype)
    tok = _broadcast_to_tokens(adv, response_mask)
    return tok, tok.clone()


def _discounted_returns(rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{k >= t, valid} gamma^(#valid tokens from t to k, exclusive of t) r_k; 0 at padding."""
    m = _bool_mask(rewards, response_mask)  # (B, T)
    rewards = _masked(rewards, m)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)  # (B,)
    out = torch.zeros_like(rewards)  # (B, T)
    for t in reversed(range(rewards.shape[-1])):
        step = rewards[:, t] + gamma * running
        running = torch.where(m[:, t], step, running)  # padding is skipped, not discounted
        out[:, t] = torch.where(m[:, t], running, torch.zeros_like(running))
    return out


def reinforce_plus_plus_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, *, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: returns G_t = sum_{k>=t} gamma^(k-t) r_k over valid tokens; A = masked_whiten(G).

    Returns ``(advantages, returns)``, both (B, T) and zero at padding.
    """
    returns = _discounted_returns(token_level_rewards, response_mask, gamma)  # (B, T)
    advantages = masked_whiten(returns, response_mask)
    return advantages, returns


def reinforce_plus_plus_baseline_advantages(
    scores: torch.Tensor, index: torch.Tensor, response_mask: torch.Tensor, eps: float = 1e-8
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: c_i = s_i - mean_g (group mean in float64; exactly 0 for a group whose
    scores are all equal, singletons included), broadcast to tokens, then whitened over all valid
    tokens of the batch: A = masked_whiten(c, mask, eps=eps).

    ``returns`` is the un-whitened, group-mean-subtracted score c broadcast to tokens. (B, T) each.
    """
    s = _float_scores(scores)
    _, mean, _, equal = _group_stats(s, index)  # float64
    c = s.to(torch.float64) - mean
    c = torch.where(equal, torch.zeros_like(c), c).to(s.dtype)
    centered = _broadcast_to_tokens(c, response_mask)  # (B, T)
    advantages = masked_whiten(centered, response_mask, eps=eps)
    return advantages, centered


def remax_advantages(
    scores: torch.Tensor, baseline_scores: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: A_i = s_i - b_i with b_i the score of the greedy response to the same prompt.

    Returns ``(advantages, returns)`` with returns = s_i broadcast; (B, T) each.
    """
    s = _float_scores(scores)
    b = baseline_scores.to(s.dtype)
    return _broadcast_to_tokens(s - b, response_mask), _broadcast_to_tokens(s, response_mask)


def gae_advantages(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over valid tokens only.

    delta_t = r_t + gamma * V_{t'} - V_t  with t' the next valid token (V = 0 past the last one);
    A_t = delta_t + gamma * lam * A_{t'};  returns R_t = A_t + V_t.
    ``advantages`` are masked_whiten(A) if ``whiten`` else A. (B, T) each, zero at padding.
    """
    m = _bool_mask(token_level_rewards, response_mask)  # (B, T)
    token_level_rewards, values = _masked(token_level_rewards, m), _masked(values, m)
    B, T = token_level_rewards.shape
    zeros = torch.zeros(B, dtype=token_level_rewards.dtype, device=token_level_rewards.device)
    next_value = zeros  # (B,)
    last_gae = zeros  # (B,)
    adv = torch.zeros_like(token_level_rewards)  # (B, T)
    for t in reversed(range(T)):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        valid = m[:, t]
        last_gae = torch.where(valid, gae, last_gae)
        next_value = torch.where(valid, values[:, t], next_value)
        adv[:, t] = torch.where(valid, gae, zeros)
    returns = torch.where(m, adv + values, torch.zeros_like(adv))
    advantages = masked_whiten(adv, response_mask) if whiten else adv
    return advantages, returns


def opo_advantages(
    scores: torch.Tensor, index: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (on-policy RL with the optimal reward baseline, Hao et al. 2025): a length-weighted group baseline.

    b_g = sum_{j in g} L_j s_j / sum_{j in g} L_j with L_j the number of valid tokens of response j;
    A_i = s_i - b_g. As in verl a singleton group has baseline 0 (A_i = s_i); a group whose scores are
    all equal (two or more responses) gets exactly 0. Statistics in float64. ``(advantages, returns)``,
    (B, T) each and equal.
    """
    s = _float_scores(scores)  # (B,)
    n, _, _, equal = _group_stats(s, index)
    lengths = _bool_mask(response_mask, response_mask).to(torch.float64).sum(-1)  # (B,)
    index = torch.as_tensor(index, device=s.device)
    _, inverse = torch.unique(index, return_inverse=True)
    s64 = s.to(torch.float64)
    zeros = torch.zeros(int(inverse.max()) + 1 if inverse.numel() else 0, dtype=torch.float64, device=s.device)
    weighted = zeros.index_add(0, inverse, lengths * s64)[inverse]  # (B,)
    total = zeros.index_add(0, inverse, lengths)[inverse]  # (B,)
    baseline = torch.where((n > 1) & (total > 0), weighted / total.clamp(min=1.0), torch.zeros_like(s64))
    adv = torch.where(equal & (n > 1), torch.zeros_like(s64), s64 - baseline).to(s.dtype)
    tok = _broadcast_to_tokens(adv, response_mask)
    return tok, tok.clone()


def gpg_advantages(
    scores: torch.Tensor, index: torch.Tensor, response_mask: torch.Tensor, *, f_norm: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (group policy gradient, Chu et al. 2025) outcome advantages, as verl computes them.

    alpha = B / max(M, 1) with B the batch's responses and M how many of them have a non-zero score;
    A_i = alpha * (s_i - mean_g) / f_norm. A singleton group has mean 0 (A_i = alpha * s_i, as verl); a
    group whose scores are all equal (two or more responses) gets exactly 0. Statistics in float64.
    ``(advantages, returns)``, (B, T) each and equal.
    """
    if not f_norm > 0:
        raise ValueError(f"f_norm must be positive, got {f_norm}")
    s = _float_scores(scores)
    n, mean, _, equal = _group_stats(s, index)
    s64 = s.to(torch.float64)
    nonzero = float((s64 != 0).sum())
    alpha = s64.numel() / max(nonzero, 1.0)
    centred = s64 - torch.where(n > 1, mean, torch.zeros_like(mean))
    adv = torch.where(equal & (n > 1), torch.zeros_like(s64), alpha * centred / f_norm).to(s.dtype)
    tok = _broadcast_to_tokens(adv, response_mask)
    return tok, tok.clone()


def grpo_passk_advantages(
    scores: torch.Tensor,
    index: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k training (Chen et al. 2025, arXiv 2503.19595) in verl's GRPO form.

    In each group only the best response gets an advantage, s_max - s_second (the gap to the runner-up;
    0 when the top two tie), divided by (std_g + eps) with ``norm_by_std`` (unbiased std, as GRPO);
    every other response gets 0. With ties for the best the first in batch order is the best. verl
    raises on a group of one; here it gets 0. ``(advantages, returns)``, (B, T) each and equal.
    """
    s = _float_scores(scores)
    n, _, sq_dev, _ = _group_stats(s, index)
    s64 = s.to(torch.float64)
    index = torch.as_tensor(index, device=s.device)
    _, inverse = torch.unique(index, return_inverse=True)
    G = int(inverse.max()) + 1 if inverse.numel() else 0
    B = s64.numel()
    rows = torch.arange(B, device=s.device)
    # the best row of each group: highest score, the first such row on ties
    order = torch.argsort(s64, descending=True, stable=True)  # rows by score, earlier rows first on ties
    first = torch.full((G,), B, dtype=torch.long, device=s.device)
    rank = torch.empty(B, dtype=torch.long, device=s.device)
    rank[order] = rows
    best_rank = first.scatter_reduce(0, inverse, rank, reduce="amin")  # (G,)
    is_best = rank == best_rank[inverse]  # (B,)
    best_score = torch.full((G,), -math.inf, dtype=torch.float64, device=s.device).scatter_reduce(
        0, inverse, s64, reduce="amax")
    others = torch.where(is_best, torch.full_like(s64, -math.inf), s64)
    second = torch.full((G,), -math.inf, dtype=torch.float64, device=s.device).scatter_reduce(
        0, inverse, others, reduce="amax")
    gap = best_score[inverse] - second[inverse]  # (B,); inf for singletons
    if norm_by_std:
        std = torch.sqrt(sq_dev / (n - 1.0).clamp(min=1.0))
        gap = gap / (std + eps)
    adv = torch.where(is_best & (n > 1), gap, torch.zeros_like(s64)).to(s.dtype)
    tok = _broadcast_to_tokens(adv, response_mask)
    return tok, tok.clone()


def _compact(x: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's entries at ``m`` moved to the row's front, in order: (rows, width of the longest), and the
    position each entry came from (-1 where a row is shorter)."""
    lengths = m.sum(-1)
    width = int(lengths.max()) if lengths.numel() else 0
    slot = torch.cumsum(m.long(), dim=-1) - 1  # the slot of each kept entry
    out = torch.zeros((x.shape[0], width), dtype=x.dtype, device=x.device)
    where = torch.full((x.shape[0], width), -1, dtype=torch.long, device=x.device)
    rows, cols = m.nonzero(as_tuple=True)
    out[rows, slot[rows, cols]] = x[rows, cols]
    where[rows, slot[rows, cols]] = cols
    return out, where


def optimal_token_baseline_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    *,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = False,
    align: str = "position",
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal token baseline (verl's ``optimal_token_baseline`` / ``tir_optimal_token_baseline``): a baseline
    per token position, weighted by how much each response's score-function gradient has varied so far.

    G_it = sum_{u >= t} r_iu (reward to go); w_it = 1 - 2 pi_it + sum_v pi_itv^2, the squared norm of the
    gradient of log pi_it with respect to the logits, with pi_it = exp(old_log_probs_it) and ``sum_pi_squared``
    the sum over the vocabulary (times rho_it^2 with ``rollout_is_weights`` rho); W_it = sum_{u <= t} w_iu. In a
    group of N > 1 responses, B_t = sum_i G_it W_it / (sum_i W_it + eps) over the responses that have a token
    t, and A_it = G_it - B_t; a group of one has B = 0 (A = G). ``align="position"`` (``optimal_token_baseline``)
    compares the tokens at the same response position; ``"trained"`` (``tir_optimal_token_baseline``, for episodes
    whose tool output is masked out) the i-th trained token of each response. ``handle_zero_tail``: where a
    group's longest response is longer than all others, its tokens past the second longest get B = 0 (the
    baseline there would be the response's own return). Computed in float64; (advantages, returns), 0 outside
    the mask.
    """
    if align not in ("position", "trained"):
        raise ValueError(f"align must be 'position' or 'trained', got {align!r}")
    m = _bool_mask(token_level_rewards, response_mask)
    f64 = torch.float64
    r = _masked(token_level_rewards.to(f64), m)
    returns = r.flip(-1).cumsum(-1).flip(-1)
    pi = torch.exp(_masked(old_log_probs.to(f64), m))
    w = 1.0 - 2.0 * pi + _masked(sum_pi_squared.to(f64), m)
    if rollout_is_weights is not None:
        w = w * _masked(rollout_is_weights.to(f64), m).square()
    cum_w = _masked(w, m).cumsum(-1)
    if align == "trained":
        g, where = _compact(_masked(returns, m), m)
        big_w, _ = _compact(_masked(cum_w, m), m)
        valid = where >= 0
    else:
        g, big_w, valid, where = _masked(returns, m), _masked(cum_w, m), m, None
    lengths = valid.sum(-1)
    index = torch.as_tensor(index, device=r.device)
    _, inverse = torch.unique(index, return_inverse=True)
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    vf = valid.to(f64)
    num = torch.zeros((groups, g.shape[1]), dtype=f64, device=r.device).index_add_(0, inverse, g * big_w * vf)
    den = torch.zeros_like(num).index_add_(0, inverse, big_w * vf)
    # verl counts a group's responses: all of them by position, those with a trained token by trained index
    counted = (lengths > 0).to(f64) if align == "trained" else torch.ones_like(lengths, dtype=f64)
    size = torch.zeros(groups, dtype=f64, device=r.device).index_add_(0, inverse, counted)
    baseline = (num / (den + eps))[inverse]  # (B, width)
    baseline = torch.where((size[inverse] > 1)[:, None], baseline, torch.zeros_like(baseline))
    if handle_zero_tail and g.shape[0]:
        for grp in range(groups):
            rows = (inverse == grp).nonzero(as_tuple=True)[0]
            if rows.numel() < 2:
                continue
            lens = lengths[rows]
            top, second = torch.topk(lens, 2).values.tolist()
            if top > second and int((lens == top).sum()) == 1:
                baseline[rows[lens == top][0], second:] = 0.0
    adv = torch.where(valid, g - baseline, torch.zeros_like(g))
    if where is not None:
        out = torch.zeros_like(r)
        rows, slots = valid.nonzero(as_tuple=True)
        out[rows, where[rows, slots]] = adv[rows, slots]
        adv = out
    dtype = token_level_rewards.dtype if token_level_rewards.is_floating_point() else torch.float32
    return _masked(adv, m).to(dtype), _masked(returns, m).to(dtype)


# --------------------------------------------------------------------------------------------------
# Policy / value losses
# --------------------------------------------------------------------------------------------------


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token PPO clipped loss (B, T) and the clip-fraction metrics."""
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    loss_unclipped = -advantages * ratio  # (B, T)
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    negative = advantages < 0
    with torch.no_grad():
        clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask)
        clipfrac_low = masked_mean(((ratio < 1.0 - clip_low) & negative).float(), response_mask)
        clipfrac_high = masked_mean(((ratio > 1.0 + clip_high) & (advantages > 0)).float(), response_mask)
    if clip_ratio_c is not None:
        loss_dual = -advantages * clip_ratio_c  # (B, T)
        dual_active = negative & (loss_dual < loss_mat)
        loss_mat = torch.where(negative, torch.minimum(loss_mat, loss_dual), loss_mat)
        clipfrac_dual = masked_mean(dual_active.float(), response_mask).item()
    else:
        clipfrac_dual = 0.0
    metrics = {
        "pg_clipfrac": clipfrac.item(),
        "pg_clipfrac_low": clipfrac_low.item(),
        "pg_clipfrac_high": clipfrac_high.item(),
        "pg_clipfrac_dual": clipfrac_dual,
    }
    return loss_mat, metrics


def ppo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    agg_mode: str = "token-mean",
    num_tokens: Number | torch.Tensor | None = None,
    num_seqs: Number | torch.Tensor | None = None,
    max_len: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (with optional dual clip); all tensors (B, T).

    r_t = exp(clamp(logp_t - old_t, -20, 20))
    l_t = max(-A_t * r_t, -A_t * clip(r_t, 1 - clip_low, 1 + clip_high))
    dual clip (``clip_ratio_c`` = c > 1, default 3 as in verl; ``None`` turns it off):
    l_t = min(l_t, -A_t * c) where A_t < 0.
    ``token_weights`` w (B, T), e.g. truncated importance-sampling weights (:func:`tis_weights`), scale
    each token's loss: l_t = w_t * l_t (w is used as given: pass it detached).
    loss = agg_loss(l, mask, agg_mode, ...).

    Metrics (python floats, masked means over this call's valid tokens): ``pg_clipfrac`` (clipped
    term chosen), ``pg_clipfrac_low`` (r < 1 - clip_low and A < 0), ``pg_clipfrac_high``
    (r > 1 + clip_high and A > 0), ``pg_clipfrac_dual`` (dual clip active), ``ppo_kl``
    (mean of old - logp).
    """
    log_probs, old_log_probs, advantages = (
        _masked(x, response_mask) for x in (log_probs, old_log_probs, advantages)
    )
    log_ratio = (log_probs - old_log_probs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # (B, T)
    ratio = torch.exp(log_ratio)
    loss_mat, metrics = _clipped_surrogate(
        ratio, advantages, response_mask, clip_low, clip_high, clip_ratio_c
    )
    if token_weights is not None:
        loss_mat = loss_mat * _masked(token_weights, response_mask)
    loss = agg_loss(
        loss_mat, response_mask, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len
    )
    with torch.no_grad():
        # verl's: the mean of the clamped log-ratio, so one runaway token cannot dominate the metric
        metrics["ppo_kl"] = masked_mean(-log_ratio, response_mask).item()
    return loss, metrics


def gspo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = None,
    agg_mode: str = "seq-mean-token-mean",
    num_tokens: Number | torch.Tensor | None = None,
    num_seqs: Number | torch.Tensor | None = None,
    max_len: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: PPO clipping on a sequence-level, length-normalised importance ratio.

    s_i = exp(mean_{t valid} (logp_it - old_it))                     # (B,)
    r_it = exp(min(sg(log s_i) + logp_it - sg(logp_it), 10))   (value s_i; grad s_i * d logp_it;
           above e^10 the value is e^10 and the gradient 0, as verl)
    l_it = max(-A_it * r_it, -A_it * clip(r_it, 1 - clip_low, 1 + clip_high))
    loss = agg_loss(l, mask, agg_mode, ...)  (default ``seq-mean-token-mean``, so
    d loss = -(1/N_seqs) sum_i A_i s_i mean_t d logp_it on unclipped sequences).

    The GSPO paper uses far smaller clip ranges (about 3e-4 / 4e-4) than token-level PPO; the
    defaults here are kept equal to :func:`ppo_policy_loss` so the two are interchangeable.
    ``clip_ratio_c`` is accepted for signature compatibility and ignored (no dual clip).
    ``token_weights`` scale each token's loss as in :func:`ppo_policy_loss`.
    Metrics as in :func:`ppo_policy_loss` (``pg_clipfrac_dual`` is always 0).
    """
    del clip_ratio_c
    log_probs, old_log_probs, advantages = (
        _masked(x, response_mask) for x in (log_probs, old_log_probs, advantages)
    )
    seq_log_ratio = masked_mean(log_probs - old_log_probs, response_mask, dim=-1)  # (B,)
    log_ratio = seq_log_ratio.detach().unsqueeze(-1) + (log_probs - log_probs.detach())  # (B, T)
    # As verl: clamped above only, at 10, value and gradient (a sequence whose ratio exceeds e^10 gets no
    # gradient); below, exp underflows harmlessly to 0.
    log_ratio = log_ratio.clamp(max=_GSPO_LOG_RATIO_MAX)
    ratio = torch.exp(log_ratio)
    loss_mat, metrics = _clipped_surrogate(ratio, advantages, response_mask, clip_low, clip_high, None)
    if token_weights is not None:
        loss_mat = loss_mat * _masked(token_weights, response_mask)
    loss = agg_loss(
        loss_mat, response_mask, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len
    )
    with torch.no_grad():
        metrics["ppo_kl"] = masked_mean(old_log_probs - log_probs, response_mask).item()
    return loss, metrics


def _token_log_ratio(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs with padding zeroed, and log(pi / pi_old) per token clamped to +-20."""
    log_probs, old_log_probs, advantages = (
        _masked(x, response_mask) for x in (log_probs, old_log_probs, advantages)
    )
    log_ratio = (log_probs - old_log_probs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return log_probs, old_log_probs, advantages, log_ratio


def _aggregate(
    loss_mat: torch.Tensor,
    response_mask: torch.Tensor,
    agg_mode: str,
    token_weights: torch.Tensor | None,
    num_tokens: Number | torch.Tensor | None,
    num_seqs: Number | torch.Tensor | None,
    max_len: int | None,
) -> torch.Tensor:
    if token_weights is not None:
        loss_mat = loss_mat * _masked(token_weights, response_mask)
    return agg_loss(loss_mat, response_mask, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len)


@torch.no_grad()
def _ppo_kl(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> float:
    return masked_mean(-log_ratio, response_mask).item()


def sapo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = None,
    agg_mode: str = "seq-mean-token-mean",
    num_tokens: Number | torch.Tensor | None = None,
    num_seqs: Number | torch.Tensor | None = None,
    max_len: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO (soft adaptive policy optimisation, arXiv 2511.20347): a smooth gate instead of a hard clip.

    r_t = exp(clamp(logp_t - old_t, -20, 20)); tau_t = tau_pos where A_t > 0, else tau_neg;
    f(r) = sigmoid(tau (r - 1)) * 4 / tau;  l_t = -f(r_t) A_t. At r = 1, f = 2 / tau and df/dr = 1 (the
    on-policy gradient is PPO's); far from 1 the gradient fades instead of stopping. No clip ranges
    (``clip_*`` are accepted for a common signature and ignored). Metrics: ``ppo_kl``.
    """
    del clip_low, clip_high, clip_ratio_c
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"tau_pos and tau_neg must be positive, got {tau_pos}, {tau_neg}")
    _, _, advantages, log_ratio = _token_log_ratio(log_probs, old_log_probs, advantages, response_mask)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = _aggregate(-gate * advantages, response_mask, agg_mode, token_weights, num_tokens, num_seqs, max_len)
    return loss, {"ppo_kl": _ppo_kl(log_ratio, response_mask)}


def gpg_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = None,
    agg_mode: str = "token-mean",
    num_tokens: Number | torch.Tensor | None = None,
    num_seqs: Number | torch.Tensor | None = None,
    max_len: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GPG's plain policy gradient (no ratio, no clip): l_t = -A_t logp_t. Metrics: ``ppo_kl``."""
    del clip_low, clip_high, clip_ratio_c
    log_probs, _, advantages, log_ratio = _token_log_ratio(log_probs, old_log_probs, advantages, response_mask)
    loss = _aggregate(-advantages * log_probs, response_mask, agg_mode, token_weights, num_tokens, num_seqs,
                      max_len)
    return loss, {"ppo_kl": _ppo_kl(log_ratio, response_mask)}


@torch.no_grad()
def _token_covariance(log_probs: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(A_t - mean A) (logp_t - mean logp) per token, means over the valid tokens of the call; -inf at padding."""
    a = advantages.detach()
    lp = log_probs.detach()
    cov = (a - masked_mean(a, valid)) * (lp - masked_mean(lp, valid))
    return torch.where(valid, cov, torch.full_like(cov, -math.inf))


def clip_cov_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = None,
    agg_mode: str = "token-mean",
    num_tokens: Number | torch.Tensor | None = None,
    num_seqs: Number | torch.Tensor | None = None,
    max_len: int | None = None,
    token_weights: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"), as verl computes it.

    The PPO clipped loss l_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) (no dual clip), except
    that up to k = max(1, floor(clip_cov_ratio * N)) tokens (N: this call's valid tokens) get no loss and
    no gradient: chosen at random (``generator``) among the tokens not already clipped by PPO whose
    covariance cov_t = (A_t - mean A)(logp_t - mean logp) lies strictly between clip_cov_lb and
    clip_cov_ub. High-covariance tokens drive the collapse of entropy; detaching a few keeps it up.
    Metrics: ``pg_clipfrac`` (PPO-clipped share), ``pg_covfrac`` (share detached), ``ppo_kl``.
    """
    del clip_ratio_c
    if not 0 < clip_cov_ratio <= 1:
        raise ValueError(f"clip_cov_ratio must be in (0, 1], got {clip_cov_ratio}")
    if not clip_cov_lb < clip_cov_ub:
        raise ValueError(f"clip_cov_lb must be below clip_cov_ub, got {clip_cov_lb}, {clip_cov_ub}")
    log_probs, _, advantages, log_ratio = _token_log_ratio(log_probs, old_log_probs, advantages, response_mask)
    valid = _bool_mask(log_probs, response_mask)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    with torch.no_grad():
        ppo_clipped = (loss_clipped > loss_unclipped) & valid
        cov = _token_covariance(log_probs, advantages, valid)
        candidates = valid & ~ppo_clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        flat = torch.nonzero(candidates.reshape(-1), as_tuple=True)[0]
        k = max(int(clip_cov_ratio * int(valid.sum())), 1)
        if flat.numel() > k:
            flat = flat[torch.randperm(flat.numel(), generator=generator, device=flat.device)[:k]]
        keep = torch.ones(valid.numel(), dtype=torch.bool, device=valid.device)
        keep[flat] = False
        keep = keep.reshape(valid.shape)
    loss_mat = torch.where(keep, torch.maximum(loss_unclipped, loss_clipped), _zero_like_scalar(ratio))
    loss = _aggregate(loss_mat, response_mask, agg_mode, token_weights, num_tokens, num_seqs, max_len)
    metrics = {"pg_clipfrac": masked_mean(ppo_clipped.to(ratio.dtype), valid).item(),
               "pg_covfrac": masked_mean((~keep).to(ratio.dtype), valid).item(),
               "ppo_kl": _ppo_kl(log_ratio, response_mask)}
    return loss, metrics


def kl_cov_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 0.1,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = None,
    agg_mode: str = "token-mean",
    num_tokens: Number | torch.Tensor | None = None,
    num_seqs: Number | torch.Tensor | None = None,
    max_len: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (Cui et al. 2025), as verl computes it: the unclipped surrogate l_t = -A_t r_t, plus
    ppo_kl_coef * |logp_t - old_t| on the k = max(1, floor(kl_cov_ratio * N)) valid tokens of this call
    with the largest covariance (A_t - mean A)(logp_t - mean logp). No clip ranges (``clip_*`` are
    ignored). Metrics: ``pg_covfrac`` (share penalised), ``ppo_kl``.
    """
    del clip_low, clip_high, clip_ratio_c
    if not 0 < kl_cov_ratio <= 1:
        raise ValueError(f"kl_cov_ratio must be in (0, 1], got {kl_cov_ratio}")
    if not ppo_kl_coef >= 0:
        raise ValueError(f"ppo_kl_coef must be >= 0, got {ppo_kl_coef}")
    log_probs, _, advantages, log_ratio = _token_log_ratio(log_probs, old_log_probs, advantages, response_mask)
    valid = _bool_mask(log_probs, response_mask)
    loss_mat = -advantages * torch.exp(log_ratio)
    n_valid = int(valid.sum())
    with torch.no_grad():
        penalised = torch.zeros_like(valid)
        if n_valid:
            cov = _token_covariance(log_probs, advantages, valid).reshape(-1)
            k = max(1, int(n_valid * kl_cov_ratio))
            top = torch.topk(cov, k, largest=True).indices
            penalised.view(-1)[top] = True
    loss_mat = loss_mat + torch.where(penalised, ppo_kl_coef * log_ratio.abs(), _zero_like_scalar(loss_mat))
    loss = _aggregate(loss_mat, response_mask, agg_mode, token_weights, num_tokens, num_seqs, max_len)
    return loss, {"pg_covfrac": masked_mean(penalised.to(loss_mat.dtype), valid).item(),
                  "ppo_kl": _ppo_kl(log_ratio, response_mask)}


def geo_mean_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = None,
    agg_mode: str = "seq-mean-token-mean",
    num_tokens: Number | torch.Tensor | None = None,
    num_seqs: Number | torch.Tensor | None = None,
    max_len: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO (geometric-mean policy optimisation, arXiv 2507.20673): the geometric mean of the token
    ratios of a response, each clipped in log space, times the response's mean advantage.

    d_t = clamp(logp_t - old_t, -20, 20); clipped per token on the side that matters for the sign of A_t:
    c_t = min(d_t, clip_high) if A_t > 0, max(d_t, -clip_low) if A_t < 0, 0 if A_t = 0 (the clip ranges
    are bounds on the *log*-ratio; GMPO's paper uses wider ones than PPO, e.g. 0.4);
    rho_i = exp(mean_t c_t), A_i = mean_t A_t, l_i = -A_i rho_i on every token of response i, aggregated
    with ``agg_mode`` (default seq-mean-token-mean: the mean of l_i over responses, as verl).
    ``token_weights`` enter as their geometric mean per response. Metrics: ``pg_clipfrac_high`` (A > 0 and
    d > clip_high), ``pg_clipfrac_low`` (A < 0 and d < -clip_low), ``pg_clipfrac`` (their sum), ``ppo_kl``.
    """
    del clip_ratio_c
    _, _, advantages, log_ratio = _token_log_ratio(log_probs, old_log_probs, advantages, response_mask)
    valid = _bool_mask(log_ratio, response_mask)
    zero = _zero_like_scalar(log_ratio)
    clipped = torch.where(advantages > 0, log_ratio.clamp(max=clip_high),
                          torch.where(advantages < 0, log_ratio.clamp(min=-clip_low), zero))
    seq_ratio = torch.exp(masked_mean(clipped, valid, dim=-1))  # (B,)
    seq_adv = masked_mean(advantages, valid, dim=-1)  # (B,)
    seq_loss = -seq_adv * seq_ratio  # (B,)
    if token_weights is not None:
        w = _masked(token_weights, valid).clamp(min=1e-30)
        seq_loss = seq_loss * torch.exp(masked_mean(torch.log(w), valid, dim=-1))
    loss_mat = _broadcast_to_tokens(seq_loss, valid)
    loss = agg_loss(loss_mat, response_mask, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len)
    with torch.no_grad():
        high = masked_mean(((advantages > 0) & (log_ratio > clip_high)).to(log_ratio.dtype), valid).item()
        low = masked_mean(((advantages < 0) & (log_ratio < -clip_low)).to(log_ratio.dtype), valid).item()
    return loss, {"pg_clipfrac": high + low, "pg_clipfrac_high": high, "pg_clipfrac_low": low,
                  "ppo_kl": _ppo_kl(log_ratio, response_mask)}


def cispo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = None,
    agg_mode: str = "token-mean",
    num_tokens: Number | torch.Tensor | None = None,
    num_seqs: Number | torch.Tensor | None = None,
    max_len: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, not the update.

    w_t = sg(clip(r_t, 1 - clip_low, 1 + clip_high)), l_t = -w_t A_t logp_t: every token keeps a
    gradient (w_t A_t d logp_t), however far its ratio has moved. Metrics: ``pg_clipfrac`` (share of
    tokens whose weight was clipped), ``ppo_kl``.
    """
    del clip_ratio_c
    log_probs, _, advantages, log_ratio = _token_log_ratio(log_probs, old_log_probs, advantages, response_mask)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high).detach()
    loss_mat = -weight * advantages * log_probs
    loss = _aggregate(loss_mat, response_mask, agg_mode, token_weights, num_tokens, num_seqs, max_len)
    with torch.no_grad():
        clipfrac = masked_mean((ratio != weight).to(ratio.dtype), response_mask).item()
    return loss, {"pg_clipfrac": clipfrac, "ppo_kl": _ppo_kl(log_ratio, response_mask)}


@torch.no_grad()
def tis_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor, cap: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance-sampling weights for responses sampled by a rollout engine whose
    probabilities differ from the trainer's (Yao et al., 2025; verl's ``tis_imp_ratio_cap``); (B, T) each.

    w_t = min(exp(old_t - rollout_t), cap) on valid tokens, 0 at padding; no gradient flows through w.
    Metrics over valid tokens: ``tis_weight_mean`` and ``tis_clipfrac`` (share of tokens whose ratio
    exceeded ``cap``).
    """
    if not cap > 0:
        raise ValueError(f"the TIS cap must be positive, got {cap}")
    m = _bool_mask(old_log_probs, response_mask)
    log_ratio = _masked(old_log_probs.float() - rollout_log_probs.float(), m).clamp(max=_LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    weights = _masked(ratio.clamp(max=cap), m)
    metrics = {"tis_weight_mean": masked_mean(weights, m).item(),
               "tis_clipfrac": masked_mean((ratio > cap).float(), m).item()}
    return weights, metrics


# verl's rollout rejection modes (algorithm.rollout_correction.rollout_rs): a statistic of the per-token log-ratio
# d = log pi_old - log pi_rollout, per token or per sequence. k1 = -d (log pi_rollout / pi_old) is kept inside a band
# [log lower, log upper]; k2 = d^2 / 2 and k3 = exp(d) - 1 - d are kept at or below an upper bound.
ROLLOUT_RS_MODES: tuple[str, ...] = (
    "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",
)


@torch.no_grad()
def rollout_correction_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: str | None = None,
    threshold: float = 2.0,
    batch_normalize: bool = False,
    rejection: list[tuple[str, float | None, float]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Rollout correction (verl's ``algorithm.rollout_correction``): ``(weights, keep, metrics)``, weights and keep
    (B, T), detached.

    With d_t = clamp(log pi_old - log pi_rollout, -20, 20) on real tokens (``old_log_probs`` is whatever policy the
    weights correct towards: pi_old, or the current policy in bypass mode):

    * ``rollout_is="token"``: w_t = min(exp(d_t), threshold) (token TIS);
      ``"sequence"``: w_it = min(exp(clamp(sum_t d_it, -20, 20)), threshold) on every token of response i;
      ``"geometric"``: w_it = min(exp(mean_t d_it), threshold), the geometric mean of the response's token ratios
      (length-normalised, so long responses are not pushed to the cap);
      ``None``: w = 1. With ``batch_normalize`` the weights are divided by their mean (over real tokens for
      token, over responses otherwise), after truncation.
    * ``rejection``: ``(mode, lower, upper)`` triples (:data:`ROLLOUT_RS_MODES`); ``keep`` is False at a token, or
      at every token of a sequence, whose statistic leaves its bounds (all triples must pass), and at padding.
      Rejected tokens also get weight 0.

    Metrics (over real tokens; over responses for the sequence ones): ``is_weight_mean`` / ``_std`` / ``_min`` /
    ``_max`` (the weights applied to kept tokens), ``is_ratio_max`` (before truncation), ``is_clipfrac`` (share
    truncated), ``is_eff_sample_size`` ((sum w)^2 / (n sum w^2) over the n tokens or responses, 1 when every weight
    is equal), ``is_batch_norm_factor``; ``rs_masked_fraction`` (tokens rejected), ``rs_seq_masked_fraction``
    (responses with a rejected token), ``rs_<mode>_masked_fraction`` per mode; and the mismatch itself:
    ``kl`` (mean of log pi_rollout - log pi_old, k1 of KL(pi_rollout || pi_old)), ``k3_kl`` (mean of
    exp(d) - 1 - d), ``chi2_token`` (mean of exp(2 d) - 1), ``chi2_seq`` (mean over responses of exp(2 sum d) - 1),
    ``training_ppl`` / ``rollout_ppl`` (mean over responses of exp(-mean log-prob)).
    """
    m = _bool_mask(old_log_probs, response_mask)
    dtype = torch.float64 if old_log_probs.dtype == torch.float64 else torch.float32
    old, rollout = old_log_probs.to(dtype), rollout_log_probs.to(dtype)
    d = _masked(old - rollout, m).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    nonempty = m.any(dim=-1)  # (B,)
    metrics: dict[str, float] = {}
    seq_level = rollout_is in ("sequence", "geometric")
    if rollout_is is None:
        weights = torch.ones_like(d)
    else:
        if not threshold > 0:
            raise ValueError(f"rollout_is_threshold must be positive, got {threshold}")
        if rollout_is == "token":
            ratio = torch.exp(d)
        elif rollout_is == "sequence":
            seq = masked_sum(d, m, dim=-1).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # (B,)
            ratio = torch.exp(seq).unsqueeze(-1).expand_as(d)
        elif rollout_is == "geometric":
            ratio = torch.exp(masked_mean(d, m, dim=-1)).unsqueeze(-1).expand_as(d)
        else:
            raise ValueError(f"rollout_is must be 'token', 'sequence' or 'geometric', got {rollout_is!r}")
        weights = ratio.clamp(max=threshold)
        metrics["is_ratio_max"] = float(ratio[m].max()) if bool(m.any()) else 0.0
        metrics["is_clipfrac"] = masked_mean((ratio > threshold).to(dtype), m).item()
        if batch_normalize:
            # one weight per response for the sequence-level weights
            mean = masked_mean(masked_mean(weights, m, dim=-1), nonempty) if seq_level else masked_mean(weights, m)
            factor = float(mean) if float(mean) > 1e-8 else 1.0
            weights = weights / factor
            metrics["is_batch_norm_factor"] = factor
    keep = m.clone()
    if rejection:
        k1 = -d
        k2 = 0.5 * d.square()
        k3 = torch.exp(d) - 1.0 - d
        for mode, lower, upper in rejection:
            stat_name = mode.rsplit("_", 1)[1]
            token_stat = {"k1": k1, "k2": k2, "k3": k3}[stat_name]
            if mode.startswith("token_"):
                stat = token_stat
            elif mode.startswith("seq_sum_"):
                stat = masked_sum(token_stat, m, dim=-1).unsqueeze(-1).expand_as(d)
            elif mode.startswith("seq_mean_"):
                stat = masked_mean(token_stat, m, dim=-1).unsqueeze(-1).expand_as(d)
            elif mode.startswith("seq_max_") and stat_name != "k1":
                stat = torch.where(m, token_stat, torch.full_like(token_stat, -math.inf)).amax(dim=-1)
                stat = torch.where(nonempty, stat, torch.zeros_like(stat)).unsqueeze(-1).expand_as(d)
            else:
                raise ValueError(f"unknown rollout_rs mode {mode!r}; valid modes: {', '.join(ROLLOUT_RS_MODES)}")
            if stat_name == "k1":
                if lower is None:
                    raise ValueError(f"rollout_rs mode {mode} needs a lower and an upper bound")
                passed = (stat >= math.log(lower)) & (stat <= math.log(upper))
            else:
                passed = stat <= upper
            metrics[f"rs_{mode}_masked_fraction"] = masked_mean((~passed).to(dtype), m).item()
            keep &= passed
        rejected = m & ~keep
        metrics["rs_masked_fraction"] = masked_mean(rejected.to(dtype), m).item()
        metrics["rs_seq_masked_fraction"] = masked_mean(rejected.any(dim=-1).to(dtype), nonempty).item()
    weights = torch.where(keep, weights, torch.zeros_like(weights))
    metrics.update(_weight_stats(weights, keep, seq_level))
    metrics.update(_mismatch_stats(old, rollout, d, m, nonempty))
    return weights, keep, metrics


def _weight_stats(weights: torch.Tensor, keep: torch.Tensor, seq_level: bool) -> dict[str, float]:
    """Statistics of the weights of kept tokens (of kept responses, one weight each, for sequence weights)."""
    w = weights[keep]
    if seq_level:
        rows = keep.any(dim=-1)
        w = (masked_sum(weights, keep, dim=-1) / keep.sum(-1).clamp(min=1).to(weights.dtype))[rows]
    if not w.numel():
        return {"is_weight_mean": 0.0, "is_weight_std": 0.0, "is_weight_min": 0.0, "is_weight_max": 0.0,
                "is_eff_sample_size": 0.0}
    square = float(w.square().sum())
    return {"is_weight_mean": float(w.mean()), "is_weight_std": float(w.std()) if w.numel() > 1 else 0.0,
            "is_weight_min": float(w.min()), "is_weight_max": float(w.max()),
            "is_eff_sample_size": float(w.sum()) ** 2 / (w.numel() * square) if square > 0 else 0.0}


def _mismatch_stats(old: torch.Tensor, rollout: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                    nonempty: torch.Tensor) -> dict[str, float]:
    """How far the rollout engine's distribution is from the trainer's, on the sampled tokens."""
    if not bool(m.any()):
        return {}
    seq_d = masked_sum(d, m, dim=-1).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)[nonempty]
    mean_old = masked_mean(_masked(old, m), m, dim=-1)[nonempty]
    mean_rollout = masked_mean(_masked(rollout, m), m, dim=-1)[nonempty]
    return {"kl": masked_mean(-d, m).item(), "k3_kl": masked_mean(torch.exp(d) - 1.0 - d, m).item(),
            "chi2_token": masked_mean(torch.exp(2.0 * d), m).item() - 1.0,
            "chi2_seq": float(torch.exp(2.0 * seq_d).mean()) - 1.0,
            "training_ppl": float(torch.exp(-mean_old).mean()), "rollout_ppl": float(torch.exp(-mean_rollout).mean())}


def bypass_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_type: str = "ppo_clip",
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_is_batch_normalize: bool = False,
    rejection: list[tuple[str, float | None, float]] | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    agg_mode: str = "token-mean",
    num_tokens: Number | torch.Tensor | None = None,
    num_seqs: Number | torch.Tensor | None = None,
    max_len: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's bypass mode: two policies, pi_rollout (``old_log_probs`` here are the rollout engine's log-probs: the
    old-log-prob pass is skipped) and the policy being trained.

    The rollout correction is computed per call between the current policy (detached) and pi_rollout
    (:func:`rollout_correction_weights` with ``old_log_probs`` = the current log-probs): tokens it rejects leave
    the policy loss (they keep counting in the caller's ``num_tokens`` / ``num_seqs``). Then

    * ``loss_type="ppo_clip"``: :func:`ppo_policy_loss` with ratio pi / pi_rollout; the IS weights are only
      reported (the clipped ratio already is the importance correction; weighting again would count it twice);
    * ``loss_type="reinforce"``: REINFORCE, -w A logp (:func:`gpg_policy_loss`, the same loss), w the truncated IS
      weights of ``rollout_is`` (none: plain REINFORCE).

    ``token_weights`` from the caller multiply on top. Metrics: the loss's, plus the correction's prefixed
    ``rollout_corr/``.
    """
    if loss_type not in ("ppo_clip", "reinforce"):
        raise ValueError(f"bypass mode's loss_type must be 'ppo_clip' or 'reinforce', got {loss_type!r}")
    weights, keep, rc = rollout_correction_weights(
        log_probs.detach(), old_log_probs, response_mask, rollout_is=rollout_is, threshold=rollout_is_threshold,
        batch_normalize=rollout_is_batch_normalize, rejection=rejection)
    mask = keep.to(log_probs.dtype)
    extra = weights.to(log_probs.dtype) if (loss_type == "reinforce" and rollout_is is not None) else None
    if token_weights is not None:
        extra = token_weights if extra is None else extra * token_weights
    norm = {"num_tokens": num_tokens, "num_seqs": num_seqs, "max_len": max_len}
    if loss_type == "ppo_clip":
        loss, metrics = ppo_policy_loss(log_probs, old_log_probs, advantages, mask, clip_low=clip_low,
                                        clip_high=clip_high, clip_ratio_c=clip_ratio_c, agg_mode=agg_mode,
                                        token_weights=extra, **norm)
    else:
        loss, metrics = gpg_policy_loss(log_probs, old_log_probs, advantages, mask, agg_mode=agg_mode,
                                        token_weights=extra, **norm)
    metrics.update({f"rollout_corr/{k}": v for k, v in rc.items()})
    return loss, metrics


@torch.no_grad()
def logprob_diff(
    rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> tuple[float, float]:
    """``(mean, max)`` of |rollout_t - old_t| over valid response tokens: how far the rollout engine's
    probabilities of the sampled tokens are from the trainer's. ``(0.0, 0.0)`` without valid tokens."""
    m = _bool_mask(old_log_probs, response_mask)
    diff = (rollout_log_probs.float() - old_log_probs.float()).abs()[m]
    if not diff.numel():
        return 0.0, 0.0
    return diff.mean().item(), diff.max().item()


POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {
    "vanilla": ppo_policy_loss,
    "gspo": gspo_policy_loss,
    "sapo": sapo_policy_loss,
    "gpg": gpg_policy_loss,
    "clip_cov": clip_cov_policy_loss,
    "kl_cov": kl_cov_policy_loss,
    "geo_mean": geo_mean_policy_loss,
    "cispo": cispo_policy_loss,
    "bypass_mode": bypass_policy_loss,
}


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_range: float | None = 0.2,
    agg_mode: str = "token-mean",
    num_tokens: Number | torch.Tensor | None = None,
    num_seqs: Number | torch.Tensor | None = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss; all tensors (B, T).

    v_c = old + clamp(v - old, -c, c);  l_t = 0.5 * max((v - R)^2, (v_c - R)^2)
    (``clip_range=None`` disables clipping: l_t = 0.5 * (v - R)^2). loss = agg_loss(l, mask, ...).
    Metrics: ``vf_clipfrac`` (fraction of valid tokens where the clipped term is larger) and
    ``vf_loss`` (the aggregated loss as a float).
    """
    values, old_values, returns = (_masked(x, response_mask) for x in (values, old_values, returns))
    loss_unclipped = (values - returns).square()  # (B, T)
    if clip_range is None:
        loss_mat = 0.5 * loss_unclipped
        clipfrac = 0.0
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
        loss_clipped = (clipped_values - returns).square()
        loss_mat = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
        with torch.no_grad():
            clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask).item()
    loss = agg_loss(
        loss_mat, response_mask, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len
    )
    return loss, {"vf_clipfrac": clipfrac, "vf_loss": loss.item()}


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over valid tokens (python float).

    Returns 0.0 (not NaN) when Var(R) is 0 or there are fewer than two valid tokens.
    """
    var_returns = masked_var(returns, mask, unbiased=False)
    if var_returns.item() <= 0.0:
        return 0.0
    var_residual = masked_var(returns - values, mask, unbiased=False)
    return (1.0 - var_residual / var_returns).item()


# --------------------------------------------------------------------------------------------------
# KL coefficient controllers and reward shaping
# --------------------------------------------------------------------------------------------------


class FixedKLController:
    """A constant KL coefficient; ``update`` is a no-op."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept for interface parity with :class:`AdaptiveKLController`)."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al., 2019).

    e = clip(current_kl / target_kl - 1, -0.2, 0.2);  value *= 1 + e * n_steps / horizon.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0:
            raise ValueError(f"target_kl must be positive, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be positive, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def apply_kl_in_reward(
    token_level_scores: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, float]:
    """Subtract a per-token KL penalty from the token-level scores; (B, T) each.

    r_t = score_t - kl_coef * kl_t on valid tokens, 0 at padding (kl_t from :func:`kl_penalty`).
    ``mean_kl`` (python float) is the mean over sequences that have at least one valid token of
    each sequence's masked token-mean KL — the quantity fed to ``AdaptiveKLController.update``.
    """
    kl = kl_penalty(log_probs, ref_log_probs, estimator, response_mask)  # (B, T), 0 at padding
    m = _bool_mask(kl, response_mask)
    rewards = _masked(token_level_scores, m) - kl_coef * kl
    seq_kl = masked_mean(kl, m, dim=-1)  # (B,)
    nonempty = m.any(dim=-1)  # (B,)
    mean_kl = masked_mean(seq_kl, nonempty).item()
    return rewards, mean_kl


def overlong_penalty(
    response_lengths: torch.Tensor,
    *,
    max_len: int,
    buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment per sequence; (B,) -> (B,) float.

    With L_exp = max_len - buffer_len:
      0                                        if L <= L_exp
      -(L - L_exp) / buffer_len * penalty_factor  if L_exp < L <= max_len
      -penalty_factor                          if L > max_len
    ``buffer_len = 0`` is a hard cut-off (-penalty_factor only beyond max_len).
    """
    if buffer_len < 0 or buffer_len > max_len:
        raise ValueError(f"buffer_len must be in [0, max_len], got {buffer_len} (max_len={max_len})")
    lengths = _float_scores(response_lengths)  # (B,)
    if buffer_len == 0:
        return torch.where(lengths > max_len, -penalty_factor, 0.0).to(lengths.dtype)
    expected = float(max_len - buffer_len)
    return -((lengths - expected) / buffer_len).clamp(0.0, 1.0) * penalty_factor


def group_all_equal(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B,) bool: True where every score of the row's group is exactly equal (zero-variance groups,
    which DAPO dynamic sampling filters out). Singleton groups are True."""
    return _group_stats(_float_scores(scores), index)[3]


def count_equal_score_groups(scores: torch.Tensor, index: torch.Tensor) -> tuple[int, int]:
    """``(groups, equal)``: the number of groups with two or more responses, and how many of those
    have scores that are all exactly equal (for group-relative estimators: zero advantage).
    Singleton groups are in neither count."""
    n, _, _, equal = _group_stats(_float_scores(scores), index)  # (B,) each
    share = torch.where(n > 1, 1.0 / n, torch.zeros_like(n))  # each row holds 1/n of its group
    return round(float(share.sum())), round(float(torch.where(equal, share, torch.zeros_like(share)).sum()))



PF_PPO_METHODS = ("pow", "max_min", "max_random")


def pf_ppo_weights(scores: torch.Tensor, method: str, weight_pow: float = 2.0) -> torch.Tensor:
    """PF-PPO's (Policy Filtration PPO) resampling weights of B responses from their sequence scores, (B,) float32,
    as verl's ``compute_pf_ppo_reweight_data``:

      pow         |s_i| ** weight_pow
      max_min     1 where s_i is the batch's highest or lowest score, else 0
      max_random  0.4 where s_i is the batch's highest score, else 0.1

    then each weight + 1e-8 (clamped at 1e-8 from below), so that every response can still be drawn."""
    s = _float_scores(scores)
    if method == "pow":
        w = s.abs().pow(float(weight_pow))
    elif method == "max_min":
        w = ((s == s.max()) | (s == s.min())).float()
    elif method == "max_random":
        w = torch.where(s == s.max(), 0.4, 0.1).float()
    else:
        raise ValueError(f"pf_ppo reweight_method must be one of {', '.join(PF_PPO_METHODS)}, got {method!r}")
    return (w + 1e-8).clamp(min=1e-8)


def pf_ppo_resample(scores: torch.Tensor, method: str, weight_pow: float,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """(B,) long: B row indices drawn with replacement, each row with probability proportional to its
    :func:`pf_ppo_weights`; the batch to train on is the batch's rows at these indices."""
    weights = pf_ppo_weights(scores, method, weight_pow).cpu()
    return torch.multinomial(weights, len(weights), replacement=True, generator=generator)
