"""The ``remax`` algorithm (ReMax, Li et al. 2023).

The baseline of a response is the reward of the greedy response to the same prompt: the trainer
generates one greedy response per prompt (because the ``remax`` estimator requires
``baseline_scores``), scores it, and A_i = r_i - r_greedy, unscaled as in verl (``norm_adv_by_std=true``
divides it by its root mean square over the batch). KL to the reference is a reward penalty.
"""

from __future__ import annotations

from pydantic import Field

from rlx import Component, hookimpl
from rlx.plugins.algorithms.base import AlgorithmOptions, make_builder


class ReMaxOptions(AlgorithmOptions):
    adv_estimator: str = Field("remax", description="Advantage estimator (see grpo's options).")
    norm_adv_by_std: bool = Field(
        False, description="Divide the advantages r - r_greedy by their root mean square over the batch (false, "
        "the default: verl's unscaled advantages).")
    use_kl_loss: bool = Field(False, description="Add KL(pi || pi_ref) as a loss term.")
    use_kl_in_reward: bool = Field(True, description="Subtract beta * KL(pi_old || pi_ref) from the rewards.")


build = make_builder(ReMaxOptions)


@hookimpl
def rlx_algorithms() -> list[Component]:
    return [Component(kind="algorithm", name="remax", factory=build, config_model=ReMaxOptions,
                      summary="ReMax: the greedy response's reward as the baseline.")]
