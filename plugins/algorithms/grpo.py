"""The ``grpo`` algorithm: group-relative advantages and a clipped surrogate with KL to a reference.

For a prompt with n sampled responses and rewards r_1..r_n, each response's advantage is
A_i = (r_i - mean(r)) / (std(r) + eps)  (or r_i - mean(r) with ``norm_adv_by_std=false``, Dr. GRPO),
given to every token of the response. The actor minimises

    L = agg( max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)) )
        + kl_loss_coef * agg(KL(pi || pi_ref)) - entropy_coeff * agg(entropy)

with ratio = pi(token) / pi_old(token) and the KL estimated per token (k3, "low_var_kl", by default).
Every option of :class:`~rlx.plugins.algorithms.base.AlgorithmOptions` applies (another estimator,
KL in the reward, dynamic sampling, ...); see docs/algorithms.md.
"""

from __future__ import annotations

from rlx import Component, hookimpl
from rlx.plugins.algorithms.base import ActorLoss, AlgorithmOptions, make_builder


class GRPOOptions(AlgorithmOptions):
    """GRPO's defaults are the shared ones: adv_estimator=grpo, KL as a loss (k3, 0.001)."""


GRPOLoss = ActorLoss  # the actor loss under its earlier name
build = make_builder(GRPOOptions)


@hookimpl
def rlx_algorithms() -> list[Component]:
    return [Component(kind="algorithm", name="grpo", factory=build, config_model=GRPOOptions,
                      summary="GRPO: group-normalised advantages, clipped surrogate, KL loss to a reference.")]
