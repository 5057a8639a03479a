"""``math``: boxed-answer math (MATH, MATH-500, AIME-style sets).

The answer of a response is the content of its last ``\\boxed{...}`` (or ``\\fbox{...}``). It is
compared with the ground truth (a bare answer such as ``\\frac{1}{2}``, or a full solution whose last
box holds the answer) for mathematical equivalence:

- with Hugging Face ``math-verify`` installed (``pip install 'rlx[math]'``), by its parser and
  verifier (``\\frac{1}{2}`` = ``0.5`` = ``1/2``, ``\\{1,2\\}`` = ``\\{2,1\\}``, intervals, ...);
- otherwise by a built-in check: both answers normalised (spacing, ``\\left``/``\\right``,
  ``\\dfrac``, ``\\text{}``, degrees, percent, units of a trailing ``\\text{}``, ``x =``) and compared
  as strings, then as numbers (fractions, decimals, thousands separators).

A correct answer scores ``correct_score``; a boxed wrong answer ``format_score``; no box 0.0.
``math/correct`` and ``math/boxed`` are logged beside the score. The reward's answers (for majority voting)
are the boxed answers, normalised, with numbers as exact fractions (``0.5`` and ``\\frac{1}{2}`` give ``1/2``).

>>> from rlx.protocols import RewardBatch
>>> fn = build(MathOptions(backend="builtin"), None)
>>> fn(RewardBatch([""] * 3, ["so \\\\boxed{\\\\dfrac{1}{2}}", "\\\\boxed{3}", "1/2"], ["\\\\frac12"] * 3,
...               ["math"] * 3, [{}] * 3)).scores
[1.0, 0.0, 0.0]
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlx import Component, hookimpl
from rlx.protocols import RewardBatch, RewardOutput
from rlx.registry import Requirement
from rlx.run.answers import last_boxed

from ._compose import with_answers

if TYPE_CHECKING:
    from rlx.context import BuildContext

def truth_answer(ground_truth: Any) -> str:
    """The answer part of a ground truth: the last box of a full solution, or the text itself."""
    text = str(ground_truth).strip()
    boxed = last_boxed(text)
    return boxed if boxed is not None else text


# -- the built-in equivalence check ------------------------------------------------------------
_REMOVE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "\\$", "$", "^\\circ", "^{\\circ}",
           "\\circ", "\\%", "%", "\\ ")
_TEXT_CMD = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_TRAILING_UNIT = re.compile(r"^(.*?\d)\s*\\(?:text|mbox|mathrm)\s*\{\s*[a-zA-Z][a-zA-Z .^\d]*\}$")
_FRAC_SHORT = re.compile(r"\\frac\s*(\d)\s*(\d)")
_FRAC_HALF = re.compile(r"\\frac\s*\{([^{}]*)\}\s*(\d)|\\frac\s*(\d)\s*\{([^{}]*)\}")
_SQRT_SHORT = re.compile(r"\\sqrt\s*(\w)")
_ASSIGNMENT = re.compile(r"^[a-zA-Z]\w*\s*=\s*(?=\S)")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")


def normalize(answer: str) -> str:
    """A canonical text for an answer, so that trivially different spellings compare equal."""
    s = str(answer).strip()
    m = _TRAILING_UNIT.match(s)  # "5\text{ cm}" -> "5"
    if m:
        s = m.group(1)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for token in _REMOVE:
        s = s.replace(token, "")
    for _ in range(3):  # nested text commands
        s = _TEXT_CMD.sub(r"\1", s)
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_HALF.sub(lambda m: (f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m.group(1) is not None
                                  else f"\\frac{{{m.group(3)}}}{{{m.group(4)}}}"), s)
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    s = _ASSIGNMENT.sub("", s)
    s = s.replace(" ", "").replace("\n", "").rstrip(".")
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if s.startswith("."):
        s = "0" + s
    if s.startswith("-."):
        s = "-0" + s[1:]
    if re.fullmatch(r"-?\d+\.\d*", s):  # 2.50 -> 2.5, 2.0 -> 2
        s = s.rstrip("0").rstrip(".")
    return s


_FRAC_VALUE = re.compile(r"^(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}$")
_SLASH_VALUE = re.compile(r"^(-?\d+(?:\.\d+)?)/(-?\d+(?:\.\d+)?)$")


def _value(s: str) -> Fraction | None:
    """The exact value of a normalised numeric answer (integer, decimal, fraction), or None."""
    try:
        if re.fullmatch(r"-?\d+(?:\.\d+)?", s):
            return Fraction(s)
        m = _FRAC_VALUE.match(s)
        if m:
            value = Fraction(m.group(2)) / Fraction(m.group(3))
            return -value if m.group(1) else value
        m = _SLASH_VALUE.match(s)
        if m:
            return Fraction(m.group(1)) / Fraction(m.group(2))
    except (ValueError, ZeroDivisionError):
        return None
    return None


def canonical_answer(pred: str | None) -> str | None:
    """One spelling per answer for majority voting: the normalised text, or a number's exact value."""
    if pred is None:
        return None
    text = normalize(pred)
    value = _value(text)
    return str(value) if value is not None else (text or None)


def builtin_equivalent(pred: str, truth: str) -> bool:
    a, b = normalize(pred), normalize(truth)
    if not a or not b:
        return False
    if a == b:
        return True
    va, vb = _value(a), _value(b)
    if va is not None and vb is not None:
        return abs(va - vb) <= Fraction(1, 10**6) * max(1, abs(vb))
    return False


def math_verify_equivalent(pred: str, truth: str) -> bool:
    """Equivalence by math-verify. Its own time limits use signals, which work in the main thread only;
    elsewhere the reward worker's ``reward.timeout_s`` bounds the call."""
    from math_verify import parse, verify

    main = threading.current_thread() is threading.main_thread()
    kw: dict[str, Any] = {} if main else {"parsing_timeout": None}
    gold = parse(f"$\\boxed{{{truth}}}$", **kw)
    answer = parse(f"$\\boxed{{{pred}}}$", **kw)
    if not gold or not answer:
        return builtin_equivalent(pred, truth)
    return bool(verify(gold, answer, **({} if main else {"timeout_seconds": None})))


class _OwnTimeouts(logging.Filter):
    """Drops math-verify's notice that its own time limit is off: the reward runner's timeout applies."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


def _quiet_math_verify() -> None:
    for name in ("math_verify.parser", "math_verify.grader"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _OwnTimeouts) for f in log.filters):
            log.addFilter(_OwnTimeouts())


def math_verify_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("math_verify") is not None


# -- the reward ---------------------------------------------------------------------------------
class MathOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    backend: Literal["auto", "math_verify", "builtin"] = Field(
        "auto", description="Equivalence check: 'math_verify' (pip install 'rlx[math]'), the 'builtin' "
                            "normalise-and-compare, or 'auto' (math_verify when installed).")
    correct_score: float = Field(1.0, description="Score of a boxed answer equivalent to the ground truth.")
    format_score: float = Field(0.0, description="Score of a boxed answer that is wrong.")


def compute_score(response: str, ground_truth: Any, equivalent: Callable[[str, str], bool],
                  opts: MathOptions) -> tuple[float, bool, bool]:
    """``(score, boxed answer found, correct)`` for one response."""
    pred = last_boxed(response)
    if pred is None:
        return 0.0, False, False
    try:
        ok = equivalent(pred, truth_answer(ground_truth))
    except Exception:  # an answer the checker cannot parse is not a correct answer
        ok = False
    return (opts.correct_score if ok else opts.format_score), True, ok


def equivalence(backend: str, who: str = "The math reward") -> Callable[[str, str], bool]:
    """The answer check of ``backend`` (auto: math-verify when installed, else the built-in one)."""
    if backend == "auto":
        backend = "math_verify" if math_verify_available() else "builtin"
    if backend == "math_verify":
        from rlx.errors import require

        require("math_verify", "math", f"{who} with backend=math_verify")
        _quiet_math_verify()
        return math_verify_equivalent
    return builtin_equivalent


def build(options: MathOptions | None, ctx: BuildContext | None) -> Callable[[RewardBatch], RewardOutput]:
    opts = options or MathOptions()
    equivalent = equivalence(opts.backend)

    def math_reward(batch: RewardBatch) -> RewardOutput:
        scores, boxed, correct = [], [], []
        finals = [batch.final_answer(i) for i in range(len(batch.responses))]  # an episode's: its last turn
        for response, truth in zip(finals, batch.ground_truths, strict=True):
            s, found, ok = compute_score(response, truth, equivalent, opts)
            scores.append(float(s))
            boxed.append(float(found))
            correct.append(float(ok))
        answers = [canonical_answer(last_boxed(r)) for r in finals]
        return with_answers(RewardOutput(scores, {"math/correct": correct, "math/boxed": boxed}), answers)

    return math_reward


@hookimpl
def rlx_rewards() -> list[Component]:
    return [Component(kind="reward", name="math", factory=build, config_model=MathOptions,
                      summary="Boxed-answer math: last \\boxed{} vs the ground truth, equivalence by math-verify "
                              "when installed.",
                      extra={"requires": [Requirement("math_verify", "math-verify", "pip install 'rlx[math]'",
                                                      when=("backend", "math_verify"))]})]
