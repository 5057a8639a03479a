"""The ``reinforce_plus_plus`` algorithm (REINFORCE++, Hu 2025).

No critic and no group baseline: each token's return is the discounted sum of the token rewards
after it (the score on the last token minus a per-token KL penalty, beta * KL_t), and the
advantages are those returns whitened over the whole batch: A = (G - mean(G)) / std(G).
``adv_estimator=reinforce_plus_plus_baseline`` subtracts the prompt's mean score first.
"""

from __future__ import annotations

from pydantic import Field

from rlx import Component, hookimpl
from rlx.plugins.algorithms.base import AlgorithmOptions, make_builder


class ReinforcePlusPlusOptions(AlgorithmOptions):
    adv_estimator: str = Field("reinforce_plus_plus", description="Advantage estimator (see grpo's options).")
    use_kl_loss: bool = Field(False, description="Add KL(pi || pi_ref) as a loss term.")
    use_kl_in_reward: bool = Field(True, description="Subtract beta * KL(pi_old || pi_ref) from the rewards.")


build = make_builder(ReinforcePlusPlusOptions)


@hookimpl
def rlx_algorithms() -> list[Component]:
    return [Component(kind="algorithm", name="reinforce_plus_plus", factory=build,
                      config_model=ReinforcePlusPlusOptions,
                      summary="REINFORCE++: token returns with a KL penalty, whitened over the batch.")]
