"""Activation checkpointing on a transformers model, under the name its version knows.

transformers 5.25 renamed ``gradient_checkpointing_enable``/``_disable``/``is_gradient_checkpointing`` to
``activation_checkpointing_*`` and keeps the old names as deprecated aliases (a FutureWarning at each call,
removal in v6). Older versions, still on the GPU machine's image, have only the old names.
"""

from __future__ import annotations

from typing import Any


def enable(model: Any, checkpoint_kwargs: dict[str, Any] | None = None) -> None:
    """Recompute each decoder layer's activations in the backward pass (``checkpoint_kwargs`` go to
    ``torch.utils.checkpoint.checkpoint``)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)


def disable(model: Any) -> None:
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def is_on(model: Any) -> bool:
    """Whether ``model`` recomputes its layers' activations (False for a model without either attribute)."""
    if hasattr(model, "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))
