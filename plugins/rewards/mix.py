"""``mix``: a weighted sum of other rewards, each component's score logged on its own.

::

    reward:
      name: mix
      components:
        - {name: gsm8k, weight: 0.7}
        - {name: reward_model, weight: 0.3, options: {path: ~/models/Skywork-Reward-Qwen2.5-0.5B}}

The score of a response is ``sum(weight_i * score_i)`` (divided by the sum of the weights with
``normalize: true``). Each component's own score is logged as ``reward/<label>/score`` (the label is
the component's name unless given), and its extra values pass through under its label
(``gsm8k/correct`` stays ``gsm8k/correct``; with ``label: rm2`` an extra ``reward_model/logit``
becomes ``rm2/reward_model/logit``). Components are built through the plugin manager, so any installed
reward can be mixed; their options are validated by their own config models. The mix's answers (for
majority voting) are those of the first component that reports answers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from rlx import Component, hookimpl
from rlx.errors import describe_exception
from rlx.protocols import RewardBatch, RewardOutput

from ._compose import answers_of, build_component, check_name, validate_options, with_answers

if TYPE_CHECKING:
    from rlx.context import BuildContext


class MixComponent(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="A reward plugin, e.g. gsm8k, math or reward_model.")
    weight: float = Field(1.0, description="Weight of this component's score in the sum.")
    label: str | None = Field(None, description="Name of the component in the metrics (default: name); "
                                                "needed when two components use the same reward.")
    options: dict[str, Any] = Field(default_factory=dict, validate_default=True,
                                    description="The component's own options (`rlx plugins show NAME`).")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str, info: ValidationInfo) -> str:
        return check_name(v, info)

    @field_validator("options")
    @classmethod
    def _options(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        name = info.data.get("name")
        return validate_options(name, v, info) if name else v

    @property
    def key(self) -> str:
        return self.label or self.name


class MixOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    components: list[MixComponent] = Field(
        min_length=1, description="The rewards to combine: [{name, weight, label, options}, ...].")
    normalize: bool = Field(False, description="Divide the weighted sum by the sum of the weights.")

    @model_validator(mode="after")
    def _unique_labels(self) -> MixOptions:
        seen: set[str] = set()
        for c in self.components:
            if c.key in seen:
                raise ValueError(f"two components are labelled {c.key!r}; give one of them another label "
                                 f"(components[i].label)")
            seen.add(c.key)
        if self.normalize and sum(c.weight for c in self.components) == 0:
            raise ValueError("normalize=true needs weights that do not sum to 0")
        return self


class ComponentFailed(RuntimeError):
    """A component of the mix failed; the message names it."""


def _scores_of(result: Any, n: int, label: str) -> RewardOutput:
    out = result if isinstance(result, RewardOutput) else RewardOutput(list(result))
    if len(out.scores) != n:
        raise ComponentFailed(f"mix component {label!r} returned {len(out.scores)} scores for {n} responses")
    return out


def build(options: MixOptions, ctx: BuildContext | None) -> Callable[[RewardBatch], RewardOutput]:
    parts = [(c, build_component(c.name, c.options, ctx, f"reward.components[{i}].options"))
             for i, c in enumerate(options.components)]
    total = sum(c.weight for c in options.components) if options.normalize else 1.0

    def mix_reward(batch: RewardBatch) -> RewardOutput:
        n = len(batch)
        scores = [0.0] * n
        extra: dict[str, list[float]] = {}
        answers: list[str | None] | None = None
        for comp, fn in parts:
            try:
                out = _scores_of(fn(batch), n, comp.key)
            except ComponentFailed:
                raise
            except Exception as exc:
                raise ComponentFailed(f"mix component {comp.key!r} (reward {comp.name!r}) failed: "
                                      f"{describe_exception(exc)}") from exc
            for i, s in enumerate(out.scores):
                scores[i] += comp.weight * float(s) / total
            extra[f"{comp.key}/score"] = [float(s) for s in out.scores]
            for key, values in out.extra.items():
                extra[key if key.startswith(f"{comp.key}/") else f"{comp.key}/{key}"] = list(values)
            if answers is None:
                answers = answers_of(out)
        return with_answers(RewardOutput(scores, extra), answers)

    return mix_reward


@hookimpl
def rlx_rewards() -> list[Component]:
    return [Component(kind="reward", name="mix", factory=build, config_model=MixOptions,
                      summary="Weighted sum of other rewards (e.g. 0.7 rule + 0.3 reward model); each "
                              "component's score logged as reward/<label>/score.")]
