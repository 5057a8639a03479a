"""The configuration of ``rlx rm train``: the same layering and error reports as ``rlx train``.

Sources, later wins: defaults < preset (``rm_tiny`` when nothing else is given) < ``--config`` YAML files
< ``--model`` / ``--backend`` < dotted overrides (``rm.center_rewards_coefficient=0.01``). The sections
``model``, ``optim``, ``trainer`` and ``loggers`` mean what they mean for ``rlx train``; ``data`` names
preference files and ``rm`` holds the loss and batching of reward-model training.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator

from rlx.config import (
    MAX_BATCH,
    MAX_LR,
    MAX_TOKENS,
    BackendConfig,
    ModelConfig,
    OptimConfig,
    TrainerConfig,
    _Section,
    build_raw,
    format_validation_error,
)
from rlx.errors import ConfigError

DEFAULT_PRESET = "rm_tiny"
# The centering term coef * (r_c + r_r)^2 only keeps the rewards near 0; a large coefficient fights the
# pairwise loss itself (TRL and OpenRLHF use about 0.01).
MAX_CENTER_COEF = 100.0


class RMDataConfig(_Section):
    train_files: list[str] = Field(default_factory=list, description="Preference files (parquet, JSONL or JSON) "
                                   "with prompt/chosen/rejected; `rlx data prepare preference` writes them.")
    val_files: list[str] = Field(default_factory=list, description="Held-out preference files for validation.")
    prompt_key: str = Field("prompt", description="Column of the prompt (text or chat messages).")
    chosen_key: str = Field("chosen", description="Column of the preferred reply (text or chat messages).")
    rejected_key: str = Field("rejected", description="Column of the other reply (text or chat messages).")
    margin_key: str | None = Field(None, description="Column of a per-pair margin m: the loss becomes "
                                   "-log sigmoid(r_c - r_r - m). None: no margin.")
    max_length: int = Field(512, gt=0, le=MAX_TOKENS, description="Tokens per conversation (chat template "
                            "applied); a pair with a longer side is dropped and counted.")
    train_batch_size: int = Field(32, gt=0, le=MAX_BATCH, description="Pairs per optimizer step.")
    val_batch_size: int = Field(64, gt=0, le=MAX_BATCH, description="Pairs per validation forward pass.")
    shuffle: bool = Field(True, description="Shuffle the training pairs every epoch.")

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


class RMOptimConfig(OptimConfig):
    lr: float = Field(1e-5, gt=0, le=MAX_LR, description=f"Peak learning rate (at most {MAX_LR:g}).")


class RMLossConfig(_Section):
    center_rewards_coefficient: float = Field(
        0.0, ge=0, le=MAX_CENTER_COEF, description="Coefficient c of the centering term c * (r_c + r_r)^2 "
        "added to each pair's loss (TRL's name; OpenRLHF and others use about 0.01): keeps the rewards near 0.")
    micro_batch_size_per_device: int = Field(
        8, gt=0, le=MAX_BATCH, description="Pairs per forward/backward pass; gradients accumulate over them.")

    @field_validator("center_rewards_coefficient")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v


class RMTrainerConfig(TrainerConfig):
    experiment: str = Field("rm", description="Experiment name (loggers; a folder name in output_dir).")


class RMConfig(_Section):
    """A reward-model training run."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: RMDataConfig = Field(default_factory=RMDataConfig)
    optim: RMOptimConfig = Field(default_factory=RMOptimConfig)
    rm: RMLossConfig = Field(default_factory=RMLossConfig)
    backend: BackendConfig = Field(default_factory=BackendConfig)
    trainer: RMTrainerConfig = Field(default_factory=RMTrainerConfig)
    loggers: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Per-logger options, e.g. loggers.swanlab.mode=offline.")

    def run_dir(self) -> Path:
        t = self.trainer
        return Path(os.path.expanduser(t.output_dir.format(project=t.project, experiment=t.experiment)))


@dataclass
class ResolvedRM:
    config: RMConfig
    options: dict[str, Any] = field(default_factory=dict)  # "backend" or "loggers.NAME" -> options model

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


def load_rm_config(pm: Any, *, preset: str | None = None, config_file: str | Sequence[str] | None = None,
                   model: str | None = None, backend: str | None = None, overrides: list[str] | None = None,
                   check_files: bool = True) -> ResolvedRM:
    """Merge the sources and validate everything, raising one :class:`ConfigError` with every problem."""
    from rlx.validate import _component_options

    raw = build_raw(preset=preset, config_file=config_file, shortcuts={"model": model, "backend": backend},
                    overrides=overrides, preset_family="rm", schema=RMConfig)
    if isinstance(raw.get("model"), dict) and "path" in raw["model"] and raw["model"]["path"] is None:
        raw["model"]["path"] = ""  # model.path=null: no model given, said as such below
    problems: list[str] = []
    cfg: RMConfig | None = None
    try:
        cfg = RMConfig.model_validate(raw)
    except ValidationError as exc:
        problems.extend(format_validation_error(exc, RMConfig))
    options: dict[str, Any] = {}
    # The backend is checked from the merged sources, so that its problems come with the others'.
    backend_raw = raw.get("backend") if isinstance(raw.get("backend"), dict) else {}
    backend_name = backend_raw.get("name", "torch")
    if backend_name != "torch":
        problems.append(f"backend.name: rlx rm train runs on the torch backend (one process); got {backend_name!r}.")
    else:
        options["backend"] = _component_options(pm, "backend", "torch",
                                                {k: v for k, v in backend_raw.items() if k != "name"}, "backend",
                                                ["name"], problems)
    if cfg is not None:
        for name in cfg.trainer.loggers:
            options[f"loggers.{name}"] = _component_options(
                pm, "logger", name, dict(cfg.loggers.get(name, {})), f"loggers.{name}", [], problems,
                name_path="trainer.loggers")
        for name in cfg.loggers:
            if name not in cfg.trainer.loggers:
                problems.append(f"loggers.{name}: options for a logger that is not on; add it to trainer.loggers "
                                f"(now {cfg.trainer.loggers})")
        if not cfg.model.path:
            problems.append("model.path: no model given. Pass --model PATH_OR_HUB_ID (or model.path=...): a causal "
                            f"LM to put a reward head on, or a sequence classifier; add --preset {DEFAULT_PRESET} for "
                            "the built-in task's model and data (a --config file replaces the preset), or run "
                            "`rlx rm train` with no arguments.")
        if check_files:
            problems.extend(_file_problems(cfg))
    if problems:
        error = ConfigError(list(dict.fromkeys(problems)))
        error.hint = ("Run `rlx rm train --help` for the options, or `rlx plugins show NAME` for a component's "
                      "options.")  # `rlx config show` resolves rlx train's config, not this one
        raise error
    assert cfg is not None
    return ResolvedRM(cfg, options)


def _file_problems(cfg: RMConfig) -> list[str]:
    from rlx.plugins.tasks.datasets import SOURCE_SUFFIXES
    from rlx.run.data import file_problem, is_resource
    from rlx.validate import output_dir_problems

    problems = []
    if not cfg.data.train_files:
        problems.append("data.train_files: no preference data given. Pass data.train_files=FILE (parquet, JSONL or "
                        "JSON with prompt/chosen/rejected); `rlx data prepare preference` writes one.")
    for key in ("train_files", "val_files"):
        for ref in getattr(cfg.data, key):
            if is_resource(ref):
                continue
            p = Path(os.path.expanduser(ref))
            problem = file_problem(p)
            if problem == "does not exist":
                problems.append(f"data.{key}: file {ref!r} does not exist.")
            elif problem is not None:
                problems.append(f"data.{key}: cannot read {ref!r}: {problem}.")
            elif p.suffix not in SOURCE_SUFFIXES:
                problems.append(f"data.{key}: {ref!r} is not a {', '.join(SOURCE_SUFFIXES)} file.")
    problems.extend(output_dir_problems(cfg))  # type: ignore[arg-type]  # reads trainer and run_dir() only
    return problems
