"""GSM8K rule reward: compare the final number of a response with the ground truth.

The GSM8K format puts the final answer after a ``####`` marker (``... so she has 72 apples.
#### 72``). ``strict`` extraction reads the number right after the last marker; ``flexible``
extraction reads the last number anywhere in the text. A response scores ``correct_score`` when its
answer equals the ground truth as a number (``18.00`` equals ``18``, ``1,234`` equals ``1234``).

This module imports only the standard library, pydantic and rlx core, so listing plugins stays cheap.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlx.components import Component
from rlx.hookspecs import hookimpl
from rlx.protocols import RewardBatch, RewardOutput

from ._compose import with_answers

if TYPE_CHECKING:
    from rlx.context import BuildContext

Method = Literal["strict", "flexible"]

# A number: optional sign, digits with optional thousands commas, optional decimals. It must not
# start in the middle of another number, so ``3-5`` yields ``5`` rather than ``-5``.
_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(r"(?<![\d.])" + _NUMBER)
# What may follow the ``####`` marker: spaces, an optional sign, an optional ``$``, the number.
_AFTER_MARKER_RE = re.compile(r"\s*(?P<sign>[-+]?)\s*\$?\s*(?P<num>" + _NUMBER + ")")
_MARKER = "####"


def _normalise(number: str) -> str:
    """Strip thousands commas, ``$`` signs, a leading ``+`` and a trailing ``.``."""
    out = number.replace(",", "").replace("$", "").strip()
    out = out.rstrip(".")
    if out.startswith("+"):
        out = out[1:]
    return out


def extract_answer(text: str, method: Method = "strict") -> str | None:
    """The final answer of ``text`` as a normalised number string, or ``None`` if there is none.

    ``strict``: the number right after the last ``####`` marker (``#### 1,234`` gives ``"1234"``,
    ``####-5`` gives ``"-5"``, ``#### $18.00`` gives ``"18.00"``); ``None`` without a marker or
    when no number follows the last marker. ``flexible``: the last number anywhere in the text.
    """
    if not isinstance(text, str):
        return None
    if method == "strict":
        pos = text.rfind(_MARKER)
        if pos < 0:
            return None
        m = _AFTER_MARKER_RE.match(text, pos + len(_MARKER))
        if m is None:
            return None
        sign, num = m.group("sign"), m.group("num")
        if sign and num[0] not in "+-":
            num = sign + num
        return _normalise(num)
    if method == "flexible":
        found = _NUMBER_RE.findall(text)
        return _normalise(found[-1]) if found else None
    raise ValueError(f"method must be 'strict' or 'flexible'; got {method!r}")


def _as_number(value: str) -> Decimal | None:
    try:
        d = Decimal(_normalise(value))
    except (InvalidOperation, ValueError):
        return None
    return d if d.is_finite() else None


def answers_match(pred: Any, truth: Any) -> bool:
    """Whether a predicted answer equals the ground truth.

    Numeric equality when both parse as numbers (``"18.00"`` == ``18``, ``"1,234"`` == ``"1234"``),
    otherwise exact string equality after stripping whitespace. ``truth`` may be a str, int or float.
    """
    if pred is None or truth is None or isinstance(truth, bool):
        return False
    pred_s, truth_s = str(pred).strip(), str(truth).strip()
    p, t = _as_number(pred_s), _as_number(truth_s)
    if p is not None and t is not None:
        return p == t
    return pred_s == truth_s


def canonical_answer(answer: str | None) -> str | None:
    """An extracted answer in one spelling per number (``"18.00"`` and ``"18"`` give ``"18"``), for voting."""
    if answer is None:
        return None
    number = _as_number(answer)
    if number is None:
        return answer.strip()
    return "0" if number == 0 else format(number.normalize(), "f")


def _truth_answer(ground_truth: Any) -> Any:
    """The answer part of a ground truth; a full GSM8K solution (``... #### 72``) gives ``"72"``."""
    if isinstance(ground_truth, str) and _MARKER in ground_truth:
        found = extract_answer(ground_truth, "strict")
        if found is not None:
            return found
    return ground_truth


def _score(
    response: str,
    ground_truth: Any,
    method: Method,
    fallback_flexible: bool,
    format_score: float,
    correct_score: float,
) -> tuple[float, bool, bool, str | None]:
    """``(score, strict answer found, correct, the answer that was scored)`` for one response."""
    truth = _truth_answer(ground_truth)
    strict = extract_answer(response, "strict")
    found = strict is not None
    if method == "flexible":
        answer = extract_answer(response, "flexible")
        correct = answers_match(answer, truth)
        return (correct_score if correct else 0.0), found, correct, answer
    if method != "strict":
        raise ValueError(f"method must be 'strict' or 'flexible'; got {method!r}")
    if found:
        correct = answers_match(strict, truth)
        return (correct_score if correct else format_score), found, correct, strict
    if fallback_flexible:
        # No usable ``####`` answer: the last number may still be right, but earns no format credit.
        answer = extract_answer(response, "flexible")
        correct = answers_match(answer, truth)
        return (correct_score if correct else 0.0), found, correct, answer
    return 0.0, found, False, None


def compute_score(
    response: str,
    ground_truth: Any,
    *,
    method: Method = "strict",
    fallback_flexible: bool = True,
    format_score: float = 0.0,
    correct_score: float = 1.0,
) -> float:
    """Score one response against its ground truth.

    ``strict``: with an answer after ``####``, ``correct_score`` if it matches, else
    ``format_score``; without one (no marker, or no number after it) and ``fallback_flexible``,
    ``correct_score`` if the last number matches, else 0.0. ``flexible``: the last number only,
    ``correct_score`` or 0.0.
    """
    return _score(response, ground_truth, method, fallback_flexible, format_score, correct_score)[0]


class Gsm8kOptions(BaseModel):
    """Options of the ``gsm8k`` reward."""

    model_config = ConfigDict(extra="forbid")

    method: Method = Field(
        "strict",
        description="'strict': the number after the last '####'; "
        "'flexible': the last number in the response.",
    )
    fallback_flexible: bool = Field(
        True,
        description="With method 'strict', score the last number when the response has no '#### answer' "
        "(no format credit).",
    )
    format_score: float = Field(0.0, description="Score for a response with a '#### answer' that is wrong.")
    correct_score: float = Field(1.0, description="Score for a correct answer.")


def build(options: Gsm8kOptions | None, ctx: BuildContext | None) -> Callable[[RewardBatch], RewardOutput]:
    """The reward function: scores each response against ``batch.ground_truths[i]``; its answers are the
    numbers it compared (in :func:`canonical_answer` form), for majority voting."""
    opts = options if options is not None else Gsm8kOptions()

    def reward(batch: RewardBatch) -> RewardOutput:
        if len(batch.ground_truths) != len(batch.responses):
            raise ValueError(
                f"gsm8k reward: {len(batch.responses)} responses but {len(batch.ground_truths)} ground truths"
            )
        scores: list[float] = []
        strict_found: list[float] = []
        correct: list[float] = []
        answers: list[str | None] = []
        # An episode's answer is its last assistant turn (tool output never counts as the model's answer).
        finals = [batch.final_answer(i) for i in range(len(batch.responses))]
        for response, truth in zip(finals, batch.ground_truths, strict=True):
            score, found, ok, answer = _score(
                response, truth, opts.method, opts.fallback_flexible, opts.format_score, opts.correct_score
            )
            scores.append(float(score))
            strict_found.append(1.0 if found else 0.0)
            correct.append(1.0 if ok else 0.0)
            answers.append(canonical_answer(answer))
        extra = {"gsm8k/strict_found": strict_found, "gsm8k/correct": correct}
        return with_answers(RewardOutput(scores=scores, extra=extra), answers)

    return reward


@hookimpl
def rlx_rewards():
    return [
        Component(
            kind="reward",
            name="gsm8k",
            factory=build,
            config_model=Gsm8kOptions,
            summary="GSM8K: the number after #### (strict), last number as fallback; 1.0 or 0.0",
        )
    ]
