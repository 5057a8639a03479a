"""Config checks the torch-based backends share, run before any process starts (``rlx config validate``, ``rlx
train``): LoRA needs peft, what FSDP1 lacks, and what Ulysses sequence parallelism needs. Each backend names
:func:`config_problems` in its component's ``extra["config_problems"]``; core calls the chosen backend's."""

from __future__ import annotations

import importlib.util
from typing import Any

# Why LoRA stays refused under FSDP1 (config_problems says the same before a run starts).
LORA_FSDP1 = ("LoRA is built in the fsdp2 and torch backends, not in fsdp (FSDP1): FSDP1 flattens each decoder "
              "layer's parameters into one tensor of one dtype, so the frozen base (model.dtype) and its "
              "trainable adapters (float32 master weights) cannot share a layer.")
COMPILE_FSDP1 = ("use_torch_compile=true is built in the fsdp2 and torch backends, not in fsdp (FSDP1): FSDP1 wraps "
                 "each decoder layer in a module of its own, which rlx does not compile.")

# The component ``extra`` of a backend that uses these checks.
CONFIG_PROBLEMS = {"config_problems": "rlx.plugins.modeling.checks:config_problems"}


def config_problems(cfg: Any) -> list[str]:
    """LoRA (peft installed; not under FSDP1), compilation (not under FSDP1), Ulysses and flash-attn."""
    from rlx.plugins.modeling.lora import INSTALL_HINT, peft_missing

    problems = []
    backend = cfg.backend.name
    if cfg.model.lora_rank > 0 or cfg.model.lora_adapter_path:
        option = (f"model.lora_rank={cfg.model.lora_rank}" if cfg.model.lora_rank > 0
                  else f"model.lora_adapter_path={cfg.model.lora_adapter_path}")
        if peft_missing():
            problems.append(f"{option}: LoRA needs the peft package, which is not installed. {INSTALL_HINT}")
        if backend == "fsdp":
            problems.append(f"{option}: {LORA_FSDP1} Use backend.name=fsdp2 (or torch), or model.lora_rank=0 "
                            "and no model.lora_adapter_path.")
    if cfg.model.lora_adapter_path and backend == "megatron":
        problems.append(f"model.lora_adapter_path={cfg.model.lora_adapter_path}: the megatron backend has no "
                        "LoRA; use backend.name=fsdp2 (or torch) to train from a saved adapter.")
    if backend == "fsdp":
        for section in ("actor", "critic"):
            if getattr(cfg, section).use_torch_compile:
                problems.append(f"{section}.{COMPILE_FSDP1} Use backend.name=fsdp2 (or torch), or "
                                f"{section}.use_torch_compile=false.")
    problems.extend(ulysses_problems(cfg))
    problems.extend(attention_problems(cfg.backend.options(), cfg.trainer.device))
    return problems


def ulysses_problems(cfg: Any) -> list[str]:
    """What the config alone shows to be wrong with ``ulysses_sequence_parallel_size`` (checked before any
    process starts): the ``torch`` backend has no sequence parallelism, and Ulysses cuts packed rows. The
    number of processes and the model's heads are checked by the workers (``torchrun`` sets the world
    size, and the heads are in the model's config)."""
    problems = []
    for role in ("actor", "critic"):
        section = getattr(cfg, role)
        size = section.ulysses_sequence_parallel_size
        if size <= 1:
            continue
        option = f"{role}.ulysses_sequence_parallel_size={size}"
        if cfg.backend.name == "torch":
            problems.append(f"{option}: the torch backend has no sequence parallelism (every process holds whole "
                            f"sequences). Use --backend fsdp2 (or fsdp) with a multiple of {size} processes, or "
                            f"{role}.ulysses_sequence_parallel_size=1.")
        if not section.use_remove_padding:
            problems.append(f"{option}: Ulysses cuts packed sequences, but {role}.use_remove_padding is false. Set "
                            f"{role}.use_remove_padding=true, or {role}.ulysses_sequence_parallel_size=1.")
    return problems


def attention_problems(backend_options: dict[str, Any], device: str, prefix: str = "backend") -> list[str]:
    """``attn_implementation=flash_attention_2`` where it cannot load: without the flash-attn package, or
    without a CUDA GPU (transformers would raise an ImportError while loading the model)."""
    if backend_options.get("attn_implementation") != "flash_attention_2":
        return []
    lacking = []
    if importlib.util.find_spec("flash_attn") is None:
        lacking.append("the flash-attn package is not installed")
    if device == "cpu":
        lacking.append("trainer.device is cpu")
    else:
        import torch

        if not torch.cuda.is_available():
            lacking.append("no CUDA GPU is available")
    if not lacking:
        return []
    return [f"{prefix}.attn_implementation=flash_attention_2 needs the flash-attn package and a CUDA GPU, but "
            f"{' and '.join(lacking)}. Use {prefix}.attn_implementation=sdpa (the default, which also packs "
            "sequences), or install flash-attn (pip install flash-attn) on a machine with a CUDA GPU."]
