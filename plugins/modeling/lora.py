"""LoRA through peft: adapters on a frozen base, merged weights for the rollout engine, adapter checkpoints.

The settings travel to the workers as ``RoleSpec.lora``, a :class:`rlx.records.LoraSpec` (:func:`settings`, from
``model.lora_*``).
A worker wraps its Hugging Face model with :func:`apply`; only the adapters (and, on a value model, its
one-output head) are trainable. The reference policy is the same model with the adapter switched off
(peft's ``disable_adapter``), so no second copy of the base is loaded. The rollout engine and ``rlx
export`` get merged weights (base + alpha / rank * B @ A under the base's own names) computed one tensor at a
time by :func:`merged_weights`; the model itself is never merged in place, so training goes on unchanged.
A run started from a saved adapter (``model.lora_adapter_path``, ``LoraSpec.adapter_path``) has its adapters
filled from the adapter's tensors right after they are made (:func:`load_adapter`); the reference is still
the base without any adapter.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from rlx.errors import UserError
from rlx.records import LoraSpec, lora_spec

if TYPE_CHECKING:
    import torch

    from rlx.config import ModelConfig

ADAPTER = "default"  # peft's name for the one adapter rlx trains
ADAPTER_FILE = "adapter.safetensors"  # a checkpoint's trainable tensors (adapters, a value head)
_PEFT_PREFIX = "base_model.model."  # what peft puts before the wrapped model's own names
INSTALL_HINT = "Install peft: pip install 'rlx[peft]' (or pip install peft)."
# Heads of transformers' *ForTokenClassification models: new on a value model, so trained in full.
_VALUE_HEADS = ("score", "classifier")


def settings(model: ModelConfig) -> LoraSpec | None:
    """The LoRA settings a worker needs (``RoleSpec.lora``), or None when LoRA is off (``rlx.records.lora_spec``)."""
    return lora_spec(model)


def _modules(targets: str | tuple[str, ...]) -> str | list[str]:
    """``all-linear`` or the module names as a list (as the config gives them, and as peft takes them)."""
    return targets if isinstance(targets, str) else list(targets)


def peft_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("peft") is None


def require_peft() -> None:
    if peft_missing():
        raise UserError("model.lora_rank > 0 needs the peft package, which is not installed.", INSTALL_HINT)


def _matches(name: str, patterns: list[str]) -> bool:
    """peft's rule for a list of names: the module's full name, or its name after a dot."""
    return any(name == p or name.endswith("." + p) for p in patterns)


_REGEX = re.compile(r"[*?\[\]()|^$\\+{}]")


def excluded_names(model: Any, patterns: list[str]) -> list[str]:
    """``model.exclude_modules`` as peft's list: a name or name suffix as it is; an entry with a regular
    expression's characters (``.*visual.*``, peft's form when given one string) replaced by the full names of the
    modules it matches whole."""
    names = [n for n, _ in model.named_modules()]
    out: list[str] = []
    for p in patterns:
        if _REGEX.search(p):
            rx = re.compile(p)
            out.extend(n for n in names if n and rx.fullmatch(n))
        else:
            out.append(p)
    return out


def linear_modules(model: Any) -> list[str]:
    """Full names of the linear layers that can take an adapter (the output head excluded)."""
    import torch

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not head]


def _check_targets(model: Any, lora: LoraSpec, excluded: list[str]) -> None:
    """A target list that selects no linear layer is a user error naming some that exist."""
    linear = linear_modules(model)
    targets = _modules(lora.target_modules)
    chosen = [n for n in linear if (targets == "all-linear" or _matches(n, list(targets)))
              and not _matches(n, excluded)]
    if chosen:
        return
    suffixes = list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in linear))
    raise UserError(f"model.target_modules={targets} (exclude_modules={list(lora.exclude_modules)}) selects no "
                    f"linear layer of {type(model).__name__}; its linear layers are named "
                    f"{', '.join(suffixes[:8])}{' ...' if len(suffixes) > 8 else ''}.",
                    "Set model.target_modules=all-linear, or list some of those names.")


def apply(model: Any, lora: LoraSpec, *, value_head: bool, adapter_dtype: torch.dtype | None) -> Any:
    """``model`` wrapped by peft with fresh adapters. The base's weights are frozen; the adapters (and a value
    model's head) are trainable and held in ``adapter_dtype`` (None: float32, peft's default)."""
    import torch

    require_peft()
    from peft import LoraConfig, get_peft_model

    excluded = excluded_names(model, list(lora.exclude_modules))
    head: list[str] = []
    if value_head:
        head = [name for name, _ in model.named_children() if name in _VALUE_HEADS]
        excluded += head  # trained in full (modules_to_save), never given an adapter
    else:  # the output head stays plain: the chunked log-prob head computes from its weight alone
        output = model.get_output_embeddings()
        excluded += [name for name, module in model.named_modules() if output is not None and module is output]
    _check_targets(model, lora, excluded)
    config = LoraConfig(
        r=int(lora.rank), lora_alpha=float(lora.alpha), lora_dropout=float(lora.dropout),
        target_modules=_modules(lora.target_modules), exclude_modules=excluded or None, modules_to_save=head or None,
        task_type="TOKEN_CLS" if value_head else "CAUSAL_LM", bias="none")
    with warnings.catch_warnings():
        # peft asks the model for transformers' deprecated is_gradient_checkpointing: a FutureWarning meant
        # for peft's authors, printed on every LoRA run.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        wrapped = get_peft_model(model, config, adapter_name=ADAPTER, autocast_adapter_dtype=False)
    dtype = adapter_dtype or torch.float32
    for name, param in wrapped.named_parameters():
        if is_adapter(name):
            param.data = param.data.to(dtype)
    if lora.adapter_path and not any(p.is_meta for p in wrapped.parameters()):  # meta: rank 0's reach it later
        load_adapter(wrapped, lora.adapter_path)
    return wrapped


def _peft_key(name: str) -> str:
    """A parameter's name in a saved peft adapter: rlx's adapter name dropped, peft's prefix kept."""
    parts = [p for p in name.split(".") if p != ADAPTER]
    return ".".join(parts)


def load_adapter(wrapped: Any, folder: str) -> None:
    """Start the adapters from a saved peft adapter (``model.lora_adapter_path``): its tensors, under peft's
    names, copied into the wrapped model's adapters (each in the adapters' own dtype). Every adapter must get a
    tensor of its shape and every tensor must have an adapter, else a user error naming some."""
    from pathlib import Path

    import torch

    from rlx.run.lora_adapter import KEY, weights_file

    path = weights_file(Path(folder))
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a broken file, whatever the library says of it
        raise UserError(f"{KEY}: {path} cannot be read ({type(exc).__name__}: {exc}).",
                        "Write the adapter again (peft's save_pretrained or `rlx export --adapter-only`).") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{KEY}: {path} holds no tensors by name.", "Write the adapter again.")
    state = {k.removeprefix(_PEFT_PREFIX): v for k, v in state.items()}
    params = {_peft_key(name).removeprefix(_PEFT_PREFIX): p for name, p in wrapped.named_parameters()
              if is_adapter(name)}
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    wrong = sorted(f"{n} {tuple(state[n].shape)} (the model's {tuple(params[n].shape)})"
                   for n in set(params) & set(state) if params[n].shape != state[n].shape)
    if missing or unexpected or wrong:
        raise UserError(f"{KEY}: the tensors of {path} do not fit this model's adapters: "
                        + "; ".join(f"{what} {names[:3]}{' ...' if len(names) > 3 else ''}" for what, names in
                                    (("no tensor for", missing), ("no adapter for", unexpected),
                                     ("other shapes", wrong)) if names) + ".",
                        "Start from an adapter trained on model.path, with the target_modules it was saved with.")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name].to(p.dtype))


def base_name(key: str) -> str | None:
    """The plain model's name of a key of the wrapped model's state dict (with or without peft's
    ``base_model.model.`` prefix); None for adapter tensors and the frozen original of a module trained in
    full."""
    parts = key.removeprefix(_PEFT_PREFIX).split(".")
    if any(p.startswith("lora_") for p in parts) or "original_module" in parts:
        return None
    out: list[str] = []
    i = 0
    while i < len(parts):
        if parts[i] == "base_layer":
            i += 1
        elif parts[i] == "modules_to_save":
            i += 2  # modules_to_save.<adapter>
        else:
            out.append(parts[i])
            i += 1
    return ".".join(out)


def merge_stream(named: Iterable[tuple[str, torch.Tensor]], scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    """The wrapped model's full tensors, in state-dict order, turned into the plain model's: a linear layer's
    ``base_layer.weight`` held until its ``lora_A`` and ``lora_B`` arrive (they follow it) and yielded as
    base + scale * B @ A (computed in float32, returned in the base's dtype); adapters themselves dropped.
    Works on any stream of full tensors, so a sharded backend that gathers one tensor at a time can use it."""
    held: dict[str, torch.Tensor] = {}  # module -> its base weight, until both factors are here
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in named:
        parts = key.split(".")
        if key.endswith(".base_layer.weight"):
            held[key.removesuffix(".base_layer.weight")] = tensor
            continue
        factor = next((p for p in parts if p in ("lora_A", "lora_B")), None)
        if factor is not None and parts[-1] == "weight" and f".{factor}.{ADAPTER}." in key:
            module = key.split(f".{factor}.")[0]
            got = factors.setdefault(module, {})
            got[factor] = tensor
            if len(got) == 2 and module in held:
                base = held.pop(module)
                del factors[module]
                merged = base.float() + scale * (got["lora_B"].float() @ got["lora_A"].float())
                yield str(base_name(f"{module}.base_layer.weight")), merged.to(base.dtype)
            continue
        name = base_name(key)
        if name is not None:
            yield name, tensor
    if held or factors:
        raise RuntimeError(f"LoRA layers without both factors: {sorted(held) + sorted(factors)}")


def merged_weights(wrapped: Any, scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain model's tensors with the adapter merged in, one at a time, named as in the Hugging Face
    model (``scale`` = lora_alpha / lora_rank). A state dict's tensors are detached: merging builds no graph."""
    yield from merge_stream(wrapped.state_dict().items(), scale)


def scale_of(lora: LoraSpec) -> float:
    return lora.scale


def is_adapter(name: str) -> bool:
    """Whether a parameter of the wrapped model is one peft trains (an adapter, a module trained in full),
    told by its name: a frozen worker (``rlx export``) holds them without gradients."""
    parts = name.split(".")
    return "modules_to_save" in parts or any(p.startswith("lora_") for p in parts)


def trainable_state(wrapped: Any) -> dict[str, torch.Tensor]:
    """The trainable tensors (adapters, a value model's head) by parameter name: what a checkpoint holds."""
    return {name: p.detach().contiguous() for name, p in wrapped.named_parameters() if is_adapter(name)}


def load_trainable(wrapped: Any, state: dict[str, torch.Tensor], where: str) -> None:
    """Copy a checkpoint's trainable tensors into the model; their names and shapes must match exactly."""
    import torch

    params = {name: p for name, p in wrapped.named_parameters() if is_adapter(name)}
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    wrong = sorted(n for n in set(params) & set(state) if params[n].shape != state[n].shape)
    if missing or unexpected or wrong:
        raise UserError(f"{where} does not match this run's LoRA adapters: missing {missing[:3]}, unexpected "
                        f"{unexpected[:3]}, other shapes {wrong[:3]}.",
                        "Resume with the model and the model.lora_rank / target_modules / exclude_modules the run "
                        "was started with.")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name])
