"""Whole-config validation: core sections, each named plugin's own options, and data files.

Every problem is collected and reported at once as a :class:`ConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from rlx.config import ComponentSection, RLXConfig, build_raw, format_validation_error, validate
from rlx.errors import ConfigError, UserError, did_you_mean
from rlx.registry import PluginManager

# config section -> component kind
COMPONENT_SECTIONS = {"backend": "backend", "rollout": "rollout", "algorithm": "algorithm",
                      "reward": "reward", "launcher": "launcher"}


@dataclass
class Resolved:
    config: RLXConfig
    options: dict[str, Any] = field(default_factory=dict)  # section or "loggers.NAME" -> options model

    def as_dict(self) -> dict[str, Any]:
        """The resolved config with every plugin option filled in with its default."""
        out = self.config.model_dump(mode="json")
        for key, opts in self.options.items():
            if opts is None:
                continue
            dumped = opts.model_dump(mode="json")
            if key.startswith("loggers."):
                out["loggers"][key.split(".", 1)[1]] = dumped
            else:
                out[key].update(dumped)
        return out


def _component_options(pm: PluginManager, kind: str, name: str, given: dict[str, Any], path: str,
                       core_keys: list[str], problems: list[str]) -> BaseModel | None:
    try:
        comp = pm.get(kind, name)
    except UserError as exc:
        problems.append(f"{path}.name: {exc.message}")
        return None
    model = comp.load_config_model()
    if model is None:
        if given:
            problems.append(f"{path}: {kind} {name!r} takes no options; got {', '.join(sorted(given))}")
        return None
    try:
        return model.model_validate(given)
    except ValidationError as exc:
        for p in format_validation_error(exc, model, prefix=path):
            if ": unknown key." in p:  # suggest among the core keys of the section too
                key = p.split(":", 1)[0].rsplit(".", 1)[-1]
                names = list(model.model_fields) + core_keys
                p = (f"{p.split(':', 1)[0]}: unknown key for {kind} {name!r}.{did_you_mean(key, names)} "
                     f"Valid keys: {', '.join(names)}")
            problems.append(p)
        return None


def resolve(raw: dict[str, Any], pm: PluginManager, *, check_files: bool = True) -> Resolved:
    """Validate everything; raise one :class:`ConfigError` with every problem found."""
    from rlx.data import check_files as file_problems

    problems: list[str] = []
    try:
        cfg = validate(raw)
    except ConfigError as exc:
        problems.extend(exc.problems)
        cfg = None
    if cfg is None:
        # Still check plugin names and options so that all problems are reported at once.
        for section, kind in COMPONENT_SECTIONS.items():
            sec = raw.get(section)
            if isinstance(sec, dict) and isinstance(sec.get("name"), str):
                _component_options(pm, kind, sec["name"], {k: v for k, v in sec.items() if k != "name"
                                   and k not in _core_keys(section)}, section, _core_keys(section), problems)
        raise ConfigError(problems)
    resolved = Resolved(cfg)
    for section, kind in COMPONENT_SECTIONS.items():
        sec: ComponentSection = getattr(cfg, section)
        resolved.options[section] = _component_options(pm, kind, sec.name, sec.options(), section,
                                                       _core_keys(section), problems)
    for name in cfg.trainer.loggers:
        resolved.options[f"loggers.{name}"] = _component_options(
            pm, "logger", name, dict(cfg.loggers.get(name, {})), f"loggers.{name}", [], problems)
    for name in cfg.loggers:
        if name not in cfg.trainer.loggers:
            problems.append(f"loggers.{name}: options for a logger that is not on; add it to trainer.loggers "
                            f"(now {cfg.trainer.loggers})")
    if not cfg.model.path:
        problems.append("model.path: no model given. Pass --model PATH_OR_HUB_ID (or model.path=...), "
                        "or run `rlx train` with no arguments for the built-in tiny job.")
    if check_files:
        if not cfg.data.train_files:
            problems.append("data.train_files: no training data given. Pass data.train_files=FILE.parquet; "
                            "`rlx data prepare gsm8k --out DIR` writes one.")
        problems.extend(file_problems(cfg.data.train_files, "data.train_files"))
        problems.extend(file_problems(cfg.data.val_files, "data.val_files"))
    if problems:
        raise ConfigError(problems)
    return resolved


def _core_keys(section: str) -> list[str]:
    model = RLXConfig.model_fields[section].annotation
    return list(model.model_fields) if isinstance(model, type) else []


def load_config(pm: PluginManager, *, preset: str | None = None, config_file: str | None = None,
                shortcuts: dict[str, str | None] | None = None, overrides: list[str] | None = None,
                check_files: bool = True) -> Resolved:
    raw = build_raw(preset=preset, config_file=config_file, shortcuts=shortcuts, overrides=overrides)
    return resolve(raw, pm, check_files=check_files)
