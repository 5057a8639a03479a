"""``length``: a reward for hitting a target response length, to steer verbosity.

The length is the response's token count (``RewardBatch.response_lengths``). With
``d = |length - target_tokens|``, the score is 1.0 while ``d <= tolerance``, falls linearly to
0.0 at ``d = 2 * tolerance`` and stays 0.0 beyond (``tolerance=0``: only the exact length
scores). ``length/in_range`` (1.0 within the tolerance) is logged beside the score.

>>> from rlx.protocols import RewardBatch
>>> fn = build(LengthOptions(target_tokens=10, tolerance=4), None)
>>> fn(RewardBatch([""] * 5, [""] * 5, [None] * 5, [""] * 5, [{}] * 5,
...                response_lengths=[10, 14, 16, 18, 30])).scores
[1.0, 1.0, 0.5, 0.0, 0.0]
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from rlx import Component, hookimpl
from rlx.protocols import RewardBatch, RewardOutput


class LengthOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    target_tokens: int = Field(64, ge=0, description="Response length (in tokens) that scores 1.0.")
    tolerance: int = Field(16, ge=0, description="Lengths within target_tokens ± tolerance score 1.0; "
                                                "the score reaches 0.0 at distance 2 * tolerance.")


def score(length: int, opts: LengthOptions) -> float:
    distance = abs(length - opts.target_tokens)
    if distance <= opts.tolerance:
        return 1.0
    return max(0.0, 2.0 - distance / opts.tolerance) if opts.tolerance else 0.0


def build(options: LengthOptions | None, ctx: object) -> object:
    opts = options or LengthOptions()

    def length_reward(batch: RewardBatch) -> RewardOutput:
        if len(batch.response_lengths) != len(batch):
            raise ValueError("the length reward needs RewardBatch.response_lengths (token counts)")
        scores = [score(n, opts) for n in batch.response_lengths]
        in_range = [float(abs(n - opts.target_tokens) <= opts.tolerance) for n in batch.response_lengths]
        return RewardOutput(scores, {"length/in_range": in_range})

    return length_reward


@hookimpl
def rlx_rewards() -> list[Component]:
    return [Component(kind="reward", name="length", factory=build, config_model=LengthOptions,
                      summary="1.0 within target_tokens ± tolerance, linear decay to 0 at twice the tolerance.")]
