"""``format``: does the response have the shape the task asks for?

Styles: ``gsm8k`` (a number after ``####``), ``boxed`` (a non-empty ``\\boxed{...}``), ``think`` (one
``<think>...</think>`` block at the start, then an answer), or ``regex`` with your own ``pattern``
(``match: search`` finds it anywhere, ``match: full`` must match the whole response). A response of
the right shape scores ``score``, any other ``miss_score``; ``format/ok`` is logged. Mix it with a
correctness reward: ``mix`` with ``{name: gsm8k, weight: 1.0}`` and ``{name: format, weight: 0.1}``.

>>> from rlx.protocols import RewardBatch
>>> fn = build(FormatOptions(style="think"), None)
>>> fn(RewardBatch([""] * 3, ["<think>2+2</think> 4", "4", "<think>a</think>"], [""] * 3, [""] * 3,
...               [{}] * 3)).scores
[1.0, 0.0, 0.0]
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlx import Component, hookimpl
from rlx.protocols import RewardBatch, RewardOutput

if TYPE_CHECKING:
    from rlx.context import BuildContext

GSM8K_PATTERN = r"####\s*[-+]?\s*\$?\s*\d"


def think_ok(text: str) -> bool:
    """One ``<think>...</think>`` block at the start, and an answer after it."""
    body = text.lstrip()
    if not body.startswith("<think>") or body.count("<think>") != 1 or body.count("</think>") != 1:
        return False
    return bool(body.split("</think>", 1)[1].strip())


class FormatOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    style: Literal["gsm8k", "boxed", "think", "regex"] = Field(
        "gsm8k", description="gsm8k: '#### <number>'; boxed: a non-empty \\boxed{}; think: <think>...</think> "
                             "then an answer; regex: your own pattern.")
    pattern: str | None = Field(None, description="Regular expression for style=regex (Python syntax, DOTALL).")
    match: Literal["search", "full"] = Field("search", description="For gsm8k and regex: search: anywhere; full: "
                                                                   "the whole response (outer whitespace ignored).")
    score: float = Field(1.0, description="Score of a response with the right format.")
    miss_score: float = Field(0.0, description="Score of any other response.")

    @model_validator(mode="after")
    def _pattern(self) -> FormatOptions:
        if self.style == "regex":
            if not self.pattern:
                raise ValueError("style=regex needs a pattern, e.g. reward.pattern='Answer: \\w+'")
            try:
                re.compile(self.pattern)
            except re.error as exc:
                raise ValueError(f"pattern {self.pattern!r} is not a valid regular expression: {exc}") from None
        elif self.pattern is not None:
            raise ValueError(f"pattern is only used with style=regex (style is {self.style!r})")
        return self


def checker(opts: FormatOptions) -> Callable[[str], bool]:
    if opts.style == "boxed":
        from rlx.run.answers import last_boxed

        return lambda text: bool(last_boxed(text))
    if opts.style == "think":
        return think_ok
    regex = re.compile(opts.pattern if opts.style == "regex" else GSM8K_PATTERN, re.DOTALL)  # type: ignore[arg-type]
    if opts.match == "full":
        return lambda text: regex.fullmatch(text.strip()) is not None
    return lambda text: regex.search(text) is not None


def build(options: FormatOptions | None, ctx: BuildContext | None) -> Callable[[RewardBatch], RewardOutput]:
    opts = options or FormatOptions()
    ok = checker(opts)

    def format_reward(batch: RewardBatch) -> RewardOutput:
        flags = [ok(r) if isinstance(r, str) else False for r in batch.responses]
        return RewardOutput([opts.score if f else opts.miss_score for f in flags],
                            {"format/ok": [float(f) for f in flags]})

    return format_reward


@hookimpl
def rlx_rewards() -> list[Component]:
    return [Component(kind="reward", name="format", factory=build, config_model=FormatOptions,
                      summary="Format compliance: '#### n', \\boxed{}, <think>...</think> or your own regex.")]
