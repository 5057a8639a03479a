"""Ulysses sequence parallelism (DeepSpeed-Ulysses, as verl runs it) for the FSDP backends.

``ulysses_sequence_parallel_size`` = sp: the training processes form groups of sp consecutive ranks; the
ranks of a group receive the same data (one data-parallel rank of ``world // sp``) and cut every packed row
along the sequence, each running the model on 1/sp of its tokens. Everything outside attention is per
token, so it runs on the local slice unchanged (rotary embeddings take the slice's own position ids).
Attention needs every token of a sequence: around the kernel an all-to-all turns the local (tokens/sp, all
heads) into (all tokens, heads/sp), the packed attention (:func:`rlx.plugins.modeling.packing.packed_sdpa`,
given the whole row's position ids) runs on those heads, and a second all-to-all turns its output back.
Key/value heads that sp does not divide are repeated first (verl's way), so only the query heads must be a
multiple of sp.

The outputs the algorithm sees are whole: each rank computes the log-probs, entropies or values of the
response positions in its slice, and they are all-gathered over the group into (batch, response_length)
tensors. Every rank of a group then computes the same loss; the gather's backward keeps the gradient of the
rank's own slice only, and the all-to-all's backward sends the attention gradients back to the ranks whose
keys and values they belong to, so the gradients summed over the group are the single-process gradients.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from rlx import _compat
from rlx.errors import UserError

if TYPE_CHECKING:
    import torch

    from rlx.batch import Batch
    from rlx.records import ForwardOptions

# The attention rlx registers with transformers for a sequence-parallel model (see ulysses_attention).
ULYSSES_SDPA = "rlx_ulysses_sdpa"

# The sequence-parallel forward in progress: (its SequenceParallel, the whole packed row's position ids).
# Set by every sequence-parallel forward and kept until the next one, because gradient checkpointing runs
# the attention again during the backward pass, after the forward has returned.
_CURRENT: list[Any] = [None, None]


def ulysses_size(forward: ForwardOptions, role: str) -> int:
    """A role's sequence-parallel size (``RoleSpec.forward``), checked."""
    size = int(forward.ulysses_sequence_parallel_size)
    if size < 1:
        raise UserError(f"{option_name(role)}={size}: it must be at least 1.",
                        f"Set {option_name(role)} to 1 (off) or to a divisor of the number of processes.")
    return size


def option_name(role: str) -> str:
    """The config option that sets a role's size (the reference uses the actor's)."""
    return f"{'critic' if role == 'critic' else 'actor'}.ulysses_sequence_parallel_size"


def check_processes(size: int, world: int, role: str) -> None:
    if world % size:
        raise UserError(f"{option_name(role)}={size} does not divide the {world} training process"
                        f"{'es' if world != 1 else ''}: each sequence-parallel group is {size} processes.",
                        f"Run with a multiple of {size} processes (--nproc), or set {option_name(role)} to a "
                        f"divisor of {world}.")


def check_heads(size: int, config: Any, role: str) -> None:
    """The query heads must split evenly over the group (key/value heads are repeated when they do not)."""
    heads = getattr(config, "num_attention_heads", None)
    if heads is not None and int(heads) % size:
        raise UserError(f"{option_name(role)}={size} does not divide the model's {heads} attention heads: "
                        "Ulysses gives each process of a group the same number of heads.",
                        f"Set {option_name(role)} to a divisor of {heads}.")


def _seq_to_heads(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """(b, H, t, d) of the local tokens -> (b, H/size, size*t, d): every token, this rank's heads."""
    import torch
    import torch.distributed as dist

    b, h, t, d = x.shape
    send = x.reshape(b, size, h // size, t, d).transpose(0, 1).contiguous()  # chunk j goes to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[i]: rank i's tokens, this rank's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * t, d)


def _heads_to_seq(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """(b, h, T, d) of this rank's heads -> (b, h*size, T/size, d): every head, the local tokens."""
    import torch
    import torch.distributed as dist

    b, h, total, d = x.shape
    t = total // size
    send = x.reshape(b, h, size, t, d).permute(2, 0, 1, 3, 4).contiguous()  # rank j's tokens go to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[i]: rank i's heads of the local tokens
    return recv.transpose(0, 1).reshape(b, size * h, t, d)


_FUNCTIONS: dict[str, Any] = {}


def _functions() -> dict[str, Any]:
    """The autograd functions (built on first use: torch is imported lazily)."""
    if _FUNCTIONS:
        return _FUNCTIONS
    import torch
    import torch.distributed as dist

    class SeqToHeads(torch.autograd.Function):
        """:func:`_seq_to_heads`; its gradient is the inverse all-to-all."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
            ctx.group, ctx.size = group, size
            return _seq_to_heads(x, group, size)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
            return _heads_to_seq(grad.contiguous(), ctx.group, ctx.size), None, None

    class HeadsToSeq(torch.autograd.Function):
        """:func:`_heads_to_seq`; its gradient is the inverse all-to-all."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
            ctx.group, ctx.size = group, size
            return _heads_to_seq(x, group, size)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
            return _seq_to_heads(grad.contiguous(), ctx.group, ctx.size), None, None

    class GatherSlices(torch.autograd.Function):
        """Rows (n_r, k) of every rank, concatenated in rank order (counts known on every rank).

        Every rank of the group computes the same loss from the gathered rows, so the gradient each rank
        receives for all rows is the same: its own rows' part is its share, and keeping only that part
        (no sum over the group) gives each slice its gradient exactly once.
        """

        @staticmethod
        def forward(ctx: Any, local: torch.Tensor, counts: list[int], rank: int, group: Any) -> torch.Tensor:
            ctx.start, ctx.count = sum(counts[:rank]), counts[rank]
            width = max(counts)
            padded = local.new_zeros((width, *local.shape[1:]))
            padded[:local.shape[0]] = local
            parts = [torch.empty_like(padded) for _ in counts]
            dist.all_gather(parts, padded, group=group)
            return torch.cat([part[:c] for part, c in zip(parts, counts)])

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
            return grad[ctx.start:ctx.start + ctx.count], None, None, None

    _FUNCTIONS.update(SeqToHeads=SeqToHeads, HeadsToSeq=HeadsToSeq, GatherSlices=GatherSlices)
    return _FUNCTIONS


def ulysses_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Packed attention over a sequence-parallel group: (1, heads, local tokens, d) in, (1, local tokens,
    heads, d) out, the kernel itself run on all tokens and heads/sp (see the module doc)."""
    from rlx.plugins.modeling.packing import packed_sdpa

    sp, positions = _CURRENT
    if sp is None or attention_mask is not None or query.shape[0] != 1:
        raise RuntimeError("a sequence-parallel model ran outside SequenceParallel's packed forward pass")
    size = sp.size
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % size:
        raise UserError(f"{type(module).__name__} has {heads} attention heads, which "
                        f"ulysses_sequence_parallel_size={size} does not divide.",
                        f"Set ulysses_sequence_parallel_size to a divisor of {heads}.")
    repeat = size // math.gcd(kv_heads, size)
    if repeat > 1:  # each query head keeps its key/value head: heads is a multiple of lcm(kv_heads, size)
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    fn = _functions()
    q, k, v = (fn["SeqToHeads"].apply(x, sp.group, size) for x in (query, key, value))
    out, _ = packed_sdpa(module, q, k, v, None, dropout=dropout, scaling=scaling,
                         **{**kwargs, "position_ids": positions})  # (1, T, heads/size, d)
    out = fn["HeadsToSeq"].apply(out.transpose(1, 2), sp.group, size)  # (1, heads, t, d)
    return out.transpose(1, 2), None


def use_ulysses_attention(hf_model: Any, role: str) -> None:
    """Switch a model that runs rlx's packed sdpa (``use_packed_sdpa``) to :func:`ulysses_attention`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from rlx.plugins.modeling.packing import PACKED_SDPA, _packed_sdpa_mask

    config = hf_model.config
    if config._attn_implementation != PACKED_SDPA:
        raise UserError(f"{option_name(role)} > 1 needs packed sequences on the sdpa kernel, but the {role} model "
                        f"runs attention {config._attn_implementation!r}"
                        f"{' with sliding-window layers' if config._attn_implementation == 'sdpa' else ''}.",
                        "Use backend.attn_implementation=sdpa, a model without sliding-window attention, or set "
                        f"{option_name(role)}=1.")
    AttentionInterface.register(ULYSSES_SDPA, ulysses_attention)
    AttentionMaskInterface.register(ULYSSES_SDPA, _packed_sdpa_mask)
    config._attn_implementation = ULYSSES_SDPA


class SequenceParallel:
    """A rank's sequence-parallel group: its process group, size and the rank's place in it; runs a role's
    packed forward passes on the rank's slice and returns the whole batch's outputs."""

    def __init__(self, group: Any, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank

    def shard(self, batch: Batch) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[int]]:
        """The model inputs of this rank's slice of the packed row, the indices (within the slice) of the
        positions that predict response tokens, and how many such positions every rank's slice holds.

        The row is padded to a multiple of the group size with one extra sequence (token 0, positions from
        0), which predicts nothing."""
        import torch

        from rlx.plugins.modeling.packing import model_inputs

        inputs, keep = model_inputs(batch, packed=True)
        ids, positions = inputs["input_ids"], inputs["position_ids"]
        pad = -ids.shape[1] % self.size
        if pad:
            ids = torch.cat([ids, ids.new_zeros(1, pad)], dim=1)
            positions = torch.cat([positions, torch.arange(pad, device=positions.device, dtype=positions.dtype)[None]],
                                  dim=1)
        local = ids.shape[1] // self.size
        starts = torch.arange(self.size + 1, device=keep.device) * local
        bounds = torch.searchsorted(keep, starts).tolist()
        counts = [bounds[r + 1] - bounds[r] for r in range(self.size)]
        lo, hi = self.rank * local, (self.rank + 1) * local
        _CURRENT[:] = [self, positions]
        mine = keep[bounds[self.rank]:bounds[self.rank + 1]] - lo
        return {"input_ids": ids[:, lo:hi], "position_ids": positions[:, lo:hi]}, mine, counts

    def gather(self, local: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if max(counts) == 0:  # no response token anywhere: nothing to exchange
            return local
        return _functions()["GatherSlices"].apply(local, counts, self.rank, self.group)

    def log_probs(self, model: Any, hf_model: Any, batch: Batch, temperature: float, with_entropy: bool,
                  entropy_grad: bool, chunk_size: int, compile_head: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:func:`rlx.plugins.modeling.head.response_log_probs` of a packed batch, computed on this
        rank's slice (the chunked head included) and gathered: (b, R) log-probs and entropies."""
        import torch

        from rlx.plugins.modeling.head import _head_replaced, fused_head_supported
        from rlx.plugins.modeling.logits import entropy_from_logits, log_probs_from_logits
        from rlx.plugins.modeling.packing import _accepts, unpack

        mask = batch["response_mask"].bool()
        inputs, keep, counts = self.shard(batch)
        start = sum(counts[:self.rank])
        targets = batch["responses"][mask][start:start + counts[self.rank]][None]  # (1, n_r)
        keep_kwarg = _accepts(hf_model, "logits_to_keep")
        if keep_kwarg:
            inputs["logits_to_keep"] = keep
        if chunk_size and keep_kwarg and fused_head_supported(hf_model):
            with _head_replaced(hf_model.get_output_embeddings(), targets, temperature or 1.0, chunk_size,
                                compile_head):
                both = model(**inputs, use_cache=False).logits[0]  # (n_r, 2): log-prob, entropy
            if not with_entropy:
                both = both[:, :1]
        else:
            logits = model(**inputs, use_cache=False).logits
            logits = (logits if keep_kwarg else logits[:, keep]).float()  # (1, n_r, V)
            if temperature and temperature != 1.0:
                logits = logits / temperature
            columns = [log_probs_from_logits(logits, targets)[0]]
            if with_entropy:
                with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                    columns.append(entropy_from_logits(logits if entropy_grad else logits.detach())[0])
            both = torch.stack(columns, dim=-1)
        both = self.gather(both, counts)  # (n, 1 or 2), every response token of the batch
        entropy = None
        if with_entropy:
            entropy = unpack(both[:, 1] if entropy_grad else both[:, 1].detach(), mask)
        return unpack(both[:, 0], mask), entropy

    def values(self, model: Any, batch: Batch) -> torch.Tensor:
        """:func:`rlx.plugins.modeling.head.response_values` of a packed batch, computed on this
        rank's slice and gathered: (b, R)."""
        from rlx.plugins.modeling.packing import unpack

        inputs, keep, counts = self.shard(batch)
        values = model(**inputs, use_cache=False).logits[0, keep]  # (n_r, 1)
        return unpack(self.gather(values, counts)[:, 0], batch["response_mask"].bool())


# Names that lived here in rlx 0.1 (issue 26 moved them); kept for one release, with a DeprecationWarning.
__getattr__ = _compat.moved_attributes(__name__, {
    "config_problems": "rlx.plugins.modeling.checks:ulysses_problems",
})
