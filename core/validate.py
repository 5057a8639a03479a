"""Whole-config validation: core sections, each named plugin's own options, and data files.

Every problem is collected and reported at once as a :class:`ConfigError`.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from rlx.components import Component
from rlx.config import ComponentSection, RLXConfig, build_raw, format_validation_error, validate
from rlx.errors import ConfigError, UserError, describe_exception
from rlx.registry import PluginManager

# config section -> component kind
COMPONENT_SECTIONS = {"backend": "backend", "rollout": "rollout", "algorithm": "algorithm",
                      "reward": "reward", "launcher": "launcher", "agent": "agent_loop"}


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
            if key.startswith(("loggers.", "tools.", "interactions.")):
                section, _, name = key.partition(".")
                out[section][name] = dumped
            else:
                out[key].update(dumped)
        return out


def _component_options(pm: PluginManager, kind: str, name: str, given: dict[str, Any], path: str,
                       core_keys: list[str], problems: list[str], name_path: str | None = None,
                       check_requirements: bool = True) -> BaseModel | None:
    """Validate one plugin's options; append problems (with dotted paths) instead of raising.

    ``path`` is where the options live (``algorithm``, ``loggers.swanlab``); ``name_path`` is where the
    plugin's name was given (``algorithm.name``, ``trainer.loggers``). ``check_requirements``: the
    optional packages the component needs (:func:`rlx.registry.requirements`) must be installed.
    """
    name_path = name_path or path + ".name"
    try:
        comp = pm.get(kind, name)
    except UserError as exc:
        problems.append(f"{name_path}: {exc.message}")
        return None
    # A broken plugin: say which one and what is wrong with it, keep checking the rest.
    fault = f"{kind} {name!r} (plugin {comp.plugin}, distribution {comp.distribution} {comp.version})"
    fix = "Reinstall or update that plugin, or report the fault to its authors."
    missing = _missing_factory_module(comp)
    if missing:
        problems.append(f"{name_path}: {fault} names its factory {comp.factory!r}, but {missing}. {fix}")
    try:
        model = comp.load_config_model()
    except Exception as exc:
        problems.append(f"{path}: cannot load the options of {fault}: {describe_exception(exc)}. {fix}")
        return None
    if model is None:
        if given:
            problems.append(f"{path}: {kind} {name!r} takes no options; got {', '.join(sorted(given))}")
        elif check_requirements:
            problems.extend(_requirement_problems(comp, None, path, name_path))
        return None
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        problems.append(f"{path}: the config_model of {fault} must be a pydantic model class; got {model!r}. {fix}")
        return None
    try:
        options = model.model_validate(given, context={"plugins": pm})
    except ValidationError as exc:
        problems.extend(format_validation_error(exc, model, prefix=path, owner=f"{kind} {name!r}",
                                                extra_keys=core_keys))
        return None
    except Exception as exc:  # a validator of the plugin that raises something pydantic does not wrap
        problems.append(f"{path}: the options check of {fault} failed: {describe_exception(exc)}. {fix}")
        return None
    if check_requirements:
        lacking = _requirement_problems(comp, options, path, name_path)
        if lacking:  # the plugin's own checks would look into those packages
            problems.extend(lacking)
            return options
    # Options that name other components (an algorithm's adv_estimator) check those names here.
    check = getattr(options, "plugin_problems", None)
    if callable(check):
        try:
            problems.extend(f"{path}.{p}" for p in check(pm))
        except Exception as exc:
            problems.append(f"{path}: the options check of {fault} failed: {describe_exception(exc)}. {fix}")
    return options


def _requirement_problems(comp: Component, options: Any, path: str, name_path: str) -> list[str]:
    """One line for a component whose optional packages are not installed: which, and how to install them."""
    from rlx.registry import missing_requirements

    missing = missing_requirements(comp, options)
    if not missing:
        return []
    packages = list(dict.fromkeys(f"`{r.package}`" for r in missing))
    what = (f"the Python package {packages[0]}, which is" if len(packages) == 1
            else f"the Python packages {' and '.join(packages)}, which are")
    installs = "; ".join(dict.fromkeys(r.install for r in missing))
    others = [f"set {path}.{r.unless}" for r in missing if r.unless]
    others += [f"change {path}.{r.when[0]}" for r in missing if r.when is not None]
    others.append("take it off trainer.loggers" if comp.kind == "logger"
                  else f"choose another {comp.kind} (`rlx plugins list`)")
    given = "".join(f" with {path}.{r.when[0]}={r.when[1]}" for r in missing if r.when is not None)
    return [f"{name_path}: {comp.kind} {comp.name!r}{given} needs {what} not installed. Install it with: {installs}; "
            f"or {', or '.join(others)}."]


def _missing_factory_module(comp: Component) -> str:
    """Why a ``"module:attr"`` factory cannot be imported, found without importing the module itself
    (so validating stays light); ``""`` when the module is there or the factory is an object."""
    if not isinstance(comp.factory, str):
        return ""
    module = comp.factory.partition(":")[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except Exception as exc:  # a parent package that fails to import
        return f"looking for the module {module!r} failed: {describe_exception(exc)}"
    return "" if found else f"no module {module!r} is installed"


@dataclass
class _View:
    """What the plugin and file checks need, read from the validated config or, when the core
    sections are invalid, as far as possible from the raw dict (so every problem is reported at once)."""

    sections: dict[str, tuple[str, dict[str, Any]]]  # section -> (plugin name, options)
    loggers: list[str]
    logger_options: dict[str, Any]
    tools: list[str]
    tool_options: dict[str, Any]
    interactions: list[str]
    interaction_options: dict[str, Any]
    model_path: str | None
    train_files: list[str] | None
    val_files: list[str] | None


def _view_of(cfg: RLXConfig) -> _View:
    sections = {}
    for section in COMPONENT_SECTIONS:
        sec: ComponentSection = getattr(cfg, section)
        sections[section] = (sec.name, sec.options())
    return _View(sections, list(cfg.trainer.loggers), dict(cfg.loggers), list(cfg.agent.tools), dict(cfg.tools),
                 list(cfg.agent.interactions), dict(cfg.interactions), cfg.model.path, cfg.data.train_files,
                 cfg.data.val_files)


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
    tools = sub("agent").get("tools", [])
    if isinstance(tools, str):
        tools = [s.strip() for s in tools.split(",") if s.strip()]
    tool_opts = raw.get("tools", {})
    interactions = sub("agent").get("interactions", [])
    if isinstance(interactions, str):
        interactions = [s.strip() for s in interactions.split(",") if s.strip()]
    interaction_opts = raw.get("interactions", {})
    model_path = sub("model").get("path", defaults.model.path)
    data = sub("data")
    return _View(
        sections,
        str_list(loggers) or [],
        {k: v for k, v in logger_opts.items() if isinstance(v, dict)} if isinstance(logger_opts, dict) else {},
        str_list(tools) or [],
        {k: v for k, v in tool_opts.items() if isinstance(v, dict)} if isinstance(tool_opts, dict) else {},
        str_list(interactions) or [],
        ({k: v for k, v in interaction_opts.items() if isinstance(v, dict)}
         if isinstance(interaction_opts, dict) else {}),
        model_path if isinstance(model_path, str) else None,
        str_list(data.get("train_files", defaults.data.train_files)),
        str_list(data.get("val_files", defaults.data.val_files)),
    )


def resolve(raw: dict[str, Any], pm: PluginManager, *, check_files: bool = True,
            check_run_dir: bool = False) -> Resolved:
    """Validate everything; raise one :class:`ConfigError` with every problem found.

    ``check_files`` checks that the data files exist and that the optional packages the chosen components
    need are installed; ``check_run_dir`` that the run folder can be created and written
    (:func:`output_dir_problems`), for commands that train.
    """
    from rlx.run.data import check_files as file_problems

    problems: list[str] = []
    cfg: RLXConfig | None
    try:
        cfg = validate(raw)
    except ConfigError as exc:
        problems.extend(exc.problems)
        cfg = None
    view = _view_of(cfg) if cfg is not None else _view_of_raw(raw)
    pm.components()  # two plugins claiming one name: one error of its own, not one per section that asks
    options: dict[str, Any] = {}
    for section, (name, given) in view.sections.items():
        options[section] = _component_options(pm, COMPONENT_SECTIONS[section], name, given, section,
                                              _core_keys(section), problems, check_requirements=check_files)
    # Components picked by a list (trainer.loggers, agent.tools) whose options live under loggers.NAME / tools.NAME.
    for kind, section, names, given, listed_in in (
            ("logger", "loggers", view.loggers, view.logger_options, "trainer.loggers"),
            ("tool", "tools", view.tools, view.tool_options, "agent.tools"),
            ("interaction", "interactions", view.interactions, view.interaction_options, "agent.interactions")):
        for name in names:
            options[f"{section}.{name}"] = _component_options(
                pm, kind, name, dict(given.get(name, {})), f"{section}.{name}", [], problems,
                name_path=listed_in, check_requirements=check_files)
        for name in given:
            if name not in names:
                article = "an" if kind[0] in "aeiou" else "a"
                problems.append(f"{section}.{name}: options for {article} {kind} that is not on; add it to {listed_in} "
                                f"(now {names})")
    if view.model_path == "":
        problems.append("model.path: no model given. Pass --model PATH_OR_HUB_ID (or model.path=...), "
                        "add --preset tiny for the built-in tiny job's model and data (a --config file replaces "
                        "the preset), or run `rlx train` with no arguments.")
    if cfg is not None:
        problems.extend(training_problems(cfg, pm))
    if check_run_dir and cfg is not None:
        problems.extend(output_dir_problems(cfg))
    if check_files:
        if view.train_files == []:
            problems.append("data.train_files: no training data given. Pass data.train_files=FILE.parquet "
                            "(`rlx data prepare gsm8k --out DIR` writes one), or add --preset tiny for the "
                            "built-in tiny job's data.")
        problems.extend(file_problems(view.train_files or [], "data.train_files"))
        problems.extend(file_problems(view.val_files or [], "data.val_files"))
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))  # once each, in the order found
    assert cfg is not None
    return Resolved(cfg, options)


def training_problems(cfg: RLXConfig, pm: Any = None) -> list[str]:
    """What the environment and the chosen backend must offer for this config: the backend's own checks (its
    component's ``extra["config_problems"]``, a function of the config: LoRA, compilation, sequence parallelism,
    the attention implementation)."""
    from rlx.components import resolve as resolve_ref
    from rlx.registry import get_plugin_manager

    problems: list[str] = []
    components = (pm or get_plugin_manager()).components()
    component = components.get(("backend", cfg.backend.name))
    check = component.extra.get("config_problems") if component is not None else None
    if check is not None:
        problems.extend(resolve_ref(check)(cfg))
    problems.extend(partial_rollout_problems(cfg, components.get(("rollout", cfg.rollout.name))))
    problems.extend(agent_problems(cfg, components.get(("agent_loop", cfg.agent.name))))
    return problems


def agent_problems(cfg: RLXConfig, loop: Component | None) -> list[str]:
    """Multi-turn rollouts (an agent loop other than single_turn) with the features they do not combine with."""
    if loop is None or loop.extra.get("single_turn"):
        if cfg.agent.interactions and loop is not None:
            return [f"agent.interactions: agent loop {cfg.agent.name!r} answers once and never asks an interaction; "
                    "set agent.name=tool_call (with agent.tools=[] when the model calls no tools)"]
        return []
    problems = []
    if cfg.rollout.partial:
        problems.append(f"rollout.partial: an episode of agent loop {cfg.agent.name!r} is not continued across "
                        "steps (its tool calls would run twice). Set rollout.partial=false (with "
                        "trainer.max_staleness >= 1 the next step's episodes still overlap training), or "
                        "agent.name=single_turn.")
    if cfg.agent.name == "tool_call" and not cfg.agent.tools and not cfg.agent.interactions:
        problems.append("agent.tools: agent loop 'tool_call' has no tools to call and no interaction to answer "
                        "it. Name tools, e.g. agent.tools=[calculator] or agent.tools=[python], or an interaction, "
                        "e.g. agent.interactions=[gsm8k] (`rlx plugins list` shows them).")
    return problems


def partial_rollout_problems(cfg: RLXConfig, engine: Component | None) -> list[str]:
    """``rollout.partial`` needs an engine that stops where it is when asked (its component says so with
    ``extra["interruptible"]``) and, for now, one in the controller's process."""
    if not cfg.rollout.partial:
        return []
    problems = []
    if cfg.trainer.max_staleness < 2:
        problems.append(
            f"rollout.partial: a response interrupted at a step boundary is trained one step later than it started, "
            f"so its first tokens are two policy versions old, which needs trainer.max_staleness >= 2 (it is "
            f"{cfg.trainer.max_staleness}). Set trainer.max_staleness=2, or rollout.partial=false.")
    if engine is None:
        return problems
    if not engine.extra.get("interruptible"):
        problems.append(f"rollout.partial: rollout engine {cfg.rollout.name!r} cannot be interrupted in the middle "
                        "of a generation and continue the sequence later. Use rollout.name=hf, or set "
                        "rollout.partial=false (with trainer.max_staleness >= 1 the next step's rollouts still "
                        "overlap training).")
    launcher = cfg.launcher.options()
    if cfg.launcher.name != "local" or int(launcher.get("nproc", 1)) != 1 or int(launcher.get("rollout_nproc", 0)):
        problems.append(f"rollout.partial: the interruption reaches an engine in the controller's own process only "
                        f"(launcher.name=local, --nproc 1, launcher.rollout_nproc=0), but this run has "
                        f"launcher.name={cfg.launcher.name}, launcher.nproc={launcher.get('nproc', 1)}, "
                        f"launcher.rollout_nproc={launcher.get('rollout_nproc', 0)}. Set rollout.partial=false with "
                        "several processes (the next step's rollouts still overlap training).")
    return problems


def _core_keys(section: str) -> list[str]:
    model = RLXConfig.model_fields[section].annotation
    return list(model.model_fields) if isinstance(model, type) else []


# The kernel's virtual file systems: writing a run there fails or, worse, changes the system.
VIRTUAL_ROOTS = (Path("/proc"), Path("/sys"), Path("/dev"))


def output_dir_problems(cfg: RLXConfig) -> list[str]:
    """Why the run folder could not be created or written, checked before any model is loaded.

    The folder itself is created by the trainer; this only looks at what is already on disk.
    """
    run_dir = Path(os.path.abspath(cfg.run_dir()))
    where = f"trainer.output_dir: the run folder {run_dir}"
    try:
        real = run_dir.resolve()
        for root in VIRTUAL_ROOTS:
            if real == root or root in real.parents:
                return [f"{where} lies in {root}, a virtual file system of the kernel. Choose a folder on a disk."]
        existing = run_dir
        while not existing.exists():  # the deepest part of the path that is there
            existing = existing.parent
        if not existing.is_dir():
            if existing == run_dir:
                return [f"{where} is a file, not a folder. Move the file or choose another trainer.output_dir."]
            return [f"{where} cannot be created: {existing} is a file, not a folder. "
                    "Choose another trainer.output_dir."]
        if not os.access(existing, os.W_OK | os.X_OK):
            what = "is" if existing == run_dir else f"cannot be created: {existing} is"
            return [f"{where} {what} not writable by this user. Choose another trainer.output_dir."]
    except OSError as exc:
        return [f"{where} cannot be checked: {exc}. Choose another trainer.output_dir."]
    return []


def check_output_dir(cfg: RLXConfig) -> None:
    """Raise a :class:`ConfigError` if the run folder could not be created or written."""
    problems = output_dir_problems(cfg)
    if problems:
        raise ConfigError(problems)


def load_config(pm: PluginManager, *, preset: str | None = None, config_file: str | Sequence[str] | None = None,
                shortcuts: dict[str, str | None] | None = None, overrides: list[str] | None = None,
                check_files: bool = True, check_run_dir: bool = False) -> Resolved:
    raw = build_raw(preset=preset, config_file=config_file, shortcuts=shortcuts, overrides=overrides, pm=pm)
    return resolve(raw, pm, check_files=check_files, check_run_dir=check_run_dir)
