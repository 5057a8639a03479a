"""Whole-config validation: core sections, each named plugin's own options, and data files.

Every problem is collected and reported at once as a :class:`ConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from rlx.config import ComponentSection, RLXConfig, build_raw, format_validation_error, validate
from rlx.errors import ConfigError, UserError
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
                       core_keys: list[str], problems: list[str], name_path: str | None = None) -> BaseModel | None:
    """Validate one plugin's options; append problems (with dotted paths) instead of raising.

    ``path`` is where the options live (``algorithm``, ``loggers.swanlab``); ``name_path`` is where the
    plugin's name was given (``algorithm.name``, ``trainer.loggers``).
    """
    try:
        comp = pm.get(kind, name)
    except UserError as exc:
        problems.append(f"{name_path or path + '.name'}: {exc.message}")
        return None
    try:
        model = comp.load_config_model()
    except Exception as exc:  # a broken plugin: say which one, keep checking the rest
        problems.append(f"{path}: cannot load the options of {kind} {name!r} (plugin {comp.plugin}, "
                        f"{comp.distribution} {comp.version}): {type(exc).__name__}: {exc}")
        return None
    if model is None:
        if given:
            problems.append(f"{path}: {kind} {name!r} takes no options; got {', '.join(sorted(given))}")
        return None
    try:
        options = model.model_validate(given, context={"plugins": pm})
    except ValidationError as exc:
        problems.extend(format_validation_error(exc, model, prefix=path, owner=f"{kind} {name!r}",
                                                extra_keys=core_keys))
        return None
    # Options that name other components (an algorithm's adv_estimator) check those names here.
    check = getattr(options, "plugin_problems", None)
    if callable(check):
        problems.extend(f"{path}.{p}" for p in check(pm))
    return options


@dataclass
class _View:
    """What the plugin and file checks need, read from the validated config or, when the core
    sections are invalid, as far as possible from the raw dict (so every problem is reported at once)."""

    sections: dict[str, tuple[str, dict[str, Any]]]  # section -> (plugin name, options)
    loggers: list[str]
    logger_options: dict[str, Any]
    model_path: str | None
    train_files: list[str] | None
    val_files: list[str] | None


def _view_of(cfg: RLXConfig) -> _View:
    sections = {}
    for section in COMPONENT_SECTIONS:
        sec: ComponentSection = getattr(cfg, section)
        sections[section] = (sec.name, sec.options())
    return _View(sections, list(cfg.trainer.loggers), dict(cfg.loggers), cfg.model.path,
                 cfg.data.train_files, cfg.data.val_files)


def _view_of_raw(raw: dict[str, Any]) -> _View:
    defaults = RLXConfig()

    def sub(section: str) -> dict[str, Any]:
        value = raw.get(section)
        return value if isinstance(value, dict) else {}

    def str_list(value: Any) -> list[str] | None:
        if isinstance(value, str):
            value = [value]
        return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None

    sections = {}
    for section in COMPONENT_SECTIONS:
        if section in raw and not isinstance(raw[section], dict):
            continue  # the core check already reported it
        given = sub(section)
        name = given.get("name", getattr(defaults, section).name)
        if isinstance(name, str):
            core = _core_keys(section)
            sections[section] = (name, {k: v for k, v in given.items() if k not in core})
    loggers = sub("trainer").get("loggers", defaults.trainer.loggers)
    if isinstance(loggers, str):
        loggers = [s.strip() for s in loggers.split(",") if s.strip()]
    logger_opts = raw.get("loggers", {})
    model_path = sub("model").get("path", defaults.model.path)
    data = sub("data")
    return _View(
        sections,
        str_list(loggers) or [],
        {k: v for k, v in logger_opts.items() if isinstance(v, dict)} if isinstance(logger_opts, dict) else {},
        model_path if isinstance(model_path, str) else None,
        str_list(data.get("train_files", defaults.data.train_files)),
        str_list(data.get("val_files", defaults.data.val_files)),
    )


def resolve(raw: dict[str, Any], pm: PluginManager, *, check_files: bool = True) -> Resolved:
    """Validate everything; raise one :class:`ConfigError` with every problem found."""
    from rlx.data import check_files as file_problems

    problems: list[str] = []
    cfg: RLXConfig | None
    try:
        cfg = validate(raw)
    except ConfigError as exc:
        problems.extend(exc.problems)
        cfg = None
    view = _view_of(cfg) if cfg is not None else _view_of_raw(raw)
    options: dict[str, Any] = {}
    for section, (name, given) in view.sections.items():
        options[section] = _component_options(pm, COMPONENT_SECTIONS[section], name, given, section,
                                              _core_keys(section), problems)
    for name in view.loggers:
        options[f"loggers.{name}"] = _component_options(
            pm, "logger", name, dict(view.logger_options.get(name, {})), f"loggers.{name}", [], problems,
            name_path="trainer.loggers")
    for name in view.logger_options:
        if name not in view.loggers:
            problems.append(f"loggers.{name}: options for a logger that is not on; add it to trainer.loggers "
                            f"(now {view.loggers})")
    if view.model_path == "":
        problems.append("model.path: no model given. Pass --model PATH_OR_HUB_ID (or model.path=...), "
                        "or run `rlx train` with no arguments for the built-in tiny job.")
    if check_files:
        if view.train_files == []:
            problems.append("data.train_files: no training data given. Pass data.train_files=FILE.parquet; "
                            "`rlx data prepare gsm8k --out DIR` writes one.")
        problems.extend(file_problems(view.train_files or [], "data.train_files"))
        problems.extend(file_problems(view.val_files or [], "data.val_files"))
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))  # once each, in the order found
    assert cfg is not None
    return Resolved(cfg, options)


def _core_keys(section: str) -> list[str]:
    model = RLXConfig.model_fields[section].annotation
    return list(model.model_fields) if isinstance(model, type) else []


def load_config(pm: PluginManager, *, preset: str | None = None, config_file: str | None = None,
                shortcuts: dict[str, str | None] | None = None, overrides: list[str] | None = None,
                check_files: bool = True) -> Resolved:
    raw = build_raw(preset=preset, config_file=config_file, shortcuts=shortcuts, overrides=overrides)
    return resolve(raw, pm, check_files=check_files)
