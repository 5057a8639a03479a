"""Packed rows: a micro-batch's sequences in one row without padding (``use_remove_padding``), the layout of
that row (where each sequence starts), and the attention that respects it (``packed_sdpa``, registered with
transformers: PyTorch's varlen flash attention on a GPU in bf16, attention per sequence otherwise, never a
tokens x tokens mask). Used by the torch-based backends' forward passes and by Ulysses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

    from rlx.batch import Batch


def _accepts(model: Any, name: str) -> bool:
    """Whether ``model``'s forward takes the keyword ``name`` (checked on the class: a wrapper's forward
    takes ``*args, **kwargs``)."""
    import inspect

    return name in inspect.signature(type(model).forward).parameters


def supports_packing(model: Any) -> bool:
    """Packed rows are kept apart by transformers' attention interface (a block-diagonal mask built from
    restarting position ids, or the varlen kernels of flash-attention); a model on its own attention code
    (remote code of an older design) would attend across the packed sequences. A vision-language model's rows stay
    padded: its vision tower's attention would take the packed layout for its own, and its multimodal rotary
    positions are per padded row (rlx.plugins.modeling.vision)."""
    from rlx.plugins.modeling.vision import is_vision_config

    if is_vision_config(getattr(model, "config", None)):
        return False
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
