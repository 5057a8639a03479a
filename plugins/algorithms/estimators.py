"""The built-in advantage estimators, registered as ``kind="advantage"`` components.

Every estimator has the same signature, ``fn(inputs: EstimatorInputs) -> (advantages, returns)``
with both (B, R) and 0 at padding (see :class:`rlx.protocols.EstimatorInputs`), and is picked by
name with ``algorithm.adv_estimator=NAME``. A third-party plugin adds one the same way::

    from rlx import Component, hookimpl
    from rlx.protocols import EstimatorInputs, advantage_estimator

    @advantage_estimator(requires=[])          # or ["values"] for a critic, ["baseline_scores"], ["sum_pi_squared"]
    def sign(inputs: EstimatorInputs):
        adv = inputs.scores.sign()[:, None] * inputs.response_mask
        return adv, adv

    @hookimpl
    def rlx_advantage_estimators():
        return [Component(kind="advantage", name="sign", factory=sign, summary="+1 / -1 per response")]

The math lives in :mod:`rlx.plugins.algorithms.functional` (unit-tested on hand-computed values);
this module only adapts it to the common signature, and imports torch only when an estimator runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlx import Component, hookimpl
from rlx.protocols import EstimatorInputs, advantage_estimator

if TYPE_CHECKING:
    import torch

Pair = tuple["torch.Tensor", "torch.Tensor"]


@advantage_estimator()
def grpo(inputs: EstimatorInputs) -> Pair:
    """A_i = (s_i - mean_group) / (std_group + eps); without the division if norm_adv_by_std=false."""
    from rlx.plugins.algorithms import functional as F

    return F.grpo_advantages(inputs.scores, inputs.group_index, inputs.response_mask,
                             norm_by_std=inputs.norm_adv_by_std)


@advantage_estimator()
def rloo(inputs: EstimatorInputs) -> Pair:
    """A_i = s_i - mean of the other samples of the group."""
    from rlx.plugins.algorithms import functional as F

    return F.rloo_advantages(inputs.scores, inputs.group_index, inputs.response_mask)


@advantage_estimator()
def reinforce_plus_plus(inputs: EstimatorInputs) -> Pair:
    """Discounted reward-to-go of the token-level rewards, whitened over the batch."""
    from rlx.plugins.algorithms import functional as F

    return F.reinforce_plus_plus_advantages(inputs.token_level_rewards, inputs.response_mask, gamma=inputs.gamma)


@advantage_estimator()
def reinforce_plus_plus_baseline(inputs: EstimatorInputs) -> Pair:
    """s_i - mean_group, whitened over the batch."""
    from rlx.plugins.algorithms import functional as F

    return F.reinforce_plus_plus_baseline_advantages(inputs.scores, inputs.group_index, inputs.response_mask)


@advantage_estimator(requires=["baseline_scores"])
def remax(inputs: EstimatorInputs) -> Pair:
    """s_i - b_i, with b_i the score of the greedy response to the same prompt, divided by its root mean
    square over the batch's real tokens (norm_adv_by_std=false: not divided, as verl)."""
    import torch

    from rlx.plugins.algorithms import functional as F

    if inputs.baseline_scores is None:
        raise RuntimeError("the remax estimator needs baseline_scores (greedy-response scores)")
    advantages, returns = F.remax_advantages(inputs.scores, inputs.baseline_scores, inputs.response_mask)
    if not inputs.norm_adv_by_std:
        return advantages, returns
    # Only the size changes, not the baseline: dividing by the root mean square (not whitening, which
    # would subtract the batch mean) keeps each step's direction ReMax's, and a batch whose advantages
    # are all 0 stays 0.
    rms = F.masked_mean(advantages.to(torch.float64) ** 2, inputs.response_mask).sqrt()
    if rms == 0:
        return advantages, returns
    return (advantages.to(torch.float64) / rms).to(advantages.dtype), returns


@advantage_estimator(requires=["values"])
def gae(inputs: EstimatorInputs) -> Pair:
    """Generalised advantage estimation with the critic's values (gamma, lam), whitened over the batch."""
    from rlx.plugins.algorithms import functional as F

    if inputs.values is None:
        raise RuntimeError("the gae estimator needs the critic's values")
    return F.gae_advantages(inputs.token_level_rewards, inputs.values, inputs.response_mask,
                            gamma=inputs.gamma, lam=inputs.lam)


@advantage_estimator()
def opo(inputs: EstimatorInputs) -> Pair:
    """A_i = s_i - sum_g(L_j s_j) / sum_g(L_j): the length-weighted group mean as baseline (OPO)."""
    from rlx.plugins.algorithms import functional as F

    return F.opo_advantages(inputs.scores, inputs.group_index, inputs.response_mask)


@advantage_estimator()
def gpg(inputs: EstimatorInputs) -> Pair:
    """A_i = alpha (s_i - mean_g), alpha = B / (responses with a non-zero score) (GPG, as verl)."""
    from rlx.plugins.algorithms import functional as F

    return F.gpg_advantages(inputs.scores, inputs.group_index, inputs.response_mask)


@advantage_estimator()
def grpo_passk(inputs: EstimatorInputs) -> Pair:
    """Only each group's best response gets an advantage: s_max - s_second (over std_g + eps if
    norm_adv_by_std)."""
    from rlx.plugins.algorithms import functional as F

    return F.grpo_passk_advantages(inputs.scores, inputs.group_index, inputs.response_mask,
                                   norm_by_std=inputs.norm_adv_by_std)


def _optimal_token_baseline(inputs: EstimatorInputs, align: str, zero_tail: bool) -> Pair:
    from rlx.errors import ConfigError
    from rlx.plugins.algorithms import functional as F

    if inputs.old_log_probs is None or inputs.sum_pi_squared is None:
        raise RuntimeError("the optimal-token-baseline estimators need old_log_probs and sum_pi_squared (the trainer "
                           "provides them to an estimator that requires sum_pi_squared)")
    unknown = set(inputs.options) - {"handle_zero_tail"}
    if unknown:
        raise ConfigError([f"algorithm.estimator_options: unknown option(s) {sorted(unknown)} for the optimal "
                           "token baseline (it takes handle_zero_tail)"])
    handle_zero_tail = inputs.options.get("handle_zero_tail", zero_tail)
    if not isinstance(handle_zero_tail, bool):
        raise ConfigError([f"algorithm.estimator_options.handle_zero_tail must be true or false, got "
                           f"{handle_zero_tail!r}"])
    return F.optimal_token_baseline_advantages(
        inputs.token_level_rewards, inputs.response_mask, inputs.group_index, inputs.old_log_probs,
        inputs.sum_pi_squared, rollout_is_weights=inputs.rollout_is_weights, handle_zero_tail=handle_zero_tail,
        align=align)


@advantage_estimator(requires=["sum_pi_squared"])
def optimal_token_baseline(inputs: EstimatorInputs) -> Pair:
    """A_it = G_it - B_t, B_t = sum_i G_it W_it / sum_i W_it over the group at response position t, W the running sum
    of 1 - 2 pi + sum pi^2 (verl's optimal_token_baseline; estimator_options.handle_zero_tail, default false)."""
    return _optimal_token_baseline(inputs, "position", False)


@advantage_estimator(requires=["sum_pi_squared"])
def tir_optimal_token_baseline(inputs: EstimatorInputs) -> Pair:
    """The optimal token baseline over each response's trained tokens in order (tool output skipped), for
    multi-turn episodes (verl's tir_optimal_token_baseline; handle_zero_tail defaults to true)."""
    return _optimal_token_baseline(inputs, "trained", True)


# The estimators whose baseline is formed from the other responses to the same prompt: with one
# response per prompt (rollout.n=1) every advantage they give is exactly 0. (opo and gpg fall back to
# no baseline for a group of one, as in verl, so they still learn then.)
GROUP_RELATIVE = frozenset({"grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_vectorized", "rloo_vectorized",
                            "grpo_passk"})

BUILTIN = {
    "grpo": (grpo, "Group-normalised outcome advantages (Dr. GRPO with norm_adv_by_std=false)."),
    "rloo": (rloo, "Leave-one-out baseline: the mean of the other samples of the prompt."),
    "reinforce_plus_plus": (reinforce_plus_plus, "Discounted returns whitened over the batch."),
    "reinforce_plus_plus_baseline": (reinforce_plus_plus_baseline,
                                     "Group-mean baseline, then whitened over the batch."),
    "remax": (remax, "Baseline: the score of a greedy response to the same prompt."),
    "gae": (gae, "Generalised advantage estimation with a critic (gamma, lam)."),
    # verl's vectorised implementations compute the same advantages as its loops: here they are the same function.
    "grpo_vectorized": (grpo, "verl's name for the vectorised grpo: the same advantages as grpo."),
    "rloo_vectorized": (rloo, "verl's name for the vectorised rloo: the same advantages as rloo."),
    "opo": (opo, "OPO: baseline = the group's length-weighted mean reward."),
    "gpg": (gpg, "GPG: group-mean baseline scaled by batch size / responses with a non-zero reward."),
    "grpo_passk": (grpo_passk, "Pass@k: only the best response of a group, by its margin over the runner-up."),
    "optimal_token_baseline": (optimal_token_baseline, "Per-position group baseline weighted by each response's "
                               "running gradient variance (needs sum_pi_squared)."),
    "tir_optimal_token_baseline": (tir_optimal_token_baseline, "The optimal token baseline over trained tokens, "
                                   "for multi-turn episodes."),
}


@hookimpl
def rlx_advantage_estimators() -> list[Component]:
    return [Component(kind="advantage", name=name, factory=fn, summary=summary)
            for name, (fn, summary) in BUILTIN.items()]
