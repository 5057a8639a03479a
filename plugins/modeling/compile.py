"""``use_torch_compile``: each decoder layer compiled in place with dynamic shapes (a C++ compiler is needed on
the CPU), gradient checkpointing kept outside the compiled graph.
"""

from __future__ import annotations

import functools
import shutil
from typing import Any

from rlx.plugins.modeling import checkpointing as activation_checkpointing

# What torch.compile's CPU backend (inductor) builds its kernels with; one must be on PATH.
CXX_COMPILERS = ("g++", "c++", "clang++")


def compile_decoder_layers(hf_model: Any, role: str = "actor") -> int:
    """``torch.compile`` each decoder layer (the transformer blocks of ``base_model.layers``) in place, with
    dynamic shapes (packed rows change length every micro-batch). The layers share one compiled graph; the
    packed layout comes in as an argument (:func:`with_packed_layout`). Returns how many layers were compiled.

    Gradient checkpointing moves inside the graph: ``torch.utils.checkpoint`` switches compilation off for
    everything it runs, so transformers' checkpointing (which wraps each layer's call) would leave the
    compiled layers eager in every training pass. Instead each layer's forward checkpoints itself
    (non-reentrant), and the compiler records it as a recomputed region of the layer's graph."""
    import torch

    from rlx.errors import UserError

    section = "critic" if role == "critic" else "actor"
    layers = getattr(getattr(hf_model, "base_model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise UserError(f"{section}.use_torch_compile=true compiles the decoder layers, and "
                        f"{type(hf_model).__name__} keeps none in base_model.layers.",
                        f"Set {section}.use_torch_compile=false for this model.")
    on_cpu = next(hf_model.parameters()).device.type == "cpu"
    if on_cpu and not any(shutil.which(c) for c in CXX_COMPILERS):
        raise UserError(f"{section}.use_torch_compile=true on the CPU needs a C++ compiler (torch.compile builds "
                        f"its CPU kernels with one), and none of {', '.join(CXX_COMPILERS)} is on PATH.",
                        f"Install g++ (e.g. apt-get install g++), or set {section}.use_torch_compile=false.")
    checkpointing = activation_checkpointing.is_on(hf_model)
    if checkpointing:
        activation_checkpointing.disable(hf_model)
    for layer in layers:
        if checkpointing:
            layer.forward = _checkpointed(layer.forward)
        layer.compile(dynamic=True)
    return len(layers)


def _checkpointed(forward: Any) -> Any:
    """``forward`` recomputed in the backward pass when gradients are on (non-reentrant checkpointing)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    return run
