"""The ``torch`` training backend: plain PyTorch on one process (CPU or one GPU).

It loads Hugging Face causal LMs, computes per-token log-probs and entropies in micro-batches, and
trains with AdamW, gradient accumulation, global-norm clipping and a warm-up schedule. The FSDP2
backend builds on the same worker, sharding the model across processes.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from rlx import Component, hookimpl
from rlx.config import resolve_dtype
from rlx.context import BuildContext
from rlx.plugins.modeling.checks import CONFIG_PROBLEMS
from rlx.protocols import LossFn, RoleSpec
from rlx.records import LoraSpec, RoleSettings

if TYPE_CHECKING:
    import torch

    from rlx.batch import Batch


MODEL_FILE, OPTIM_FILE = "model.safetensors", "optim.pt"


def rng_file(rank: int) -> str:
    return "rng.pt" if rank == 0 else f"rng_rank{rank}.pt"


class TorchBackendOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = Field(
        "sdpa", description="Attention kernel passed to from_pretrained. Packed sequences: sdpa and eager mask "
        "each sequence off (a block-diagonal mask), flash_attention_2 (flash-attn installed) and flex_attention "
        "(GPU: it has no backward on the CPU) skip the work across sequences.")
    num_threads: int | None = Field(None, gt=0, le=4096, description="torch CPU threads (default: torch's choice).")


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


def _accepts(model: Any, name: str) -> bool:
    """Whether ``model``'s forward takes the keyword ``name`` (checked on the class: a wrapper's forward
    takes ``*args, **kwargs``)."""
    import inspect

    return name in inspect.signature(type(model).forward).parameters


def supports_packing(model: Any) -> bool:
    """Packed rows are kept apart by transformers' attention interface (a block-diagonal mask built from
    restarting position ids, or the varlen kernels of flash-attention); a model on its own attention code
    (remote code of an older design) would attend across the packed sequences."""
    return bool(getattr(model, "_supports_attention_backend", False))


# The attention rlx registers with transformers for packed rows on the sdpa kernel (see packed_sdpa).
PACKED_SDPA = "rlx_packed_sdpa"


def packed_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention over packed sequences without a (tokens x tokens) mask. The sequences of the packed row
    (1, heads, T, d) start where the position ids restart at 0.

    - On a GPU in bf16/fp16 (PyTorch's ``varlen_attn``, torch >= 2.10): the variable-length flash kernel runs
      on the packed tokens themselves, causal within each sequence: no padding, no gather. GQA keys are
      repeated to the query heads only where the wrapper takes no ``enable_gqa`` (torch 2.11 here).
    - Otherwise (the CPU, float32): the row is cut into (sequences, heads, longest, d), each sequence attends
      causally to itself through ``scaled_dot_product_attention`` (``is_causal``), and the valid outputs are
      packed back. Attention then costs what it costs padded; the linear layers still see only the packed
      tokens.

    A call with a mask (padded rows) is transformers' own sdpa."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    layout = kwargs.get(LAYOUT_KWARG)  # found before the model's forward (see with_packed_layout)
    if layout is None:
        layout = _layout_outside_compile()(kwargs.get("position_ids"), type(module).__name__)
    if dropout == 0.0 and varlen_kernel_usable(query):
        return _varlen_attention(query, key, value, layout, scaling), None
    groups = query.shape[1] // key.shape[1]

    def unpacked(x: torch.Tensor, repeat: int) -> torch.Tensor:
        x = x[0][:, layout.index].transpose(0, 1)  # (n, heads, L, d)
        return x.repeat_interleave(repeat, dim=1) if repeat > 1 else x

    out = F.scaled_dot_product_attention(unpacked(query, 1), unpacked(key, groups), unpacked(value, groups),
                                         dropout_p=dropout, scale=scaling, is_causal=True)  # (n, heads, L, d)
    n, heads, longest, d = out.shape
    # The valid positions, gathered by index (a boolean mask would wait for the GPU in every layer).
    out = out.transpose(1, 2).reshape(n * longest, heads, d).index_select(0, layout.valid_flat)
    return out[None], None  # (1, T, heads, d)


class PackedLayout(NamedTuple):
    """Where the sequences of one packed row lie (every layer of a forward pass shares it)."""

    index: torch.Tensor  # (sequences, longest): gather indices into the row, clamped past each sequence's end
    valid_flat: torch.Tensor  # the flat positions of real tokens in (sequences * longest)
    cu_seqlens: torch.Tensor  # (sequences + 1,) int32: where each sequence starts, then the total
    longest: int


_LAYOUT: list[Any] = [None, None]  # the last packed row's position ids and its layout: every layer shares them


def _sequence_layout(position_ids: torch.Tensor | None, where: str) -> PackedLayout:
    """The packed row's layout, computed once per forward pass (one wait for the GPU, not one per layer)."""
    import torch

    from rlx.errors import UserError

    if _LAYOUT[0] is position_ids and position_ids is not None:
        return _LAYOUT[1]
    if position_ids is None or int(position_ids.reshape(-1)[0]) != 0:
        raise UserError(f"{where} does not pass position ids that start at 0 to its attention, so packed "
                        "sequences cannot be told apart.",
                        "Set actor.use_remove_padding=false (and critic.use_remove_padding=false) for this model.")
    positions = position_ids.reshape(-1)
    total = positions.shape[0]
    starts = (positions == 0).nonzero().flatten()
    lengths = torch.diff(starts, append=starts.new_tensor([total]))
    longest = int(lengths.max())
    steps = torch.arange(longest, device=starts.device)
    valid = steps < lengths[:, None]  # (n, L)
    layout = PackedLayout(index=(starts[:, None] + steps).clamp(max=total - 1),
                          valid_flat=valid.flatten().nonzero().flatten(),
                          cu_seqlens=torch.cat([starts, starts.new_tensor([total])]).to(torch.int32),
                          longest=longest)
    _LAYOUT[:] = [position_ids, layout]
    return layout


# What torch.compile's CPU backend (inductor) builds its kernels with; one must be on PATH.
CXX_COMPILERS = ("g++", "c++", "clang++")

# The keyword argument that carries a packed row's layout from the model's forward to packed_sdpa in every
# layer (transformers passes extra keyword arguments down to the attention function).
LAYOUT_KWARG = "rlx_packed_layout"


def with_packed_layout(inputs: dict[str, Any], model: Any) -> dict[str, Any]:
    """``inputs`` plus the packed row's layout, found once before the forward pass, when the model's attention
    is :func:`packed_sdpa`: the layers then look nothing up themselves, so a compiled layer is one graph with
    no break (which gradient checkpointing inside the graph needs)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != PACKED_SDPA or "attention_mask" in inputs:
        return inputs
    return {**inputs, LAYOUT_KWARG: _sequence_layout(inputs["position_ids"], type(model).__name__)}


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
    checkpointing = bool(getattr(hf_model, "is_gradient_checkpointing", False))
    if checkpointing:
        hf_model.gradient_checkpointing_disable()
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


def _layout_outside_compile() -> Any:
    """:func:`_sequence_layout`, run eagerly when a compiled layer calls it (it reads tensor values)."""
    if not _LAYOUT_EAGER:
        import torch

        _LAYOUT_EAGER.append(torch.compiler.disable(_sequence_layout))
    return _LAYOUT_EAGER[0]


_LAYOUT_EAGER: list[Any] = []


def varlen_kernel_usable(query: torch.Tensor) -> bool:
    """PyTorch's variable-length flash attention runs here: a CUDA tensor in bf16 or fp16, torch >= 2.10."""
    import torch

    return query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and _varlen_attn() is not None


_VARLEN: list[Any] = []  # [varlen_attn or None, whether it takes enable_gqa]


def _varlen_attn() -> Any:
    if not _VARLEN:
        try:
            import inspect

            from torch.nn.attention.varlen import varlen_attn
        except ImportError:  # torch < 2.10
            _VARLEN[:] = [None, False]
        else:
            _VARLEN[:] = [varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters]
    return _VARLEN[0]


def _varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: PackedLayout,
                      scaling: float | None) -> torch.Tensor:
    """(1, heads, T, d) in, (1, T, heads, d) out, through ``varlen_attn`` (causal: window (-1, 0))."""
    fn, takes_gqa = _varlen_attn(), _VARLEN[1]
    groups = query.shape[1] // key.shape[1]
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # (T, heads, d)
    options: dict[str, Any] = {}
    if groups > 1:
        if takes_gqa:
            options["enable_gqa"] = True
        else:  # an older wrapper (torch 2.11) without enable_gqa: equal head counts
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = fn(q, k, v, layout.cu_seqlens, layout.cu_seqlens, layout.longest, layout.longest, scale=scaling,
             window_size=(-1, 0), **options)
    return out[None]


def _packed_sdpa_mask(*args: Any, **kwargs: Any) -> Any:
    """No (tokens x tokens) mask for packed rows (:func:`packed_sdpa` cuts them itself); sdpa's mask for
    padded rows."""
    from transformers.masking_utils import sdpa_mask

    if not args and kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(*args, **kwargs)


def use_packed_sdpa(model: Any) -> None:
    """Switch a packing model on the sdpa kernel to :func:`packed_sdpa` (registered with transformers once
    per process). Models with sliding-window layers keep transformers' packed mask, which knows the window."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    config = model.config
    windows = getattr(config, "use_sliding_window", False) or "sliding_attention" in (
        getattr(config, "layer_types", None) or [])
    if config._attn_implementation != "sdpa" or windows:
        return
    AttentionInterface.register(PACKED_SDPA, packed_sdpa)
    AttentionMaskInterface.register(PACKED_SDPA, _packed_sdpa_mask)
    config._attn_implementation = PACKED_SDPA


def fused_head_supported(model: Any) -> bool:
    """The chunked head replaces ``lm_head`` itself; a model that transforms the logits after it (Gemma's
    soft-capping, Cohere's and Granite's scaling) keeps the plain path."""
    config = getattr(model, "config", None)
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is not None and value != 1.0:
            return False
    return model.get_output_embeddings() is not None


# Config fields of models whose forward changes the logits after lm_head.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def model_inputs(batch: Batch, packed: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The model's keyword inputs for ``batch`` and the indices (along the model's sequence axis) of the
    positions whose outputs belong to the response tokens: position ``keep[j]`` predicts response token j
    (padded: j of every row; packed: the j-th valid response token in row order).

    Padded: (b, P+R) with an attention mask. Packed: the valid tokens of every row, prompt then response,
    concatenated into one row (1, T) with position ids restarting at 0 per sequence and no attention mask,
    which transformers reads as packed sequences (attention kept within each one).
    """
    import torch

    prompt_mask, response_mask = batch["prompt_mask"], batch["response_mask"]
    input_ids = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    mask = torch.cat([prompt_mask, response_mask], dim=1)  # (b, P+R)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    p, r = prompt_mask.shape[1], response_mask.shape[1]
    if not packed:
        keep = torch.arange(p - 1, p + r - 1, device=input_ids.device)
        return {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids}, keep
    valid = mask.bool()
    if len(batch) and not bool(prompt_mask.bool().any(-1).all()):
        raise ValueError("a row has no prompt token: its first response token has no position to be predicted from")
    # Index of every valid token in the packed row; a response token is predicted by the token before it,
    # which is in the same sequence because every sequence starts with its prompt.
    packed_index = valid.flatten().cumsum(0).view_as(valid) - 1
    keep = packed_index[:, p:][response_mask.bool()] - 1
    return {"input_ids": input_ids[valid][None], "position_ids": position_ids[valid][None]}, keep


def unpack(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-token values of the valid response tokens (n, ...) in row order -> (b, R, ...), 0 at padding."""
    out = values.new_zeros(tuple(response_mask.shape) + tuple(values.shape[1:]))
    out[response_mask.bool()] = values
    return out


def _head_compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's when it is on (a float32 master model on a GPU),
    else the weight's (bf16 under FSDP's mixed precision or for a frozen bf16 model, float32 on a CPU)."""
    import torch

    kind = weight.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The logits of a chunk of positions, (c, V) in the weight's dtype (the compute dtype)."""
    import torch.nn.functional as F

    return F.linear(hidden.to(weight.dtype), weight, bias)


def _logit_stats(z: torch.Tensor, targets: torch.Tensor, temperature: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-sum-exp, the target's log-prob and the entropy (c,) float32, from a chunk's logits (c, V) in the
    compute dtype, divided by ``temperature``. With m the row maximum, s = sum exp(x - m) and
    t = sum exp(x - m) * (x - m): log-sum-exp = m + log s, log-prob = (x_y - m) - log s, entropy =
    log s - t / s (no cancellation between large numbers). Eager, two float32 (c, V) buffers at a time;
    compiled, two passes over ``z``."""
    x = z.float()
    if temperature != 1.0:
        x.div_(temperature)
    m = x.amax(-1, keepdim=True)
    d = x.sub_(m)
    chosen = d.gather(-1, targets[:, None]).squeeze(-1)
    e = d.exp()
    s = e.sum(-1)
    t = e.mul_(d).sum(-1)
    log_s = s.log()
    return m.squeeze(-1) + log_s, chosen - log_s, log_s - t / s


def _logit_grads(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                 grad_lp: torch.Tensor | None, grad_ent: torch.Tensor | None, temperature: float,
                 fused: bool) -> torch.Tensor:
    """The gradient (c, V) for a chunk's logits ``z`` (compute dtype, before the temperature), from the
    gradients of its log-probs and entropies: with x = z / temperature and p = softmax(x),
    d logp_y / dx = onehot(y) - p and d H / dx = -p * (log p + H). ``fused`` (compiled, one pass over ``z``):
    the one-hot term as a comparison with the column index; eager: a scatter into the float32 buffer."""
    import torch

    logp = z.float()
    if temperature != 1.0:
        logp.div_(temperature)
    logp.sub_(lse[:, None])
    p = logp.exp()
    if grad_ent is not None:  # p * (g_lp + g_ent * (log p + H)), in logp's buffer
        coef = logp.add_(entropy[:, None]).mul_(grad_ent[:, None])
        if grad_lp is not None:
            coef.add_(grad_lp[:, None])
        dx = p.mul_(coef)
    else:
        assert grad_lp is not None
        dx = p.mul_(grad_lp[:, None])
    if grad_lp is None:
        dx = dx.neg_()
    elif fused:
        cols = torch.arange(z.shape[-1], device=z.device)
        dx = torch.where(cols == targets[:, None], grad_lp[:, None] - dx, -dx)
    else:
        dx = dx.neg_().scatter_add_(-1, targets[:, None], grad_lp[:, None])
    if temperature != 1.0:
        dx = dx.div_(temperature)
    return dx.to(z.dtype)


@functools.cache
def _head_fns(compiled: bool) -> tuple[Any, Any]:
    """The chunked head's two per-chunk element-wise functions, eager or compiled (``torch.compile``, made
    once per process; shapes dynamic after the first change: the last chunk is shorter). Compiled, each is
    one or two passes over the chunk's compute-dtype logits instead of a pass per operation."""
    grads = functools.partial(_logit_grads, fused=compiled)
    if not compiled:
        return _logit_stats, grads
    import torch

    return torch.compile(_logit_stats), torch.compile(grads)


def _make_chunked_head() -> type:
    import torch

    class ChunkedHead(torch.autograd.Function):
        """The chosen tokens' log-probs and the entropies from ``lm_head``, ``chunk`` positions at a time.

        Forward keeps only per-position numbers (log-sum-exp, entropy); backward recomputes each chunk's
        logits and turns them into gradients for the hidden states and the head's weight at once, so no
        (positions x vocabulary) tensor outlives its chunk, in either direction.
        """

        @staticmethod
        def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    targets: torch.Tensor, temperature: float, chunk: int, compiled: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
            ctx.set_materialize_grads(False)
            dtype = _head_compute_dtype(weight)
            w = weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            stats, _ = _head_fns(compiled)
            n = hidden.shape[0]
            log_probs = hidden.new_empty(n, dtype=torch.float32)
            entropy, lse = torch.empty_like(log_probs), torch.empty_like(log_probs)
            for s in range(0, n, chunk):
                z = _chunk_logits(hidden[s:s + chunk], w, b)  # (c, V) in the compute dtype
                lse[s:s + chunk], log_probs[s:s + chunk], entropy[s:s + chunk] = stats(
                    z, targets[s:s + chunk], temperature)
            ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
            ctx.dtype, ctx.temperature, ctx.chunk, ctx.compiled = dtype, temperature, chunk, compiled
            return log_probs, entropy

        @staticmethod
        def backward(ctx: Any, grad_lp: torch.Tensor | None, grad_ent: torch.Tensor | None) -> tuple[Any, ...]:
            hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
            need_h, need_w, need_b = ctx.needs_input_grad[:3]
            if grad_lp is None and grad_ent is None:
                return (None,) * 7
            _, grads = _head_fns(ctx.compiled)
            w = weight.to(ctx.dtype)
            b = bias.to(ctx.dtype) if bias is not None else None
            d_hidden = torch.empty_like(hidden) if need_h else None
            d_weight: torch.Tensor | None = None  # float32 sums over the chunks
            d_bias: torch.Tensor | None = None
            for s in range(0, hidden.shape[0], ctx.chunk):
                h, part = hidden[s:s + ctx.chunk], slice(s, s + ctx.chunk)
                dz = grads(_chunk_logits(h, w, b), targets[part], lse[part], entropy[part],
                           grad_lp[part] if grad_lp is not None else None,
                           grad_ent[part] if grad_ent is not None else None, ctx.temperature)
                if d_hidden is not None:
                    d_hidden[part] = (dz @ w).to(hidden.dtype)
                if need_w:
                    dw = (dz.t() @ h.to(ctx.dtype)).float()
                    d_weight = dw if d_weight is None else d_weight.add_(dw)
                if need_b and bias is not None:
                    db = dz.float().sum(0)
                    d_bias = db if d_bias is None else d_bias.add_(db)
            return (d_hidden, d_weight.to(weight.dtype) if d_weight is not None else None,
                    d_bias.to(bias.dtype) if d_bias is not None else None, None, None, None, None)

    return ChunkedHead


_CHUNKED_HEAD: Any = None


def chunked_head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                 temperature: float, chunk: int, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` and entropies (n,), float32, from hidden states (n, H) and a head (V, H):
    logits are formed ``chunk`` positions at a time in the compute dtype, reduced in float32. ``compiled``:
    the per-chunk element-wise work runs as compiled kernels (see :func:`_head_fns`)."""
    global _CHUNKED_HEAD
    if _CHUNKED_HEAD is None:
        _CHUNKED_HEAD = _make_chunked_head()
    return _CHUNKED_HEAD.apply(hidden, weight, bias, targets, temperature, chunk, compiled)


@contextlib.contextmanager
def _head_replaced(head: Any, targets: torch.Tensor, temperature: float, chunk: int,
                   compiled: bool = False) -> Iterator[None]:
    """While inside, ``head`` (the model's ``lm_head``) computes no logits: its output is
    :func:`chunked_head`'s log-probs and entropies stacked on the last axis, (..., 2), which the model
    returns as its ``logits``. Both run inside the model's own forward, where FSDP has gathered the head's
    weight, and the result is the model's output, on which FSDP hooks the gathering for backward."""
    import torch

    inputs: list[torch.Tensor] = []

    def before(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        inputs.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    def after(module: Any, args: tuple[Any, ...], output: Any) -> torch.Tensor:
        hidden = inputs.pop()
        lp, ent = chunked_head(hidden.reshape(-1, hidden.shape[-1]), module.weight, module.bias,
                               targets.reshape(-1), temperature, chunk, compiled)
        return torch.stack([lp, ent], dim=-1).view(*hidden.shape[:-1], 2)

    handles = [head.register_forward_pre_hook(before), head.register_forward_hook(after)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def response_log_probs(model: Any, batch: Batch, temperature: float, with_entropy: bool,
                       entropy_grad: bool = True, *, packed: bool = False, chunk_size: int = 0,
                       compile_head: bool = False, hf_model: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (b, R) of the response tokens under ``model`` (logits divided by temperature), 0 at padding.

    Only the positions that predict response tokens reach the head. ``packed``: the rows go through the
    model as one packed row (see :func:`model_inputs`). ``chunk_size`` > 0: log-probs and entropies come
    from :func:`chunked_head` (no float32 copy of the (positions x vocabulary) logits); 0: from the
    logits in float32; ``compile_head``: the chunked head's element-wise work compiled. ``hf_model`` is
    the Hugging Face model when ``model`` wraps it (FSDP1).
    With ``entropy_grad=False`` the entropy is only a metric: it is kept out of the autograd graph.
    """
    import torch

    from rlx.plugins.modeling.logits import entropy_from_logits, log_probs_from_logits

    hf = model if hf_model is None else hf_model
    mask = batch["response_mask"].bool()
    inputs, keep = model_inputs(batch, packed)
    inputs = with_packed_layout(inputs, hf)
    targets = batch["responses"][mask][None] if packed else batch["responses"]  # (1, n) or (b, R)
    keep_kwarg = _accepts(hf, "logits_to_keep")
    if keep_kwarg:
        inputs["logits_to_keep"] = keep
    entropy: torch.Tensor | None
    if chunk_size and keep_kwarg and fused_head_supported(hf):
        with _head_replaced(hf.get_output_embeddings(), targets, temperature or 1.0, chunk_size, compile_head):
            both = model(**inputs, use_cache=False).logits  # (b, R, 2) or (1, n, 2)
        log_probs, entropy = both[..., 0], both[..., 1]
        if not with_entropy:
            entropy = None
        elif not entropy_grad:
            entropy = entropy.detach()
    else:
        logits = model(**inputs, use_cache=False).logits
        logits = (logits if keep_kwarg else logits[:, keep]).float()  # (b, R, V) or (1, n, V)
        if temperature and temperature != 1.0:
            logits = logits / temperature
        log_probs = log_probs_from_logits(logits, targets)
        entropy = None
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
    return _per_row(log_probs, mask, packed), (_per_row(entropy, mask, packed) if entropy is not None else None)


def _per_row(values: torch.Tensor, mask: torch.Tensor, packed: bool) -> torch.Tensor:
    """(b, R) with 0 at padding, from the padded (b, R) or packed (1, n) outputs."""
    import torch

    if packed:
        return unpack(values[0], mask)
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def response_values(model: Any, batch: Batch, *, packed: bool = False) -> torch.Tensor:
    """Values (b, R) of a value model; values[:, t] scores the state before response token t.
    Padding is 0."""
    inputs, keep = model_inputs(batch, packed)
    values = model(**with_packed_layout(inputs, model), use_cache=False).logits[:, keep].squeeze(-1)
    return _per_row(values, batch["response_mask"].bool(), packed)


def load_value_model(spec: RoleSpec, dtype: Any, attn_implementation: str) -> Any:
    """A value model: the checkpoint's transformer with a one-output token head.

    From a causal-LM checkpoint the head is new (initialised from ``spec.seed``); from a checkpoint
    saved by a critic (or any one-label token classifier) it is loaded. Dropout on the head is off.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    from rlx.errors import UserError

    config = AutoConfig.from_pretrained(spec.model_path, trust_remote_code=spec.trust_remote_code, num_labels=1)
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


class TorchWorker:
    """One role's model on one device."""

    # ``RoleSpec.lora`` (rlx.plugins.modeling.lora.settings) when the model carries peft adapters.
    lora: LoraSpec | None = None

    def __init__(self, spec: RoleSpec, options: TorchBackendOptions, device: str = "auto", rank: int = 0,
                 world_size: int = 1) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if options.num_threads:
            torch.set_num_threads(options.num_threads)
        self.spec, self.options = spec, options
        self.device = pick_device(device)
        # Under several processes (the launcher's --nproc) every rank holds the whole model and the
        # gradients are summed over ranks before each step: plain replicated data parallelism.
        self.rank, self.dp_size = rank, world_size
        check_attention(options.attn_implementation, self.device, spec)
        torch.manual_seed(spec.seed)
        self.lora = spec.lora
        # Mixed precision (model_dtype=float32, the default): a trainable role keeps float32 master weights
        # (AdamW on bf16 weights loses small updates) and runs its forward passes under autocast in
        # model.dtype on a GPU. model_dtype=bfloat16: weights, gradients and AdamW moments in bf16, no
        # autocast (half the memory). A frozen role (the reference), and the frozen base under LoRA, is
        # simply loaded in the compute dtype.
        master = trained_dtype(spec)
        self.compute_dtype = master if master == torch.bfloat16 else getattr(
            torch, resolve_dtype(spec.dtype, self.device))
        dtype = master if spec.trainable and self.lora is None else self.compute_dtype
        if spec.value_head:
            base = load_value_model(spec, dtype, options.attn_implementation)
        else:
            base = AutoModelForCausalLM.from_pretrained(
                spec.model_path, dtype=dtype, trust_remote_code=spec.trust_remote_code,
                attn_implementation=options.attn_implementation)
        if self.lora is not None:
            from rlx.plugins.modeling import lora

            base = lora.apply(base, self.lora, value_head=spec.value_head, adapter_dtype=master)
        self.model = base.to(self.device)
        self.autocast = (spec.trainable and self.device != "cpu" and master == torch.float32
                         and self.compute_dtype != torch.float32)
        hf_model = self.model.get_base_model() if self.lora is not None else self.model
        if spec.trainable and spec.gradient_checkpointing:
            hf_model.gradient_checkpointing_enable()
            if self.lora is not None:  # the frozen embeddings' output must carry gradients into the layers
                hf_model.enable_input_require_grads()
        self._set_up_forward(hf_model)
        self._set_up_optimizer()

    def _set_up_forward(self, hf_model: Any) -> None:
        """How this role's forward passes run (``spec.forward``, see ``rlx.step.role_settings``): packed
        rows, the chunked head, and micro-batches cut by a token budget."""
        forward = self.spec.forward
        self.hf_model = hf_model
        self.packed = bool(forward.use_remove_padding) and supports_packing(hf_model)
        if self.packed:
            use_packed_sdpa(hf_model)
        # use_torch_compile: the decoder layers, and the chunked head's element-wise work
        self.compile_head = bool(forward.use_torch_compile)
        if self.compile_head:
            compile_decoder_layers(hf_model, self.spec.role)
        self.chunk_size = int(forward.log_prob_chunk_size)
        self.update_budget, self.forward_budget = forward.update_budget, forward.forward_budget

    def _set_up_optimizer(self) -> None:
        """AdamW and the learning-rate schedule for a trainable role; a frozen one gets no gradients."""
        import torch

        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        if self.spec.trainable:
            self.model.train()
            # Under LoRA only the adapters require gradients: AdamW holds state for them alone.
            params = [p for p in self.model.parameters() if p.requires_grad]
            # On a GPU, the fused kernel: one launch per step, not several per parameter group.
            fused = bool(params) and all(p.is_cuda for p in params)
            self.optimizer = torch.optim.AdamW(params, lr=self.spec.lr, betas=self.spec.betas,
                                               weight_decay=self.spec.weight_decay, fused=fused or None)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(self.spec))
        else:
            self.model.eval()
            self.model.requires_grad_(False)

    def _precision(self) -> Any:
        """Autocast to model.dtype around forward passes of a float32-master model on a GPU."""
        import contextlib

        import torch

        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(self.device).type, dtype=self.compute_dtype)

    # -- the engine primitives rlx.step's shared loops use ---------------------------------
    def to_device(self, micro: Batch) -> Batch:
        return micro.to(self.device)

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        if self.dp_size == 1:
            return list(values)
        import torch
        import torch.distributed as dist

        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return t.tolist()

    def forward(self, micro: Batch, *, grad: bool, entropy_grad: bool = True) -> dict[str, torch.Tensor]:
        import contextlib

        import torch

        with self._precision(), (contextlib.nullcontext() if grad else torch.no_grad()):
            if self.spec.value_head:
                return {"values": self._values(micro)}
            return self._log_probs(micro, float(micro.meta.get("temperature", 1.0)), True, entropy_grad)

    def _values(self, micro: Batch) -> torch.Tensor:
        return response_values(self.model, micro, packed=self.packed).float()

    def _log_probs(self, micro: Batch, temperature: float, with_entropy: bool,
                   entropy_grad: bool = True) -> dict[str, torch.Tensor]:
        log_probs, entropy = response_log_probs(
            self.model, micro, temperature, with_entropy, entropy_grad, packed=self.packed,
            chunk_size=self.chunk_size, compile_head=self.compile_head, hf_model=self.hf_model)
        out = {"log_probs": log_probs}
        if entropy is not None:
            out["entropy"] = entropy
        return out

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def zero_grad(self) -> None:
        assert self.optimizer is not None, f"role {self.spec.role} is not trainable"
        self.optimizer.zero_grad(set_to_none=True)

    def clip_gradients(self) -> torch.Tensor:
        """Sum the gradients over data-parallel ranks (each rank's loss is its share of the global
        mini-batch loss) and clip them to the global norm; return that norm."""
        import torch

        if self.dp_size > 1:
            import torch.distributed as dist

            for param in self.model.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad)
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.grad_clip)

    def optimizer_step(self) -> tuple[float, bool, float]:
        import torch

        assert self.optimizer is not None
        grad_norm = self.clip_gradients()
        applied = bool(torch.isfinite(grad_norm))
        if applied:
            self.optimizer.step()
        else:  # a bad batch must not poison the weights: skip the update and report it
            self.optimizer.zero_grad(set_to_none=True)
        lr = float(self.scheduler.get_last_lr()[0])
        self.scheduler.step()
        return float(grad_norm), applied, lr

    # -- inference --------------------------------------------------------------------------
    def _forward_no_grad(self, batch: Batch, fn: Any) -> Batch:
        """``fn(micro_batch) -> {name: (b, ...) tensor}`` over the batch in micro-batches (rows or a token
        budget), without gradients, in eval mode; the outputs in the batch's row order, on the CPU.

        Eval mode: a model configured with dropout must still score each token deterministically.
        """
        import torch

        from rlx.batch import Batch
        from rlx.step import run_forward

        size = forward_micro_batch_size(self.spec)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self._precision():
                return Batch(run_forward(self, batch, size, lambda mb: {k: v.cpu() for k, v in fn(mb).items()},
                                         budget=self.forward_budget))
        finally:
            self.model.train(was_training)

    def compute_values(self, batch: Batch) -> Batch:
        """Critic values (B, R) of the states before each response token; 0 at padding."""
        assert self.spec.value_head, f"role {self.spec.role} has no value head"
        return self._forward_no_grad(batch, lambda mb: {"values": self._values(mb)})

    def compute_log_probs(self, batch: Batch, with_entropy: bool = False) -> Batch:
        assert not self.spec.value_head, f"role {self.spec.role} is a value model"
        temperature = float(batch.meta.get("temperature", 1.0))
        return self._forward_no_grad(batch, lambda mb: self._log_probs(mb, temperature, with_entropy))

    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        """The reference policy's log-probs under LoRA: this model with its adapter switched off (the
        untouched base), instead of a second copy of the base in a reference worker."""
        assert self.lora is not None, f"role {self.spec.role} has no LoRA adapter to switch off"
        with self.model.disable_adapter():
            return self.compute_log_probs(batch)

    # -- training ---------------------------------------------------------------------------
    def update(self, minibatches: list[Batch], loss_fn: LossFn) -> list[dict[str, float]]:
        """One optimizer step per mini-batch (``rlx.step.run_update``)."""
        from rlx.step import run_update

        self.model.train()
        return run_update(self, minibatches, loss_fn, self.spec.micro_batch_size, budget=self.update_budget)

    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over ``batch`` (a mini-batch), accumulating over micro-batches."""
        return self.update([batch], loss_fn)[0]

    # -- weights and checkpoints ------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.lora is not None:  # base + adapter, merged tensor by tensor under the base's names
            from rlx.plugins.modeling.lora import merged_weights, scale_of

            yield from merged_weights(self.model, scale_of(self.lora))
            return
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def save_checkpoint(self, path: str) -> None:
        """Model weights as safetensors; optimizer, scheduler and RNG states as tensor files that load
        with ``weights_only=True`` (no pickled objects), so resuming never runs code from a file."""
        import torch
        from safetensors.torch import save_model

        os.makedirs(path, exist_ok=True)
        if self.rank == 0:  # the replicas are identical; each rank keeps its own random state
            if self.lora is not None:  # the base is re-loaded from model.path: only the adapters are saved
                from safetensors.torch import save_file

                from rlx.plugins.modeling.lora import ADAPTER_FILE, trainable_state

                save_file(trainable_state(self.model), os.path.join(path, ADAPTER_FILE))
            else:
                save_model(self.model, os.path.join(path, MODEL_FILE))
            if self.optimizer is not None:
                torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                           os.path.join(path, OPTIM_FILE))
        torch.save({"cpu": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
                   os.path.join(path, rng_file(self.rank)))

    def load_checkpoint(self, path: str) -> None:
        import torch

        from rlx.errors import UserError
        from rlx.plugins.modeling.lora import ADAPTER_FILE
        from rlx.run.checkpoint import torch_load

        weights = os.path.join(path, MODEL_FILE)
        adapter = os.path.join(path, ADAPTER_FILE)
        if (self.lora is not None) != os.path.exists(adapter):
            written = "with LoRA adapters" if os.path.exists(adapter) else "without LoRA (all weights)"
            raise UserError(f"{path} was written {written}, but this run has model.lora_rank="
                            f"{self.lora.rank if self.lora else 0}.",
                            "Resume (or export) with the model.lora_* settings the run was started with.")
        if self.lora is not None:
            from safetensors import SafetensorError
            from safetensors.torch import load_file

            from rlx.plugins.modeling.lora import load_trainable

            try:
                state = load_file(adapter, device=str(self.device))
            except (SafetensorError, OSError, RuntimeError) as exc:
                raise UserError(f"Cannot load {adapter}: {exc}",
                                "The checkpoint is damaged; resume from another checkpoint.") from None
            load_trainable(self.model, state, adapter)
        elif os.path.exists(weights):
            from safetensors import SafetensorError
            from safetensors.torch import load_model

            try:
                missing, unexpected = load_model(self.model, weights, strict=False, device=str(self.device))
            except (SafetensorError, OSError, RuntimeError) as exc:
                raise UserError(f"Cannot load {weights}: {exc}",
                                "The checkpoint is damaged or belongs to another model; resume from "
                                "another checkpoint.") from None
            if missing or unexpected:
                raise UserError(f"{weights} does not match the {self.spec.role} model: missing "
                                f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}.",
                                "Resume with the model the run was started with.")
        else:  # written by rlx 0.1.0
            self.model.load_state_dict(torch_load(os.path.join(path, "model.pt"), map_location=self.device))
        if self.optimizer is not None:
            optim_path = os.path.join(path, OPTIM_FILE)
            if not os.path.exists(optim_path):
                raise UserError(f"{optim_path} is missing: the {self.spec.role}'s optimizer state cannot be "
                                "restored, and resuming with a fresh optimizer would silently change training.",
                                "Resume from another checkpoint, or start a new run from the exported model.")
            state = torch_load(optim_path, map_location=self.device)
            self.optimizer.load_state_dict(state["optimizer"])
            restore_scheduler(self.scheduler, state["scheduler"])
        rng_path = os.path.join(path, rng_file(self.rank))
        if not os.path.exists(rng_path) and self.rank > 0:  # resumed with more processes than were saved
            torch.manual_seed(self.spec.seed + self.rank)
            return
        rng = torch_load(rng_path)
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])

    def save_pretrained(self, path: str, tokenizer: Any = None) -> None:
        """A Hugging Face model folder; under LoRA the merged weights (the model itself stays unmerged)."""
        if self.rank != 0:
            return
        if self.lora is not None:
            self.model.get_base_model().save_pretrained(path, state_dict=dict(self.named_weights()))
        else:
            self.model.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)

    def save_adapter(self, path: str, tokenizer: Any = None) -> None:
        """The LoRA adapter as a peft folder (adapter_config.json, adapter_model.safetensors) that
        ``PeftModel.from_pretrained(base, path)`` loads onto the base model."""
        from rlx.errors import UserError

        if self.lora is None:
            raise UserError(f"The {self.spec.role} has no LoRA adapter (the run trained every weight).",
                            "Export the merged model instead (without --adapter-only).")
        if self.rank != 0:
            return
        self.model.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)


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
    config's."""
    import dataclasses

    role = settings.get(spec.role)
    if role is None:
        return spec
    return dataclasses.replace(spec, forward=spec.forward.over(role.forward),
                               lora=spec.lora if spec.lora is not None else role.lora)


def settings_of(ctx: BuildContext) -> dict[str, RoleSettings]:
    from rlx.step import role_settings

    return {role: role_settings(ctx.config, role) for role in ("actor", "ref", "critic")}


class TorchBackend:
    """Builds :class:`TorchWorker` s for roles; picklable so process launchers can ship it."""

    def __init__(self, options: TorchBackendOptions, device: str,
                 settings: dict[str, RoleSettings] | None = None) -> None:
        self.options, self.device, self.settings = options, device, settings or {}

    def worker(self, spec: RoleSpec, rank: int = 0, world_size: int = 1) -> TorchWorker:
        return TorchWorker(with_role_settings(spec, self.settings), self.options, self.device, rank, world_size)


def build(options: TorchBackendOptions | None, ctx: BuildContext) -> TorchBackend:
    device = ctx.config.trainer.device if ctx.config is not None else "auto"
    return TorchBackend(options or TorchBackendOptions(), device, settings_of(ctx))


@hookimpl
def rlx_train_backends() -> list[Component]:
    return [Component(kind="backend", name="torch", factory=build, config_model=TorchBackendOptions,
                      extra=CONFIG_PROBLEMS,
                      summary="Plain PyTorch on one process (CPU or one GPU); AdamW, grad accumulation.")]
