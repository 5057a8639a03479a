"""Rewards made of other rewards (``mix``, ``router``): validate and build a component by name.

A composite reward's options name other reward plugins with their own options. Those options are
checked by the named plugin's config model while the composite's options are validated, so a
mistake is reported with its full dotted path (``reward.components[1].options.path: ...``) together
with every other config problem. The plugin manager comes from the pydantic validation context
(``{"plugins": pm}``) when one is given, else the process-wide one.
"""

from __future__ import annotations

import typing
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo
from pydantic_core import InitErrorDetails, PydanticCustomError, core_schema

from rlx.errors import ConfigError, UserError, describe_exception, did_you_mean

if TYPE_CHECKING:
    from rlx.context import BuildContext
    from rlx.protocols import RewardOutput
    from rlx.registry import PluginManager

_STANDARD_ERRORS = frozenset(typing.get_args(core_schema.ErrorType))


def with_answers(output: RewardOutput, answers: list[str | None] | None) -> RewardOutput:
    """``output`` carrying the final answer the reward scored in each response (``RewardOutput.answers``;
    None where it found none), which majority voting uses."""
    output.answers = answers
    return output


def answers_of(output: Any) -> list[str | None] | None:
    """The answers a reward's output reports, or None (a plain list of scores, or a reward without them)."""
    return getattr(output, "answers", None)


def plugin_manager(info: ValidationInfo | None = None) -> PluginManager:
    context = info.context if info is not None else None
    if isinstance(context, dict) and context.get("plugins") is not None:
        return context["plugins"]
    from rlx.registry import get_plugin_manager

    return get_plugin_manager()


def _custom(message: str) -> PydanticCustomError:
    return PydanticCustomError("component_option", "{message}", {"message": message})


def error(loc: tuple[str | int, ...], message: str, value: Any) -> ValidationError:
    """A validation error at ``loc`` whose text is ``message``."""
    return ValidationError.from_exception_data("options", [InitErrorDetails(type=_custom(message), loc=loc,
                                                                            input=value)])


def details_of(exc: ValidationError, prefix: tuple[str | int, ...] = ()) -> list[InitErrorDetails]:
    """The errors of ``exc``, ready to be raised again, each location behind ``prefix``."""
    out: list[InitErrorDetails] = []
    for err in exc.errors():
        loc = (*prefix, *err["loc"])
        if err["type"] in _STANDARD_ERRORS:
            detail = InitErrorDetails(type=err["type"], loc=loc, input=err.get("input"))
            if "ctx" in err:
                detail["ctx"] = err["ctx"]
        else:  # a custom error: keep its text
            detail = InitErrorDetails(type=_custom(err["msg"]), loc=loc, input=err.get("input"))
        out.append(detail)
    return out


def with_prefix(exc: ValidationError, prefix: tuple[str | int, ...]) -> ValidationError:
    return ValidationError.from_exception_data(exc.title, details_of(exc, prefix))


def check_name(name: str, info: ValidationInfo | None) -> str:
    """The name of an installed reward (composites may nest: their options are finite)."""
    try:
        plugin_manager(info).get("reward", name)
    except UserError as exc:
        raise ValueError(exc.message) from None
    return name


def validate_options(name: str, options: dict[str, Any], info: ValidationInfo | None) -> dict[str, Any]:
    """``options`` checked by reward ``name``'s config model, with its defaults filled in.

    Raises a :class:`ValidationError` whose locations are relative to ``options``, so pydantic
    reports them under the composite's own path.
    """
    pm = plugin_manager(info)
    try:
        comp = pm.get("reward", name)
    except UserError:
        return options  # the name check reports it
    try:
        model = comp.load_config_model()
    except Exception as exc:
        raise ValueError(f"cannot load the options of reward {name!r} (plugin {comp.plugin}): "
                         f"{describe_exception(exc)}") from None
    if model is None:
        if options:
            raise ValueError(f"reward {name!r} takes no options; got {', '.join(sorted(options))}")
        return {}
    try:
        return model.model_validate(options, context=info.context if info else None).model_dump(mode="json")
    except ValidationError as exc:
        fields = list(model.model_fields)
        details: list[InitErrorDetails] = []
        for err, detail in zip(exc.errors(), details_of(exc)):
            if err["type"] == "extra_forbidden":
                key = str(err["loc"][-1])
                detail["type"] = _custom(f"unknown option of reward {name!r}.{did_you_mean(key, fields)} "
                                         f"Valid options: {', '.join(fields) or '(none)'}")
                detail.pop("ctx", None)
            details.append(detail)
        raise ValidationError.from_exception_data(model.__name__, details) from None


class ComponentRef(BaseModel):
    """A reward plugin by name, with its options."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="A reward plugin (see `rlx plugins list`).")
    options: dict[str, Any] = Field(default_factory=dict,
                                    description="The plugin's own options (see `rlx plugins show NAME`).")


def check_ref(value: Any, info: ValidationInfo) -> ComponentRef:
    """A reward ``name`` or ``{name, options}`` of an installed reward, its options validated.

    Raises a :class:`ValidationError` with locations relative to ``value``.
    """
    ref = ComponentRef(name=value) if isinstance(value, str) else ComponentRef.model_validate(value)
    try:
        check_name(ref.name, info)
    except ValueError as exc:
        raise error(() if isinstance(value, str) else ("name",), str(exc), ref.name) from None
    try:
        ref.options = validate_options(ref.name, ref.options, info)
    except ValidationError as exc:
        raise with_prefix(exc, ("options",)) from None
    except ValueError as exc:
        raise error(("options",), str(exc), ref.options) from None
    return ref


def build_component(name: str, options: dict[str, Any], ctx: BuildContext | None, where: str) -> Any:
    """Build reward ``name`` with ``options`` through the plugin manager of ``ctx``.

    ``where`` is the dotted path of the options (``reward.components[1].options``) for error messages.
    """
    from rlx.config import format_validation_error

    pm = ctx.plugins if ctx is not None and ctx.plugins is not None else plugin_manager()
    comp = pm.get("reward", name)
    model = comp.load_config_model()
    opts = None
    if model is not None:
        try:
            opts = model.model_validate(options, context={"plugins": pm})
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, model, prefix=where)) from None
    return comp.load_factory()(opts, ctx)
