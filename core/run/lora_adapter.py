"""``model.lora_adapter_path``: LoRA training that starts from a saved peft adapter instead of new adapters.

When training starts (not when the config is validated: the folder may exist only where the run runs), the
trainer calls :func:`with_adapter_settings`. It reads the folder's ``adapter_config.json`` and fills the
``model.lora_*`` options the config leaves unset with the adapter's (``r``, ``lora_alpha``,
``target_modules``, ``exclude_modules``, ``lora_dropout``); a rank or alpha given otherwise, and adapter
settings rlx's LoRA does not compute (DoRA, rsLoRA, trained biases, modules trained in full, per-layer ranks)
are errors. The resolved config is the run's record (``config.yaml``), so checkpoints, ``rlx export`` and a
resume see an ordinary LoRA run. The adapter's weights are loaded by the actor's worker right after it puts
its adapters on the model (``rlx.plugins.modeling.lora.apply``, through ``LoraSpec.adapter_path``). A resumed
run reads neither: its LoRA settings come from the run's record and its weights from its checkpoint.

Only the standard library here: no torch, no peft.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlx.errors import ConfigError, UserError

if TYPE_CHECKING:
    from rlx.validate import Resolved

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # peft's names, the first preferred
KEY = "model.lora_adapter_path"
_HINT = ("Give model.lora_adapter_path a folder written by peft's save_pretrained (or `rlx export "
         "--adapter-only`), or leave it unset to start from new adapters.")
# adapter_config.json settings rlx's LoRA does not compute: key -> (what it does, the value it must have)
_UNSUPPORTED: dict[str, tuple[str, Any]] = {
    "use_dora": ("DoRA (weight-decomposed LoRA)", False),
    "use_rslora": ("rsLoRA (scaling by lora_alpha / sqrt(r))", False),
    "lora_bias": ("trained biases on lora_B", False),
    "modules_to_save": ("modules trained in full beside the adapters", None),
    "rank_pattern": ("ranks that differ by module", None),
    "alpha_pattern": ("alphas that differ by module", None),
    "layers_to_transform": ("adapters on some layers only", None),
    "target_parameters": ("adapters on parameters rather than modules", None),
}
# The model options an adapter fills in: option -> adapter_config.json's key
_FILLED = {"lora_rank": "r", "lora_alpha": "lora_alpha", "target_modules": "target_modules",
           "exclude_modules": "exclude_modules", "lora_dropout": "lora_dropout"}


def adapter_folder(ref: str) -> Path:
    """The adapter's local folder; a missing folder or one without ``adapter_config.json`` is a user error."""
    from rlx.run.data import resolve_path

    folder = Path(resolve_path(ref))
    if not folder.is_dir():
        raise UserError(f"{KEY}={ref}: {'no such folder' if not folder.exists() else 'not a folder'}.", _HINT)
    if not (folder / ADAPTER_CONFIG).is_file():
        raise UserError(f"{KEY}={ref}: the folder holds no {ADAPTER_CONFIG}, so it is not a peft adapter.", _HINT)
    return folder


def weights_file(folder: Path) -> Path:
    """The adapter's tensors (``adapter_model.safetensors``, else peft's older ``adapter_model.bin``)."""
    for name in ADAPTER_WEIGHTS:
        if (folder / name).is_file():
            return folder / name
    raise UserError(f"{KEY}={folder}: the folder holds no {ADAPTER_WEIGHTS[0]} (nor {ADAPTER_WEIGHTS[1]}), so "
                    "there are no adapter weights to start from.", _HINT)


def _names(value: Any, where: str, key: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return sorted(value)  # peft writes a set as a list in no fixed order
    if isinstance(value, list) and not value:
        return []
    raise UserError(f"{where}: {key}={value!r} is not a module name or a list of them.", _HINT)


def read_adapter_config(folder: Path, ref: str) -> dict[str, Any]:
    """The adapter's LoRA settings as ``model`` options (``lora_rank``, ``lora_alpha``, ``target_modules``,
    ``exclude_modules``, ``lora_dropout``), after refusing what rlx's LoRA does not compute."""
    from rlx.config import MAX_LORA_RANK

    where = f"{KEY}={ref}: {ADAPTER_CONFIG}"
    try:
        raw = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{where} cannot be read as JSON ({type(exc).__name__}: {exc}).", _HINT) from None
    if not isinstance(raw, dict):
        raise UserError(f"{where} is not a JSON object.", _HINT)
    kind = raw.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise UserError(f"{where} holds a {kind} adapter; rlx trains LoRA adapters only.", _HINT)
    for key, (what, wanted) in _UNSUPPORTED.items():
        value = raw.get(key, wanted)
        if value not in (wanted, None, False, [], {}, ""):
            raise UserError(f"{where} sets {key}={value!r} ({what}), which rlx's LoRA does not compute.",
                            "Start from an adapter without it, or leave model.lora_adapter_path unset.")
    if raw.get("bias", "none") not in ("none", None):
        raise UserError(f"{where} sets bias={raw['bias']!r} (trained biases), which rlx's LoRA does not compute "
                        "(bias=none).", "Start from an adapter without it, or leave model.lora_adapter_path unset.")
    r, alpha, dropout = raw.get("r"), raw.get("lora_alpha", 8), raw.get("lora_dropout", 0.0)
    if isinstance(r, bool) or not isinstance(r, int) or not 0 < r <= MAX_LORA_RANK:
        raise UserError(f"{where}: r={r!r} is not a rank (a whole number from 1 to {MAX_LORA_RANK}).", _HINT)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= MAX_LORA_RANK:
        raise UserError(f"{where}: lora_alpha={alpha!r} is not a positive number.", _HINT)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise UserError(f"{where}: lora_dropout={dropout!r} is not a probability below 1.", _HINT)
    targets = raw.get("target_modules")
    if isinstance(targets, str) and targets != "all-linear":
        raise UserError(f"{where}: target_modules={targets!r} is a regular expression; rlx takes module names "
                        "(peft writes the names it adapted when given a list or all-linear).", _HINT)
    if targets != "all-linear":
        targets = _names(targets, where, "target_modules")
        if not targets:
            raise UserError(f"{where} names no target_modules.", _HINT)
    return {"lora_rank": r, "lora_alpha": float(alpha), "target_modules": targets,
            "exclude_modules": _names(raw.get("exclude_modules"), where, "exclude_modules"),
            "lora_dropout": float(dropout), "base_model_name_or_path": raw.get("base_model_name_or_path")}


def _same(option: str, given: Any, adapter: Any) -> bool:
    if option in ("target_modules", "exclude_modules"):
        if given == "all-linear" or adapter == "all-linear":
            return given == adapter or given == "all-linear"  # peft writes all-linear as the names it found
        return sorted(given) == sorted(adapter)
    return float(given) == float(adapter)


def adapter_settings(model: Any, ref: str) -> dict[str, Any]:
    """The ``model`` options a run starting from the adapter at ``ref`` trains with: the adapter's, where the
    config leaves them unset. A given lora_rank (other than 0), lora_alpha, target_modules or exclude_modules
    that differs from the adapter's is a config error naming both; a given lora_dropout wins (it shapes the
    training, not the adapter)."""
    folder = adapter_folder(ref)
    found = read_adapter_config(folder, ref)
    weights_file(folder)  # no weights: said now, not after the models are loaded
    given = model.model_fields_set
    out: dict[str, Any] = {}
    problems = []
    for option in _FILLED:
        if option in given and not (option == "lora_rank" and model.lora_rank == 0):
            if option != "lora_dropout" and not _same(option, getattr(model, option), found[option]):
                problems.append(f"model.{option}={getattr(model, option)} differs from the adapter's "
                                f"{_FILLED[option]}={found[option]} ({KEY}={ref}); leave model.{option} unset to "
                                "take the adapter's")
            continue
        out[option] = found[option]
    if problems:
        raise ConfigError(problems)
    base = found["base_model_name_or_path"]
    from rlx.run.data import resolve_path

    if isinstance(base, str) and base and not (_same_model(base, model.path)
                                               or _same_model(base, resolve_path(model.path))):
        warnings.warn(f"{KEY}={ref} was trained on {base}, and this run's model.path is {model.path}: its "
                      "weights load if the shapes fit, but they were learned on another model.", stacklevel=2)
    return out


def _same_model(a: str, b: str) -> bool:
    """Whether two model references plausibly name one model (the same folder or hub name, or the same last
    part: a hub name and its local download)."""
    def last(ref: str) -> str:
        return os.path.basename(os.path.normpath(os.path.expanduser(ref))).lower()
    return a == b or last(a) == last(b)


def with_adapter_settings(resolved: Resolved, recorded: dict[str, Any] | None) -> tuple[Resolved, str | None]:
    """``resolved`` with the adapter's LoRA settings filled in (:func:`adapter_settings`), and the adapter's
    local folder whose weights the actor starts from. ``recorded``: the ``model`` section of the run's record
    when the run resumes; its LoRA settings are taken instead and no folder is read (None: a new run)."""
    cfg = resolved.config
    model = cfg.model
    ref = model.lora_adapter_path
    if not ref:
        return resolved, None
    if recorded is not None and int(recorded.get("lora_rank") or 0) > 0:
        given = model.model_fields_set
        update = {option: recorded[option] for option in _FILLED
                  if option in recorded and (option not in given or (option == "lora_rank" and not model.lora_rank))}
        folder = None
    else:
        update = adapter_settings(model, ref)
        from rlx.run.data import resolve_path

        # a resumed run without a record of its LoRA settings reads them here; its checkpoint holds the weights
        folder = str(Path(resolve_path(ref)).resolve()) if recorded is None else None
    new_model = type(model).model_validate({**model.model_dump(), **update})
    import dataclasses

    return dataclasses.replace(resolved, config=cfg.model_copy(update={"model": new_model})), folder
