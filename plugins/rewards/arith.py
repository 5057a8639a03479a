"""The ``arith`` reward of the built-in tasks: is the response's first number the right sum?

For a multi-turn episode (tool calls) the final answer is scored: the content of its last assistant turn
(``RewardBatch.final_answer``).

The response must start with a number. A right answer scores 1; anything else scores 0 (exact match,
the default), or with ``distance_penalty > 0`` a wrong number scores
``max(0, 1 - distance_penalty * |answer - truth|)`` (partial credit, a graded signal for a model that
rarely answers right). ``arith/correct`` (exact match) is logged beside the score. Partial credit is not
the default: on the built-in job it taught the policy to answer a number *near* the sum (reward 0.8,
accuracy 0.1).

>>> from rlx.protocols import RewardBatch
>>> batch = RewardBatch(["What is 3+4?"] * 4, ["7", "5", "seven", "70"], ["7"] * 4, ["rlx/arith"] * 4, [{}] * 4)
>>> build(ArithOptions(), None)(batch).scores
[1.0, 0.0, 0.0, 0.0]
>>> build(ArithOptions(distance_penalty=0.1), None)(batch).scores
[1.0, 0.8, 0.0, 0.0]
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field

from rlx import Component, hookimpl
from rlx.protocols import RewardBatch, RewardOutput

_NUMBER = re.compile(r"\s*(-?\d+)")


class ArithOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    distance_penalty: float = Field(
        0.0, ge=0, description="Credit lost per unit of distance from the right answer (0: exact match only).")


def score(response: str, ground_truth: object, opts: ArithOptions) -> float:
    m = _NUMBER.match(response)
    if m is None:
        return 0.0
    distance = abs(int(m.group(1)) - int(str(ground_truth).strip()))
    if distance == 0:
        return 1.0
    return max(0.0, 1.0 - opts.distance_penalty * distance) if opts.distance_penalty else 0.0


def build(options: ArithOptions | None, ctx: object) -> object:
    opts = options or ArithOptions()

    def arith_reward(batch: RewardBatch) -> RewardOutput:
        # An episode's final answer (its last assistant turn); a single-turn response as it is.
        scores = [score(batch.final_answer(i), gt, opts) for i, gt in enumerate(batch.ground_truths)]
        return RewardOutput(scores, {"arith/correct": [float(s == 1.0) for s in scores]})

    return arith_reward


@hookimpl
def rlx_rewards() -> list[Component]:
    return [Component(kind="reward", name="arith", factory=build, config_model=ArithOptions,
                      summary="Built-in task: the sum as the first number of the response; optional partial credit.")]
