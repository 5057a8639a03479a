"""The built-in interactions (``agent.interactions=[gsm8k]``): a simulated user that answers each model turn.

``gsm8k`` is verl's gsm8k interaction: it reads the number after the last ``####`` in the model's last turn,
compares it with the row's ground truth (``interaction_kwargs.ground_truth``, else the row's
``reward_model.ground_truth``; a whole GSM8K solution counts by its final number) and scores the turn 1.0 or 0.0.
A right answer ends the episode; a wrong one (or none) is answered with a user turn saying so and asking the model
to think again, and the episode goes on.

>>> g = Gsm8kInteraction(Gsm8kInteractionOptions())
>>> g.respond([{"role": "assistant", "content": "3 + 4 = 7. #### 7"}], {"ground_truth": "7"}).done
True
>>> reply = g.respond([{"role": "assistant", "content": "#### 8"}], {"ground_truth": "7"})
>>> reply.done, reply.score
(False, 0.0)
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlx import Component
from rlx.errors import UserError
from rlx.protocols import InteractionReply

# The answer after a ``####`` marker: an optional sign, digits with optional thousands commas and decimals.
_STRICT = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")
_ANY_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")


class Gsm8kInteractionOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: Literal["strict", "flexible"] = Field(
        "strict", description="strict: the number after the last '####' of the model's turn (verl's); flexible: "
        "the turn's last number.")
    incorrect_message: str = Field(
        "That answer is not right. Check your reasoning and give your answer again.", min_length=1,
        max_length=10_000, description="The user turn after a wrong answer (or none).")


def _number(text: str) -> Decimal | None:
    try:
        value = Decimal(text.replace(",", "").rstrip("."))
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def extract(text: str, method: str) -> Decimal | None:
    """The answer of a model turn as a number, or None: after the last ``####`` (strict), or its last number."""
    found = _STRICT.findall(text) if method == "strict" else _ANY_NUMBER.findall(text.replace("$", ""))
    return _number(found[-1]) if found else None


def truth_of(ground_truth: Any) -> Decimal | None:
    """The number a ground truth stands for: ``"72"``, ``72``, or a whole GSM8K solution ending in ``#### 72``."""
    if ground_truth is None or isinstance(ground_truth, bool):
        return None
    text = str(ground_truth)
    if "####" in text:
        return extract(text, "strict")
    return _number(text.strip())


def last_answer(messages: list[dict[str, Any]]) -> str:
    """The content of the last assistant turn ("" when there is none)."""
    for m in reversed(messages):
        if m.get("role") == "assistant":
            return str(m.get("content") or "")
    return ""


class Gsm8kInteraction:
    """verl's gsm8k interaction (see the module docstring)."""

    def __init__(self, options: Gsm8kInteractionOptions) -> None:
        self.options = options

    def respond(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> InteractionReply:
        truth = truth_of(kwargs.get("ground_truth"))
        if truth is None:
            raise UserError(f"The gsm8k interaction has no number to compare with: the row's ground truth is "
                            f"{kwargs.get('ground_truth')!r}.",
                            "Give each row reward_model.ground_truth (or extra_info.interaction_kwargs.ground_truth) "
                            "as the answer's number; `rlx data prepare gsm8k` writes it.")
        answer = extract(last_answer(messages), self.options.method)
        if answer is not None and answer == truth:
            return InteractionReply("Correct.", 1.0, True)
        return InteractionReply(self.options.incorrect_message, 0.0, False)


def build_gsm8k(options: Gsm8kInteractionOptions | None, ctx: object) -> Gsm8kInteraction:
    return Gsm8kInteraction(options or Gsm8kInteractionOptions())


def components() -> list[Component]:
    """The built-in interactions (registered by :mod:`rlx.plugins.agents.loops`, the agent-loop entry point)."""
    here = "rlx.plugins.agents.interactions"
    return [Component(kind="interaction", name="gsm8k", factory=f"{here}:build_gsm8k",
                      config_model=f"{here}:Gsm8kInteractionOptions",
                      summary="verl's gsm8k interaction: checks the '#### N' answer of the model's turn against the "
                              "row's ground truth; right ends the episode (score 1), wrong asks it to try again (0).")]
