"""``geo3k``: verl's score for Geometry3K (``hiyouga/geometry3k``, images in the prompts): the answer in the last
``\\boxed{...}`` against the ground truth, and the format ``<think>...</think> ... \\boxed{...}``.

``score = (1 - format_score) * correct + format_score * formatted``, with ``format_score`` 0.1 (verl's): a right
boxed answer in the format scores 1.0, a right one without the think block 0.9, a formatted wrong one 0.1.
The equivalence check is the ``math`` reward's (math-verify when installed, else its built-in normalise-and-compare;
verl uses mathruler's grader). ``geo3k/correct`` and ``geo3k/format`` are logged beside the score.

>>> from rlx.protocols import RewardBatch
>>> fn = build(Geo3kOptions(backend="builtin"), None)
>>> fn(RewardBatch([""] * 3, ["<think>x</think> so \\\\boxed{3}", "\\\\boxed{3}", "<think>x</think>\\\\boxed{4}"],
...               ["3"] * 3, ["hiyouga/geometry3k"] * 3, [{}] * 3)).scores
[1.0, 0.9, 0.1]
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlx import Component, hookimpl
from rlx.protocols import RewardBatch, RewardOutput
from rlx.run.answers import last_boxed

from ._compose import with_answers

if TYPE_CHECKING:
    from rlx.context import BuildContext

FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


class Geo3kOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format_score: float = Field(0.1, ge=0, le=1, description="Weight of the format term (verl's 0.1); the answer's "
                                "weight is 1 - format_score.")
    backend: Literal["auto", "math_verify", "builtin"] = Field(
        "auto", description="Equivalence check, as the math reward's backend.")


def build(options: Geo3kOptions | None, ctx: BuildContext | None) -> Callable[[RewardBatch], RewardOutput]:
    from rlx.plugins.rewards import math as math_reward

    opts = options or Geo3kOptions()
    equivalent = math_reward.equivalence(opts.backend, "The geo3k reward")

    def geo3k_reward(batch: RewardBatch) -> RewardOutput:
        scores, correct, formatted = [], [], []
        finals = [batch.final_answer(i) for i in range(len(batch.responses))]
        for response, truth in zip(finals, batch.ground_truths, strict=True):
            pred = last_boxed(response)
            try:
                ok = pred is not None and equivalent(pred, math_reward.truth_answer(truth))
            except Exception:  # an answer the checker cannot parse is not a correct answer
                ok = False
            shaped = FORMAT.fullmatch(response) is not None
            scores.append((1.0 - opts.format_score) * float(ok) + opts.format_score * float(shaped))
            correct.append(float(ok))
            formatted.append(float(shaped))
        answers = [math_reward.canonical_answer(last_boxed(r)) for r in finals]
        return with_answers(RewardOutput(scores, {"geo3k/correct": correct, "geo3k/format": formatted}), answers)

    return geo3k_reward


@hookimpl
def rlx_rewards() -> list[Component]:
    return [Component(kind="reward", name="geo3k", factory=build, config_model=Geo3kOptions,
                      summary="verl's Geometry3K score: the last \\boxed{} vs the ground truth (0.9) and the "
                              "<think>...</think> format (0.1).")]
