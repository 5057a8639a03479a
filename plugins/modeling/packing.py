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

    Shared prompts (``layout.expand``, :func:`shared_prompt_inputs`): the sequences are those of the
    expanded row, each a prompt and one of its responses.

    A call with a mask (padded rows) is transformers' own sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    layout = kwargs.get(LAYOUT_KWARG)  # found before the model's forward (see with_packed_layout)
    if layout is None:
        layout = _layout_outside_compile()(kwargs.get("position_ids"), type(module).__name__)
    if layout.expand is None:
        return _sequences_attention(query, key, value, layout, dropout, scaling), None
    # Shared prompts (see shared_prompt_inputs): every response attends to its group's one copy of the prompt.
    # The sequences are laid out again with the prompt's queries, keys and values before each response, and
    # each packed position takes its output from one of them (a prompt's from its group's first sequence).
    query, key, value = (x.index_select(2, layout.expand) for x in (query, key, value))
    out = _sequences_attention(query, key, value, layout, dropout, scaling)
    return out.index_select(1, layout.pick), None


def _sequences_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: PackedLayout,
                         dropout: float, scaling: float | None) -> torch.Tensor:
    """Causal attention within each sequence of ``layout``: (1, heads, T, d) in, (1, T, heads, d) out."""
    import torch.nn.functional as F

    if dropout == 0.0 and varlen_kernel_usable(query):
        return _varlen_attention(query, key, value, layout, scaling)
    groups = query.shape[1] // key.shape[1]

    def unpacked(x: torch.Tensor, repeat: int) -> torch.Tensor:
        x = x[0][:, layout.index].transpose(0, 1)  # (n, heads, L, d)
        return x.repeat_interleave(repeat, dim=1) if repeat > 1 else x

    out = F.scaled_dot_product_attention(unpacked(query, 1), unpacked(key, groups), unpacked(value, groups),
                                         dropout_p=dropout, scale=scaling, is_causal=True)  # (n, heads, L, d)
    n, heads, longest, d = out.shape
    # The valid positions, gathered by index (a boolean mask would wait for the GPU in every layer).
    out = out.transpose(1, 2).reshape(n * longest, heads, d).index_select(0, layout.valid_flat)
    return out[None]  # (1, T, heads, d)


class PackedLayout(NamedTuple):
    """Where the sequences of one packed row lie (every layer of a forward pass shares it). With shared
    prompts the sequences are those of the expanded row (``expand``), not of the packed row itself."""

    index: torch.Tensor  # (sequences, longest): gather indices into the row, clamped past each sequence's end
    valid_flat: torch.Tensor  # the flat positions of real tokens in (sequences * longest)
    cu_seqlens: torch.Tensor  # (sequences + 1,) int32: where each sequence starts, then the total
    longest: int
    # Shared prompts: the packed row's position of each token of the expanded row (each sequence a prompt and
    # one of its responses), and for each packed position the expanded position its output is taken from.
    expand: torch.Tensor | None = None
    pick: torch.Tensor | None = None


_LAYOUT: list[Any] = [None, None]  # the last packed row's position ids and its layout: every layer shares them


def _sequence_layout(position_ids: torch.Tensor | None, where: str) -> PackedLayout:
    """The packed row's layout, computed once per forward pass (one wait for the GPU, not one per layer)."""

    from rlx.errors import UserError

    if _LAYOUT[0] is position_ids and position_ids is not None:
        return _LAYOUT[1]
    if position_ids is None or int(position_ids.reshape(-1)[0]) != 0:
        raise UserError(f"{where} does not pass position ids that start at 0 to its attention, so packed "
                        "sequences cannot be told apart.",
                        "Set actor.use_remove_padding=false (and critic.use_remove_padding=false) for this model.")
    layout = _layout_of(position_ids.reshape(-1))
    _LAYOUT[:] = [position_ids, layout]
    return layout


def _layout_of(positions: torch.Tensor, expand: torch.Tensor | None = None,
               pick: torch.Tensor | None = None) -> PackedLayout:
    """The layout of a row of sequences whose position ids (T,) restart at 0 at each one."""
    import torch

    total = positions.shape[0]
    starts = (positions == 0).nonzero().flatten()
    lengths = torch.diff(starts, append=starts.new_tensor([total]))
    longest = int(lengths.max())
    steps = torch.arange(longest, device=starts.device)
    valid = steps < lengths[:, None]  # (n, L)
    return PackedLayout(index=(starts[:, None] + steps).clamp(max=total - 1),
                        valid_flat=valid.flatten().nonzero().flatten(),
                        cu_seqlens=torch.cat([starts, starts.new_tensor([total])]).to(torch.int32),
                        longest=longest, expand=expand, pick=pick)


# The keyword argument that carries a packed row's layout from the model's forward to packed_sdpa in every
# layer (transformers passes extra keyword arguments down to the attention function).
LAYOUT_KWARG = "rlx_packed_layout"


def with_packed_layout(inputs: dict[str, Any], model: Any) -> dict[str, Any]:
    """``inputs`` plus the packed row's layout, found once before the forward pass, when the model's attention
    is :func:`packed_sdpa`: the layers then look nothing up themselves, so a compiled layer is one graph with
    no break (which gradient checkpointing inside the graph needs)."""
    if not runs_packed_sdpa(model) or "attention_mask" in inputs or LAYOUT_KWARG in inputs:
        return inputs
    return {**inputs, LAYOUT_KWARG: _sequence_layout(inputs["position_ids"], type(model).__name__)}


def runs_packed_sdpa(model: Any) -> bool:
    """Whether ``model``'s attention is :func:`packed_sdpa` (the layout reaches it from the forward's inputs)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == PACKED_SDPA


def _layout_in_attention(position_ids: torch.Tensor | None, where: str) -> PackedLayout:
    """The layout for an attention call that was not handed one: the forward's own, looked up by its position
    ids, else found from them. The position ids of a forward with shared prompts (:func:`shared_prompt_inputs`)
    restart at 0 only at each prompt, so they cannot be read as sequences; a model that passes on a copy of them
    gets its forward's layout by their values (a packed row of whole sequences never has a shared row's
    positions: its positions only ever go up by 1 or back to 0)."""
    import torch

    ids, layout = _LAYOUT
    if (layout is not None and layout.expand is not None and position_ids is not None and ids is not position_ids
            and ids.shape == position_ids.shape and torch.equal(ids, position_ids.to(ids.device))):
        return layout
    return _sequence_layout(position_ids, where)


def _layout_outside_compile() -> Any:
    """:func:`_layout_in_attention`, run eagerly when a compiled layer calls it (it reads tensor values)."""
    if not _LAYOUT_EAGER:
        import torch

        _LAYOUT_EAGER.append(torch.compiler.disable(_layout_in_attention))
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


def model_inputs(batch: Batch, packed: bool, share_prompts: bool = False) -> tuple[dict[str, Any], torch.Tensor]:
    """The model's keyword inputs for ``batch`` and the indices (along the model's sequence axis) of the
    positions whose outputs belong to the response tokens: position ``keep[j]`` predicts response token j
    (padded: j of every row; packed: the j-th valid response token in row order).

    Padded: (b, P+R) with an attention mask. Packed: the valid tokens of every row, prompt then response,
    concatenated into one row (1, T) with position ids restarting at 0 per sequence and no attention mask,
    which transformers reads as packed sequences (attention kept within each one). ``share_prompts`` (packed,
    for a model on :func:`packed_sdpa`): rows with the same prompt carry it once (:func:`shared_prompt_inputs`).
    """
    import torch

    prompt_mask, response_mask = batch["prompt_mask"], batch["response_mask"]
    if packed and len(batch) and not bool(prompt_mask.bool().any(-1).all()):
        raise ValueError("a row has no prompt token: its first response token has no position to be predicted from")
    if packed and share_prompts:
        shared = shared_prompt_inputs(batch)
        if shared is not None:
            return shared
    input_ids = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    mask = torch.cat([prompt_mask, response_mask], dim=1)  # (b, P+R)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    p, r = prompt_mask.shape[1], response_mask.shape[1]
    if not packed:
        keep = torch.arange(p - 1, p + r - 1, device=input_ids.device)
        return {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids}, keep
    valid = mask.bool()
    # Index of every valid token in the packed row; a response token is predicted by the token before it,
    # which is in the same sequence because every sequence starts with its prompt.
    packed_index = valid.flatten().cumsum(0).view_as(valid) - 1
    keep = packed_index[:, p:][response_mask.bool()] - 1
    return {"input_ids": input_ids[valid][None], "position_ids": position_ids[valid][None]}, keep


def shared_prompt_inputs(batch: Batch) -> tuple[dict[str, Any], torch.Tensor] | None:
    """Packed inputs in which each prompt that several rows share appears once, or None when no row shares
    its prompt. For each group of rows with one prompt (:func:`prompt_groups`) the packed row holds the prompt
    once and then every member's response, each with the position ids it has after its prompt:

        [prompt A | response A1 | response A2 | ... | prompt B | response B1 | ...]

    The layers' per-token work on a prompt is done once for the group instead of once per response (8 rows of
    a 214-token prompt and 256-token responses: 2,262 tokens instead of 3,760). What the model computes is
    the same: the attention (:func:`packed_sdpa`, from the layout in ``inputs[LAYOUT_KWARG]``) lays out each
    response after its prompt's queries, keys and values again (``expand``), so each response attends
    to the prompt and to itself, and the gradients of every response reach the one prompt. Each member's first
    response token is predicted from the prompt's last position (``keep`` repeats it, once per member).
    """
    import torch

    from rlx.step import distinct_prompts

    firsts, groups = distinct_prompts(batch["prompts"], batch["prompt_mask"])
    b = groups.shape[0]
    if firsts.shape[0] == b:
        return None
    prompt_mask, response_mask = batch["prompt_mask"].bool(), batch["response_mask"].bool()
    device = groups.device
    rows = torch.arange(b, device=device)
    lead = firsts[groups]  # (b,) the group's first row: its prompt is the one packed
    leads = lead == rows
    order = torch.argsort(lead * b + rows)  # groups in order of their first row, members in row order
    p = prompt_mask.shape[1]
    input_ids = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    mask = torch.cat([prompt_mask, response_mask], dim=1)  # (b, P+R): a member's own sequence
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    packed_mask = torch.cat([prompt_mask & leads[:, None], response_mask], dim=1)  # a prompt for its lead only

    def flat_index(valid: torch.Tensor) -> torch.Tensor:
        """(b, P+R): each valid entry's index in the flat row that lays the rows out in ``order``."""
        index = torch.empty_like(valid, dtype=torch.long)
        index[order] = valid[order].flatten().cumsum(0).view_as(valid) - 1
        return index

    packed_index = flat_index(packed_mask)  # where each packed token lies in the packed row
    # The expanded row: each member's sequence, its group's prompt (the lead's packed tokens) and its response.
    expanded_index = flat_index(mask)
    sources = torch.cat([packed_index[lead][:, :p], packed_index[:, p:]], dim=1)  # (b, P+R) into the packed row
    total = int(packed_mask.sum())
    pick = torch.empty(total, dtype=torch.long, device=device)
    pick[packed_index[packed_mask]] = expanded_index[packed_mask]
    layout = _layout_of(position_ids[order][mask[order]], expand=sources[order][mask[order]], pick=pick)
    # Response token j is predicted from the position before it; a member's first, from the prompt's last.
    predictors = packed_index[:, p:] - 1
    first_token = response_mask & (response_mask.cumsum(-1) == 1)
    last_prompt = torch.where(prompt_mask, torch.arange(p, device=device), -1).amax(-1)  # (b,) its column
    from_prompt = packed_index[lead, last_prompt]  # (b,) the lead's last prompt token in the packed row
    predictors = torch.where(first_token & ~leads[:, None], from_prompt[:, None], predictors)
    keep = predictors[response_mask]
    inputs = {"input_ids": input_ids[order][packed_mask[order]][None],
              "position_ids": position_ids[order][packed_mask[order]][None]}
    _LAYOUT[:] = [inputs["position_ids"], layout]  # what a layer that is not given the layout looks up
    return {**inputs, LAYOUT_KWARG: layout}, keep


def unpack(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-token values of the valid response tokens (n, ...) in row order -> (b, R, ...), 0 at padding."""
    out = values.new_zeros(tuple(response_mask.shape) + tuple(values.shape[1:]))
    out[response_mask.bool()] = values
    return out
