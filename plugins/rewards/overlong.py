"""``overlong``: a soft penalty for responses that run into the length limit.

A response cut off at the limit carries no answer, and a policy that rambles up to the limit wastes
compute. With ``L`` the response's token count, ``M`` the limit (``max_tokens``, by default
``data.max_response_length``) and ``B`` the buffer: the score is 0.0 while ``L <= M - B``, falls
linearly to ``-penalty`` at ``L = M``, and is ``-penalty`` beyond. It is meant as a component of
``mix`` (weight 1.0 beside a correctness reward). ``overlong/truncated`` (``L >= M``) is logged.

>>> from rlx.protocols import RewardBatch
>>> fn = build(OverlongOptions(max_tokens=100, buffer_tokens=20), None)
>>> fn(RewardBatch([""] * 4, [""] * 4, [""] * 4, [""] * 4, [{}] * 4, response_lengths=[50, 80, 90, 100])).scores
[0.0, 0.0, -0.5, -1.0]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from rlx import Component, hookimpl
from rlx.errors import UserError
from rlx.protocols import RewardBatch, RewardOutput

if TYPE_CHECKING:
    from rlx.context import BuildContext


class OverlongOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_tokens: int | None = Field(None, gt=0, description="The length limit (default: data.max_response_length).")
    buffer_tokens: int = Field(64, gt=0, description="The penalty starts this many tokens before the limit.")
    penalty: float = Field(1.0, ge=0, description="The penalty at and beyond the limit.")


def score(length: int, limit: int, buffer: int, penalty: float) -> float:
    start = limit - buffer
    if length <= start:
        return 0.0
    return -penalty * min(1.0, (length - start) / buffer)


def build(options: OverlongOptions | None, ctx: BuildContext | None) -> Callable[[RewardBatch], RewardOutput]:
    opts = options or OverlongOptions()
    limit = opts.max_tokens
    if limit is None:
        if ctx is None or ctx.config is None:
            raise UserError("The overlong reward needs max_tokens (no run config to take data.max_response_length "
                            "from).", "Set reward.max_tokens=N.")
        limit = ctx.config.data.max_response_length
    buffer = min(opts.buffer_tokens, limit)

    def overlong_reward(batch: RewardBatch) -> RewardOutput:
        if len(batch.response_lengths) != len(batch):
            raise ValueError("the overlong reward needs RewardBatch.response_lengths (token counts)")
        scores = [score(n, limit, buffer, opts.penalty) for n in batch.response_lengths]
        return RewardOutput(scores, {"overlong/truncated": [float(n >= limit) for n in batch.response_lengths]})

    return overlong_reward


@hookimpl
def rlx_rewards() -> list[Component]:
    return [Component(kind="reward", name="overlong", factory=build, config_model=OverlongOptions,
                      summary="Soft penalty (0 to -penalty) over the last buffer_tokens before the length limit.")]
