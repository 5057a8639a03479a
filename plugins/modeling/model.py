"""A role's model and its training set-up for the torch-based backends: the device, the trained weights' dtype,
a value model (critic), the learning-rate schedule, the checkpointed RNG file, and the role's settings from the
config laid under its :class:`~rlx.protocols.RoleSpec`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from rlx.protocols import RoleSpec
from rlx.records import RoleSettings

if TYPE_CHECKING:
    import torch

    from rlx.context import BuildContext



def rng_file(rank: int) -> str:
    return "rng.pt" if rank == 0 else f"rng_rank{rank}.pt"


def check_attention(attn_implementation: str, device: str, spec: RoleSpec) -> None:
    from rlx.errors import UserError

    if attn_implementation == "flex_attention" and spec.trainable and str(device).startswith("cpu"):
        raise UserError(f"backend.attn_implementation=flex_attention cannot train the {spec.role} on the CPU: "
                        "PyTorch's flex attention has no backward pass there.",
                        "Use backend.attn_implementation=sdpa on the CPU (packed sequences work with it).")


def pick_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def restore_scheduler(scheduler: Any, state: dict[str, Any]) -> None:
    """Load a schedule's position and apply *this* run's schedule at it: a run resumed with another
    ``trainer.total_steps`` (or warm-up) takes its next step at the new schedule's learning rate, not at
    the one the checkpoint recorded."""
    scheduler.load_state_dict(state)
    step = scheduler.last_epoch
    lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


def lr_lambda(spec: RoleSpec):
    warmup, total, kind = spec.warmup_steps, max(spec.total_steps, 1), spec.lr_schedule
    min_ratio = float(spec.min_lr_ratio)

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "linear":
            return min_ratio + (1 - min_ratio) * (1 - progress)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def load_value_model(spec: RoleSpec, dtype: Any, attn_implementation: str) -> Any:
    """A value model: the checkpoint's transformer with a one-output token head.

    From a causal-LM checkpoint the head is new (initialised from ``spec.seed``); from a checkpoint
    saved by a critic (or any one-label token classifier) it is loaded. Dropout on the head is off.
    """
    from transformers import AutoModelForTokenClassification

    from rlx.errors import UserError

    config = hf_config(spec, num_labels=1)
    config.classifier_dropout = 0.0
    try:
        return AutoModelForTokenClassification.from_pretrained(
            spec.model_path, config=config, dtype=dtype, trust_remote_code=spec.trust_remote_code,
            attn_implementation=attn_implementation)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
        raise UserError(f"Cannot build a value model from {spec.model_path!r}: transformers has no "
                        f"token-classification class for its architecture ({type(config).__name__}).",
                        "Give critic.model_path a checkpoint whose architecture has one (e.g. Qwen2, Llama), "
                        "or use an algorithm without a critic (grpo, rloo, reinforce_plus_plus).") from None


def trained_dtype(spec: RoleSpec) -> torch.dtype:
    """The dtype of a trainable role's weights and optimizer states (``model_dtype``)."""
    import torch

    return torch.bfloat16 if spec.forward.model_dtype == "bfloat16" else torch.float32


def forward_micro_batch_size(spec: RoleSpec) -> int:
    """Rows per forward pass without gradients (``log_prob_micro_batch_size``, else the training micro-batch)."""
    size = spec.forward.log_prob_micro_batch_size
    return int(size if size is not None else spec.micro_batch_size)


def with_role_settings(spec: RoleSpec, settings: dict[str, RoleSettings]) -> RoleSpec:
    """``spec`` with its role's settings from the config (``rlx.step.role_settings``) under its own: each
    forward option the spec leaves at its default takes the config's value, and a spec without LoRA the
    config's; so do the Hugging Face config's overrides (``model.override_config``) and a router dtype left at
    auto (``model.router_dtype``)."""
    import dataclasses

    role = settings.get(spec.role)
    if role is None:
        return spec
    return dataclasses.replace(spec, forward=spec.forward.over(role.forward),
                               lora=spec.lora if spec.lora is not None else role.lora,
                               config_overrides=spec.config_overrides or dict(role.config_overrides),
                               router_dtype=role.router_dtype if spec.router_dtype == "auto" else spec.router_dtype)


def hf_config(spec: RoleSpec, **kwargs: Any) -> Any:
    """The Hugging Face config of the role's model (``AutoConfig``, ``kwargs`` passed on) with the spec's
    ``config_overrides`` (``model.override_config``) set on it."""
    from rlx.run.models import load_hf_config

    return load_hf_config(spec.model_path, spec.trust_remote_code, spec.config_overrides, **kwargs)


def settings_of(ctx: BuildContext) -> dict[str, RoleSettings]:
    from rlx.step import role_settings

    return {role: role_settings(ctx.config, role) for role in ("actor", "ref", "critic")}
