"""The ``rloo`` algorithm (REINFORCE leave-one-out, Ahmadian et al. 2024).

Each response's baseline is the mean reward of the *other* responses to the same prompt:
A_i = r_i - (sum_j r_j - r_i) / (n - 1). The KL to the reference is a penalty in the reward
(r_i = score_i - beta * sum_t KL_t), as in the paper, rather than a loss term.
"""

from __future__ import annotations

from pydantic import Field

from rlx import Component, hookimpl
from rlx.plugins.algorithms.base import AlgorithmOptions, make_builder


class RLOOOptions(AlgorithmOptions):
    adv_estimator: str = Field("rloo", description="Advantage estimator (see grpo's options).")
    use_kl_loss: bool = Field(False, description="Add KL(pi || pi_ref) as a loss term.")
    use_kl_in_reward: bool = Field(True, description="Subtract beta * KL(pi_old || pi_ref) from the rewards.")


build = make_builder(RLOOOptions)


@hookimpl
def rlx_algorithms() -> list[Component]:
    return [Component(kind="algorithm", name="rloo", factory=build, config_model=RLOOOptions,
                      summary="RLOO: leave-one-out baseline per prompt, KL penalty in the reward.")]
