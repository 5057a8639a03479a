"""The typed record a plugin returns for each component it provides."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

ComponentKind = Literal["backend", "rollout", "algorithm", "reward", "logger", "launcher", "advantage", "resource",
                        "agent_loop", "tool", "interaction"]
KINDS: tuple[str, ...] = get_args(ComponentKind)


def resolve(ref: Any) -> Any:
    """Turn a ``"package.module:attr"`` string into the object it names; pass anything else through.

    Plugins may give factories and config models as such strings so that listing plugins never
    imports heavy libraries.
    """
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split(".") if attr else []:
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class Component:
    """One named thing a plugin provides: a training backend, rollout engine, algorithm, reward, ...

    ``factory`` builds the component; it is called as ``factory(options, context)`` where ``options``
    is an instance of ``config_model`` (validated from the user's config) and ``context`` a
    :class:`rlx.context.BuildContext`. ``factory`` and ``config_model`` may be given as
    ``"module:attr"`` strings so that they are imported only when used.

    ``extra`` holds optional capabilities by key. A backend may give ``"export_checkpoint"``: a function (or
    ``"module:attr"``) ``f(checkpoint_dir, spec, out_dir, tokenizer)`` that writes a role's checkpoint as a
    Hugging Face folder in one CPU process without building the backend; ``rlx export`` uses it instead of
    loading the checkpoint into a worker (the megatron backend's checkpoints cannot be).

    Example::

        Component(kind="reward", name="length", factory="my_pkg.reward:build",
                  config_model="my_pkg.reward:LengthOptions", summary="Rewards short answers.")
    """

    kind: ComponentKind
    name: str
    factory: Any
    config_model: Any = None
    summary: str = ""
    # Filled in by the plugin manager from the entry point that registered the plugin.
    distribution: str = ""
    version: str = ""
    plugin: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Component kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if not self.name or not self.name.replace("_", "").replace("-", "").replace(".", "").isalnum():
            raise ValueError(f"Component name must be a non-empty identifier; got {self.name!r}")

    def load_factory(self) -> Any:
        return resolve(self.factory)

    def load_config_model(self) -> Any:
        return resolve(self.config_model) if self.config_model is not None else None

    def with_origin(self, plugin: str, distribution: str, version: str) -> Component:
        return replace(self, plugin=plugin, distribution=distribution, version=version)
