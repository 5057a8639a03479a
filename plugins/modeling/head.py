"""The language-model head and what comes out of it: per-token log-probs and entropies of the responses at a
sampling temperature, from the head's logits formed in chunks of positions (``log_prob_chunk_size``, each chunk
recomputed in the backward pass, so the (tokens x vocabulary) logits are never held whole), and a value
model's per-token values.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from rlx.plugins.modeling.packing import _accepts, model_inputs, runs_packed_sdpa, unpack, with_packed_layout

if TYPE_CHECKING:
    import torch

    from rlx.batch import Batch


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
    once per process). Compiled, each is one or two passes over the chunk's compute-dtype logits instead of a
    pass per operation. Through :func:`_own` their row count is symbolic from the first compilation and every
    per-row input sits at storage offset 0, and a chunk of one row takes the eager functions (:func:`_spans`
    leaves one only in corner cases), so each compiles once per process. Before, a later compilation came at
    whatever step first met a new case: the built-in job on the CPU compiled the head again at its third and
    fourth steps."""
    grads = functools.partial(_logit_grads, fused=compiled)
    if not compiled:
        return _logit_stats, grads
    import torch

    return torch.compile(_logit_stats), torch.compile(grads)


def _spans(n: int, chunk: int) -> list[slice]:
    """The chunks of ``n`` rows: ``chunk`` rows each, the last one shorter. A last chunk of one row takes a
    row from the one before it (two rows, and ``chunk - 1`` before), so no chunk is larger than ``chunk`` and
    a row alone is left only where ``n`` or ``chunk`` is 1 or ``chunk`` is 2: a compiled function
    specialises a size of 1, so such a chunk takes the eager functions."""
    starts = list(range(0, n, max(chunk, 1)))
    if len(starts) > 1 and n - starts[-1] == 1 and chunk > 2:
        starts[-1] -= 1
    return [slice(a, b) for a, b in zip(starts, [*starts[1:], n], strict=True)] if starts else []


def _own(t: torch.Tensor | None, compiled: bool) -> torch.Tensor | None:
    """A chunk's logits or per-row vector for a compiled function: rows marked dynamic (else the first
    compilation is for the first chunk's row count and the shorter last chunk compiles again), a vector
    copied to storage offset 0 (a view's offset is specialised, 0 apart from the rest). Eager: ``t``."""
    if not compiled or t is None:
        return t
    import torch

    if t.dim() == 1:
        t = t.clone()
    torch._dynamo.maybe_mark_dynamic(t, 0)
    return t


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
            n = hidden.shape[0]
            log_probs = hidden.new_empty(n, dtype=torch.float32)
            entropy, lse = torch.empty_like(log_probs), torch.empty_like(log_probs)
            for part in _spans(n, chunk):
                z = _chunk_logits(hidden[part], w, b)  # (c, V) in the compute dtype
                fused = compiled and part.stop - part.start > 1  # one row: eager (see _spans)
                own = functools.partial(_own, compiled=fused)
                stats, _ = _head_fns(fused)
                lse[part], log_probs[part], entropy[part] = stats(own(z), own(targets[part]), temperature)
            ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
            ctx.dtype, ctx.temperature, ctx.chunk, ctx.compiled = dtype, temperature, chunk, compiled
            return log_probs, entropy

        @staticmethod
        def backward(ctx: Any, grad_lp: torch.Tensor | None, grad_ent: torch.Tensor | None) -> tuple[Any, ...]:
            hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
            need_h, need_w, need_b = ctx.needs_input_grad[:3]
            if grad_lp is None and grad_ent is None:
                return (None,) * 7
            w = weight.to(ctx.dtype)
            b = bias.to(ctx.dtype) if bias is not None else None
            d_hidden = torch.empty_like(hidden) if need_h else None
            d_weight: torch.Tensor | None = None  # float32 sums over the chunks
            d_bias: torch.Tensor | None = None
            for part in _spans(hidden.shape[0], ctx.chunk):
                h = hidden[part]
                fused = ctx.compiled and part.stop - part.start > 1  # one row: eager (see _spans)
                own = functools.partial(_own, compiled=fused)
                _, grads = _head_fns(fused)
                dz = grads(own(_chunk_logits(h, w, b)), own(targets[part]), own(lse[part]), own(entropy[part]),
                           own(grad_lp[part]) if grad_lp is not None else None,
                           own(grad_ent[part]) if grad_ent is not None else None, ctx.temperature)
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


def forward_inputs(batch: Batch, packed: bool, hf: Any,
                   share_prompts: bool = False) -> tuple[dict[str, Any], torch.Tensor, bool]:
    """The model's keyword inputs for ``batch``, the positions that predict its response tokens (see
    :func:`model_inputs`) and whether the rows are packed. Rows with images (``rlx.plugins.modeling.vision``) go
    padded, with their image tensors and multimodal rotary positions. ``share_prompts``: rows with one prompt
    carry it once, where the model's attention is rlx's packed sdpa (which reads the layout that says so)."""
    from rlx.plugins.modeling import vision

    if vision.has_images(batch):
        inputs, keep = model_inputs(batch, False)
        return vision.with_images(inputs, batch, hf, inputs["input_ids"], inputs["attention_mask"]), keep, False
    inputs, keep = model_inputs(batch, packed, share_prompts=share_prompts and runs_packed_sdpa(hf))
    return with_packed_layout(inputs, hf), keep, packed


def response_sum_pi_squared(model: Any, batch: Batch, temperature: float, *, packed: bool = False,
                            hf_model: Any = None, share_prompts: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (b, R) of the response tokens and sum_v pi_v^2 (b, R), the sum over the vocabulary of the squared
    next-token probabilities (logits divided by temperature), both 0 at padding, from the whole logits in float32
    (float64 for a float64 model): for the optimal-token-baseline estimators, in the no-gradient old-log-prob pass.
    sum pi^2 = exp(logsumexp(2 z) - 2 logsumexp(z))."""
    import torch

    from rlx.plugins.modeling.logits import log_probs_from_logits

    hf = model if hf_model is None else hf_model
    mask = batch["response_mask"].bool()
    inputs, keep, packed = forward_inputs(batch, packed, hf, share_prompts)
    targets = batch["responses"][mask][None] if packed else batch["responses"]
    keep_kwarg = _accepts(hf, "logits_to_keep")
    if keep_kwarg:
        inputs["logits_to_keep"] = keep
    logits = model(**inputs, use_cache=False).logits
    logits = logits if keep_kwarg else logits[:, keep]
    logits = logits if logits.dtype == torch.float64 else logits.float()
    if temperature and temperature != 1.0:
        logits = logits / temperature
    log_probs = log_probs_from_logits(logits, targets)
    squares = torch.exp(torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * torch.logsumexp(logits, dim=-1))
    return _per_row(log_probs, mask, packed), _per_row(squares, mask, packed)


def response_log_probs(model: Any, batch: Batch, temperature: float, with_entropy: bool,
                       entropy_grad: bool = True, *, packed: bool = False, chunk_size: int = 0,
                       compile_head: bool = False, hf_model: Any = None,
                       share_prompts: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (b, R) of the response tokens under ``model`` (logits divided by temperature), 0 at padding.

    Only the positions that predict response tokens reach the head. ``packed``: the rows go through the
    model as one packed row (see :func:`model_inputs`; ``share_prompts``: rows with one prompt carry it
    once). ``chunk_size`` > 0: log-probs and entropies come
    from :func:`chunked_head` (no float32 copy of the (positions x vocabulary) logits); 0: from the
    logits in float32; ``compile_head``: the chunked head's element-wise work compiled. ``hf_model`` is
    the Hugging Face model when ``model`` wraps it (FSDP1).
    With ``entropy_grad=False`` the entropy is only a metric: it is kept out of the autograd graph.
    """
    import torch

    from rlx.plugins.modeling.logits import entropy_from_logits, log_probs_from_logits

    hf = model if hf_model is None else hf_model
    mask = batch["response_mask"].bool()
    inputs, keep, packed = forward_inputs(batch, packed, hf, share_prompts)
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


def response_values(model: Any, batch: Batch, *, packed: bool = False, share_prompts: bool = False) -> torch.Tensor:
    """Values (b, R) of a value model; values[:, t] scores the state before response token t.
    Padding is 0."""
    inputs, keep, packed = forward_inputs(batch, packed, model, share_prompts)
    values = model(**inputs, use_cache=False).logits[:, keep].squeeze(-1)
    return _per_row(values, batch["response_mask"].bool(), packed)
