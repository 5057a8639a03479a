"""The ``dapo`` algorithm (DAPO, Yu et al. 2025): GRPO advantages with four changes.

- clip-higher: the ratio is clipped to [1 - 0.2, 1 + 0.28], so unlikely tokens can grow;
- token-level loss (``token-mean`` over the mini-batch), so long responses weigh by their tokens;
- dynamic sampling: prompts whose responses all scored the same (zero advantage) are dropped and
  more prompts are generated until the batch is full (``max_num_gen_batches`` at most);
- overlong reward shaping: responses in the last ``overlong_buffer_len`` tokens before
  ``data.max_response_length`` lose up to ``overlong_penalty_factor`` reward, linearly;
and no KL term.
"""

from __future__ import annotations

from pydantic import Field

from rlx import Component, hookimpl
from rlx.plugins.algorithms.base import AlgorithmOptions, make_builder


class DAPOOptions(AlgorithmOptions):
    clip_ratio_low: float | None = Field(0.2, gt=0, description="Lower clip range.")
    clip_ratio_high: float | None = Field(0.28, gt=0, description="Upper clip range (clip-higher).")
    use_kl_loss: bool = Field(False, description="Add KL(pi || pi_ref) as a loss term.")
    filter_groups: bool = Field(
        True, description="Dynamic sampling: drop prompts whose responses all scored the same, generate more.")
    overlong_buffer_len: int | None = Field(
        None, ge=0, description="Overlong shaping buffer (null: a quarter of data.max_response_length; 0: off).")


build = make_builder(DAPOOptions)


@hookimpl
def rlx_algorithms() -> list[Component]:
    return [Component(kind="algorithm", name="dapo", factory=build, config_model=DAPOOptions,
                      summary="DAPO: clip-higher, dynamic sampling, overlong shaping, token-level loss.")]
