"""Activation checkpointing switched through the name the installed transformers knows, with no warning."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from rlx.plugins.modeling import checkpointing


def test_enable_and_disable_on_a_real_model_without_warnings(tiny_model_path: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not checkpointing.is_on(model)
        checkpointing.enable(model, {"use_reentrant": False})
        assert checkpointing.is_on(model)
        model.train()
        ids = torch.tensor([[1, 2, 3, 4]])
        model(input_ids=ids).logits.sum().backward()  # the recomputed layers run and give gradients
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        checkpointing.disable(model)
        assert not checkpointing.is_on(model)


class _OldTransformersModel:
    """The surface of transformers before 5.25: only the gradient_checkpointing_* names."""

    def __init__(self) -> None:
        self.is_gradient_checkpointing = False
        self.kwargs: Any = None

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: Any = None) -> None:
        self.is_gradient_checkpointing, self.kwargs = True, gradient_checkpointing_kwargs

    def gradient_checkpointing_disable(self) -> None:
        self.is_gradient_checkpointing = False


def test_older_transformers_names_are_used_where_the_new_ones_are_missing() -> None:
    model = _OldTransformersModel()
    checkpointing.enable(model, {"use_reentrant": False})
    assert checkpointing.is_on(model) and model.kwargs == {"use_reentrant": False}
    checkpointing.disable(model)
    assert not checkpointing.is_on(model)
    assert not checkpointing.is_on(object())
