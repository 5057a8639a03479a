"""Mixture-of-experts routers in float32 (``model.router_dtype=float32``, megatron-core's
``moe_router_dtype=fp32``): the gate's logits, its softmax and its top-k choice computed in float32 while the
rest of the model (the experts included) keeps its dtype.

The Hugging Face routers of Qwen2-MoE, Qwen3-MoE, Mixtral and Qwen3-VL-MoE multiply the hidden states by the
gate's weight in the model's dtype (bf16 on a GPU, and under autocast in autocast's dtype), so two experts whose
scores nearly tie can swap. :func:`apply_router_dtype` replaces the forward of each such router (found by class)
with one that casts its input and its weight to float32 inside the forward: under FSDP2 the weight is the
gathered full weight there, and under autocast the product stays in float32. The routing weights handed to the
experts are float32 (Mixtral's router returns float32 weights already); the experts multiply their bf16 outputs
by them and add the result in their own dtype, as transformers' expert kernels do.
"""

from __future__ import annotations

import logging
import types
import warnings
from typing import TYPE_CHECKING, Any

from rlx.errors import UserError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("rlx.modeling")

# Router classes of transformers 5 (by class name; the class FSDP2 makes of a sharded module keeps the name in its
# MRO) -> whether the top-k weights are always renormalised to sum to one (None: by the router's norm_topk_prob).
ROUTERS: dict[str, bool | None] = {
    "Qwen2MoeTopKRouter": None,
    "Qwen3MoeTopKRouter": None,
    "MixtralTopKRouter": True,
    "Qwen3VLMoeTextTopKRouter": True,
}
# Routers that compute their logits in float32 on their own (they cast the input and the weight themselves).
FLOAT32_ROUTERS = ("DeepseekV3TopkRouter",)
_MARK = "_rlx_router_dtype"
# The Hugging Face config attributes that count a mixture-of-experts model's routed experts.
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def expert_count(config: Any) -> int:
    """How many routed experts the Hugging Face ``config`` (or its text model's config) names; 0 for a dense
    model."""
    for part in (config, getattr(config, "text_config", None)):
        for name in _EXPERT_COUNTS:
            value = getattr(part, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
            if isinstance(value, list | tuple) and any(isinstance(v, int) and v > 0 for v in value):
                return max(int(v) for v in value)
    return 0


def router_kind(module: Any) -> str | None:
    """The name of ``module``'s router class (in :data:`ROUTERS` or :data:`FLOAT32_ROUTERS`), or None when it
    is no router rlx knows."""
    for cls in type(module).__mro__:
        if cls.__name__ in ROUTERS or cls.__name__ in FLOAT32_ROUTERS:
            return cls.__name__
    return None


def _float32_forward(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's forward (logits, top-k weights, top-k expert indices) with the gate's matmul, softmax and
    top-k in float32."""
    import torch
    import torch.nn.functional as F

    normalise = getattr(self, _MARK)
    if normalise is None:
        normalise = bool(self.norm_topk_prob)
    with torch.autocast(device_type=hidden_states.device.type, enabled=False):
        x = hidden_states.reshape(-1, self.hidden_dim).to(torch.float32)
        logits = F.linear(x, self.weight.to(torch.float32))  # (tokens, experts)
        probs = torch.softmax(logits, dim=-1)
        top, indices = torch.topk(probs, self.top_k, dim=-1)
        if normalise:
            top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, indices


def apply_router_dtype(model: Any, router_dtype: str, where: str = "the model") -> int:
    """Make ``model``'s mixture-of-experts routers compute in ``router_dtype`` (``model.router_dtype``): auto
    leaves them as they are; float32 patches each router of :data:`ROUTERS` (once: applying it again changes
    nothing). Returns how many routers compute in float32 now (the ones of :data:`FLOAT32_ROUTERS` counted, left
    as they are). A dense model is left alone, with a warning; a mixture-of-experts model whose router class
    rlx does not know is a :class:`UserError` (its router would stay in the model's dtype)."""
    if router_dtype == "auto":
        return 0
    if router_dtype != "float32":
        raise ValueError(f"model.router_dtype is auto or float32, not {router_dtype!r}")
    patched = already = 0
    for module in model.modules():
        kind = router_kind(module)
        if kind is None:
            continue
        if kind in FLOAT32_ROUTERS:
            already += 1
            continue
        if not hasattr(module, _MARK):
            setattr(module, _MARK, ROUTERS[kind])
            module.forward = types.MethodType(_float32_forward, module)
        patched += 1
    if patched + already == 0 and expert_count(getattr(model, "config", None)):
        raise UserError(f"model.router_dtype=float32: {where} ({type(model).__name__}) has experts, but rlx knows "
                        "no router class of it (it computes the routers of Qwen2-MoE, Qwen3-MoE, Mixtral and "
                        "Qwen3-VL-MoE in float32; DeepSeek-V3's computes in float32 already).",
                        "Set model.router_dtype=auto (the router in the model's dtype).")
    if patched + already == 0:
        # one warning for every role's model (the same text): the option is harmless here, only moot
        warnings.warn("model.router_dtype=float32: the model has no mixture-of-experts router (a dense model), so "
                      "nothing changes", UserWarning, stacklevel=2)
    log.info("model.router_dtype=float32: %d routers of %s compute in float32 (%d of them on their own)",
             patched + already, where, already)
    return patched + already
