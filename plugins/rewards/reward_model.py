"""``reward_model``: scores from a sequence-classification reward model (e.g. a Qwen2.5-0.5B RM).

The model is any Hugging Face ``AutoModelForSequenceClassification`` with one output
(``num_labels=1``), with its own tokenizer and chat template: each response is shown to it as the
conversation ``[user: prompt, assistant: response]`` rendered by *the reward model's* template (the
``chat_template`` option overrides it), so policy and reward model may use different templates.
The user turn is recovered from the policy's formatted prompt by undoing the policy's chat template
(single-turn prompts); when that is not possible the formatted prompt is used as it is.

Scores are computed in batches of ``batch_size`` conversations (sorted by length, so little
padding), truncated from the left to ``max_length`` tokens so the end of the response is always
seen. The score of a response is ``scale * T(logit) + shift``, where ``logit`` is the model's raw
output at the last token and ``T`` is the identity (``transform: raw``, the Bradley-Terry reward) or
the logistic function (``transform: sigmoid``, a value in (0, 1)). ``reward_model/logit`` (the raw
output) is logged beside the score. The model runs in the reward worker, on ``device``; mix it with a
rule reward through ``mix``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlx import Component, _compat, hookimpl
from rlx.plugins.modeling.reward_model import RewardModelOptions, RewardModelScorer

if TYPE_CHECKING:
    from rlx.context import BuildContext


def build(options: RewardModelOptions, ctx: BuildContext | None) -> RewardModelScorer:
    return RewardModelScorer(options, ctx.tokenizer if ctx is not None else None)


@hookimpl
def rlx_rewards() -> list[Component]:
    return [Component(kind="reward", name="reward_model", factory=build, config_model=RewardModelOptions,
                      summary="A sequence-classification reward model (num_labels=1) with its own chat template; "
                              "batched scoring.")]


# Names that lived here in rlx 0.1 (issue 26 moved them); kept for one release, with a DeprecationWarning.
__getattr__ = _compat.moved_attributes(__name__, {
    "PromptUnwrapper": "rlx.plugins.modeling.reward_model",
})
