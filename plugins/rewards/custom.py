"""``custom``: a reward function from a Python file, for quick experiments without a package.

::

    rlx train reward.name=custom reward.path=my_reward.py reward.function=compute_score

The function scores one response. It declares the arguments it wants, by name, from
``response`` (also accepted as ``solution_str``, verl's name), ``ground_truth``, ``data_source``,
``extra_info``, ``prompt`` and ``response_length``; ``reward.kwargs`` adds fixed keyword arguments.
verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` works as it is.
It returns a number, or a dict with a ``score`` and other numbers that are logged as
``reward/custom/<key>``; a string under ``answer`` (or ``pred``, verl's name) is the final answer the
function scored, which majority voting in evaluation uses.

With ``batched: true`` the function is called once per call with the whole
:class:`~rlx.protocols.RewardBatch` and returns a list of scores or a
:class:`~rlx.protocols.RewardOutput`. For anything you want to share or keep, write a plugin:
``rlx plugins new reward NAME``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlx import Component, hookimpl
from rlx.errors import UserError
from rlx.protocols import RewardBatch, RewardOutput

from ._compose import with_answers

if TYPE_CHECKING:
    from rlx.context import BuildContext

ARGUMENTS = ("response", "solution_str", "ground_truth", "data_source", "extra_info", "prompt", "response_length")


class CustomOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(description="The Python file that defines the reward function.")
    function: str = Field("compute_score", description="The function's name in that file.")
    batched: bool = Field(False, description="Call the function once with the whole RewardBatch instead of once "
                                             "per response.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Fixed keyword arguments for every call.")

    @field_validator("path")
    @classmethod
    def _exists(cls, v: str) -> str:
        p = Path(os.path.expanduser(v))
        if not p.is_file():
            raise ValueError(f"no such file: {v!r}" + (" (it is a folder)" if p.is_dir() else ""))
        if p.suffix != ".py":
            raise ValueError(f"{v!r} is not a .py file")
        return str(p.resolve())


def load_function(path: str, name: str) -> Callable[..., Any]:
    """Import ``path`` as a module of its own and return its ``name``; a UserError if either fails."""
    digest = hashlib.sha1(path.encode()).hexdigest()[:10]
    module_name = f"rlx_custom_reward_{Path(path).stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"reward.path: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # so that pickling and dataclasses in the file work
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        tb = exc.__traceback__
        line = ""
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == path:
                line = f", line {tb.tb_lineno}"
            tb = tb.tb_next
        if isinstance(exc, SyntaxError):
            line = f", line {exc.lineno}"
        raise UserError(f"reward.path: importing {path} failed{line}: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module_name)
        raise UserError(f"reward.function: {path} has no function {name!r}. Functions in the file: "
                        f"{', '.join(found) or '(none)'}.", "Set reward.function=NAME.")
    return fn


def _argument_plan(fn: Callable[..., Any], fixed: dict[str, Any], where: str) -> tuple[list[str], bool]:
    """Which of :data:`ARGUMENTS` the function takes (all, with ``**kwargs``), or a UserError."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return ["response", "ground_truth"], False
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return list(ARGUMENTS), True
    wanted, unknown = [], []
    for pname, p in params.items():
        if p.kind in (p.VAR_POSITIONAL,):
            continue
        if pname in ARGUMENTS:
            wanted.append(pname)
        elif pname not in fixed and p.default is p.empty:
            unknown.append(pname)
    if unknown:
        raise UserError(f"{where} takes arguments rlx cannot fill: {', '.join(unknown)}.",
                        f"Name them from: {', '.join(ARGUMENTS)}; or give them in reward.kwargs, or defaults.")
    return wanted, False


def build(options: CustomOptions, ctx: BuildContext | None) -> Callable[[RewardBatch], Any]:
    fn = load_function(options.path, options.function)
    where = f"{options.function}() in {options.path}"
    fixed = dict(options.kwargs)
    if options.batched:
        def batched_reward(batch: RewardBatch) -> Any:
            return fn(batch, **fixed)

        return batched_reward
    wanted, _ = _argument_plan(fn, fixed, where)

    def custom_reward(batch: RewardBatch) -> RewardOutput:
        n = len(batch)
        lengths = batch.response_lengths if len(batch.response_lengths) == n else [0] * n
        scores: list[float] = []
        extra: dict[str, list[float]] = {}
        answers: list[str | None] = [None] * n
        for i in range(n):
            values = {"response": batch.responses[i], "solution_str": batch.responses[i],
                      "ground_truth": batch.ground_truths[i], "data_source": batch.data_sources[i],
                      "extra_info": batch.extra_infos[i], "prompt": batch.prompts[i], "response_length": lengths[i]}
            result = fn(**{k: values[k] for k in wanted}, **fixed)
            if isinstance(result, dict):
                if "score" not in result:
                    raise ValueError(f"{where} returned a dict without a 'score' key: {sorted(result)}")
                for key, value in result.items():
                    if key != "score" and isinstance(value, (int, float)):
                        extra.setdefault(f"custom/{key}", [0.0] * n)[i] = float(value)
                answer = result.get("answer", result.get("pred"))
                answers[i] = answer if isinstance(answer, str) else None
                result = result["score"]
            scores.append(result)
        return with_answers(RewardOutput(scores, extra), answers if any(a is not None for a in answers) else None)

    return custom_reward


@hookimpl
def rlx_rewards() -> list[Component]:
    return [Component(kind="reward", name="custom", factory=build, config_model=CustomOptions,
                      summary="Your own function from a Python file (reward.path, reward.function); "
                              "verl's compute_score signature works.")]
