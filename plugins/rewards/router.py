"""``router``: score each response with the reward for its row's ``data_source``.

One training set may mix several sources (GSM8K, MATH, your own); the router sends each response to
the reward that fits its source. The default table:

===================================================================================  =========
data_source                                                                          reward
===================================================================================  =========
``openai/gsm8k``, ``gsm8k``                                                          ``gsm8k``
``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``,  ``math``
``math``
``rlx/arith``, ``rlx/colors``                                                        ``arith``
``hiyouga/geometry3k``                                                               ``geo3k``
===================================================================================  =========

``routes`` adds to or overrides the table (a key may be a shell pattern such as ``my_org/*``; a
value is a reward name or ``{name, options}``); ``fallback`` scores any other source; without one,
a response from an unknown source is an error (handled by ``reward.on_error``). Exact keys win over
patterns; user routes are tried before the defaults. Extra values of the routed rewards pass through
(0.0 for responses another reward scored) and ``router/<reward>`` (1.0 for the responses each
reward scored) is logged, so you can see the mix of sources in every step. The answers the routed
rewards report (for majority voting) pass through too (None for a reward that reports none).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from rlx import Component, hookimpl
from rlx.protocols import RewardBatch, RewardOutput
from rlx.run.rewards import subset

from ._compose import ComponentRef, answers_of, build_component, check_ref, details_of, plugin_manager, with_answers

if TYPE_CHECKING:
    from rlx.context import BuildContext

DEFAULT_ROUTES: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math": "math",
    "rlx/arith": "arith",
    "rlx/colors": "arith",
    "hiyouga/geometry3k": "geo3k",
}


class RouterOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    routes: dict[str, ComponentRef | str] = Field(
        default_factory=dict, description="data_source (or shell pattern) -> reward name or {name, options}; "
                                          "added to (and overriding) the default table.")
    use_defaults: bool = Field(True, description="Start from the default table (gsm8k, MATH sets, rlx/arith).")
    fallback: ComponentRef | str | None = Field(
        None, description="Reward for data sources no route matches (none: such a response is an error).")

    @field_validator("routes")
    @classmethod
    def _routes(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, ComponentRef]:
        out, problems = {}, []
        for src, value in v.items():
            try:
                out[src] = check_ref(value, info)
            except ValidationError as exc:
                problems.extend(details_of(exc, (src,)))
        if problems:
            raise ValidationError.from_exception_data("RouterOptions", problems)
        return out

    @field_validator("fallback")
    @classmethod
    def _fallback(cls, v: Any, info: ValidationInfo) -> ComponentRef | None:
        return None if v is None else check_ref(v, info)


class UnroutedSource(LookupError):
    pass


class Router:
    """Picks the reward function for a data source; builds each reward once."""

    def __init__(self, options: RouterOptions, ctx: BuildContext | None) -> None:
        pm = ctx.plugins if ctx is not None and ctx.plugins is not None else plugin_manager()
        installed = set(pm.names("reward"))
        table: dict[str, ComponentRef] = {}
        if options.use_defaults:  # a default whose reward is not installed is left out
            table.update({s: ComponentRef(name=r) for s, r in DEFAULT_ROUTES.items() if r in installed})
        table.update(options.routes)  # type: ignore[arg-type]
        self.exact = {s: r for s, r in table.items() if not any(ch in s for ch in "*?[")}
        self.patterns = [(s, r) for s, r in options.routes.items() if any(ch in s for ch in "*?[")]
        self.fallback = options.fallback if isinstance(options.fallback, ComponentRef) else None
        self._fns: dict[tuple[str, str], Callable[[RewardBatch], Any]] = {}
        self.ctx = ctx
        for src, ref in [*table.items(), *([("(fallback)", self.fallback)] if self.fallback else [])]:
            self._build(src, ref)

    def _build(self, src: str, ref: ComponentRef) -> Callable[[RewardBatch], Any]:
        key = (ref.name, repr(sorted(ref.options.items())))
        if key not in self._fns:
            where = "reward.fallback.options" if src == "(fallback)" else f"reward.routes.{src}.options"
            self._fns[key] = build_component(ref.name, ref.options, self.ctx, where)
        return self._fns[key]

    def route(self, source: str) -> tuple[str, Callable[[RewardBatch], Any]]:
        ref = self.exact.get(source)
        if ref is None:
            ref = next((r for pattern, r in self.patterns if fnmatch.fnmatchcase(source, pattern)), None)
        if ref is None:
            ref = self.fallback
        if ref is None:
            known = ", ".join(sorted(self.exact)) or "(none)"
            raise UnroutedSource(f"no reward for data_source {source!r}; routes: {known}. Add "
                                 f"reward.routes={{'{source}': REWARD}} or set reward.fallback=REWARD")
        return ref.name, self._build(source, ref)

    def __call__(self, batch: RewardBatch) -> RewardOutput:
        n = len(batch)
        groups: dict[tuple[str, int], list[int]] = {}
        fns: dict[int, Callable[[RewardBatch], Any]] = {}
        for i, src in enumerate(batch.data_sources):
            name, fn = self.route(src)
            groups.setdefault((name, id(fn)), []).append(i)
            fns[id(fn)] = fn
        scores = [0.0] * n
        extra: dict[str, list[float]] = {}
        answers: list[str | None] = [None] * n
        reported = False
        for (name, fid), idx in groups.items():
            result = fns[fid](subset(batch, idx) if len(idx) != n else batch)
            out = result if isinstance(result, RewardOutput) else RewardOutput(list(result))
            if len(out.scores) != len(idx):
                raise ValueError(f"reward {name!r} (routed) returned {len(out.scores)} scores for "
                                 f"{len(idx)} responses")
            routed_answers = answers_of(out)
            if routed_answers is not None:
                if len(routed_answers) != len(idx):
                    raise ValueError(f"reward {name!r} (routed) returned {len(routed_answers)} answers for "
                                     f"{len(idx)} responses")
                reported = True
            for j, i in enumerate(idx):
                scores[i] = out.scores[j]
                if routed_answers is not None:
                    answers[i] = routed_answers[j]
            for key, values in [*out.extra.items(), (f"router/{name}", [1.0] * len(idx))]:
                col = extra.setdefault(key, [0.0] * n)
                for j, i in enumerate(idx):
                    col[i] = values[j]
        return with_answers(RewardOutput(scores, extra), answers if reported else None)


def build(options: RouterOptions | None, ctx: BuildContext | None) -> Router:
    return Router(options or RouterOptions(), ctx)


@hookimpl
def rlx_rewards() -> list[Component]:
    return [Component(kind="reward", name="router", factory=build, config_model=RouterOptions,
                      summary="Routes each response to a reward by its data_source (gsm8k, MATH, arith by "
                              "default; your own routes and a fallback).")]
