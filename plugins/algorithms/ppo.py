"""The ``ppo`` algorithm: PPO with a critic and generalised advantage estimation.

A value model V (the policy's architecture with a fresh one-output head, or ``critic.model_path``)
scores each state; with token rewards r_t (the score on the last token, minus beta * KL_t when
``use_kl_in_reward``):

    delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1},   G_t = A_t + V_t

The actor minimises the clipped surrogate on the whitened A; the critic minimises
0.5 * max((V - G)^2, (V_old + clip(V - V_old, -c, c) - G)^2) with c = ``critic.cliprange_value``,
with its own optimizer (``critic.optim``), and trains alone for ``critic.warmup_steps`` steps.
"""

from __future__ import annotations

from pydantic import Field

from rlx import Component, hookimpl
from rlx.plugins.algorithms.base import AlgorithmOptions, make_builder


class PPOOptions(AlgorithmOptions):
    adv_estimator: str = Field("gae", description="Advantage estimator; gae uses the critic.")
    use_kl_loss: bool = Field(False, description="Add KL(pi || pi_ref) as a loss term.")


build = make_builder(PPOOptions)


@hookimpl
def rlx_algorithms() -> list[Component]:
    return [Component(kind="algorithm", name="ppo", factory=build, config_model=PPOOptions,
                      summary="PPO with a critic: GAE advantages, clipped value loss, optional KL in reward.")]
