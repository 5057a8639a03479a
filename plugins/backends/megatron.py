"""The ``megatron`` training backend: one role's model as a megatron-core GPT model with tensor, pipeline
and data parallelism, on the shared training step of ``rlx.step``.

Layout. The launcher's processes form the default ``torch.distributed`` group; megatron-core's
``parallel_state`` cuts it into tensor-parallel (TP), pipeline-parallel (PP) and data-parallel (DP) groups
(order tp-cp-dp-pp, megatron's default). Every rank of one DP group position (its TP and PP peers) gets the
same data shard: the worker reports ``dp_rank``/``dp_size`` from ``parallel_state`` and ``collect`` only on
TP rank 0 of the last pipeline stage, where the outputs are (``DispatchInfo``).

Model. mbridge builds the ``TransformerConfig`` from the Hugging Face config; the layers are Transformer
Engine's when it is installed, megatron-core's local ones otherwise; weights are converted on load and on
the way out (``megatron_convert``). A trainable role keeps bf16 parameters and fp32 master weights in
megatron-core's mixed-precision optimizer (``model.dtype`` float32: float32 throughout); gradients
accumulate and are reduced over DP in fp32 (megatron-core's DDP, optionally the distributed optimizer).

The step. With one pipeline stage the worker supplies ``rlx.step``'s primitives (forward, backward,
zero_grad, optimizer_step, all_reduce over the DP group, to_device) and ``run_update``/``run_forward`` run
the micro-batch loops as for every backend. With several stages the same mini-batch cut
(``rlx.step.micro_batches``, the global token and sequence counts in a ``LossContext``) goes through
megatron-core's pipeline schedule (``forward_backward_func``): the micro-batches are its micro-batches, the
algorithm's loss is its loss function on the last stage, and the optimizer step is the same
``optimizer_step``. Losses divide by global counts, so gradients are summed, never averaged: the
TransformerConfig's ``calculate_per_token_loss`` stops the schedule and DDP from dividing by the
micro-batch count or the DP size.

Sequences. Each row's valid prompt and response tokens are moved to the front of the row (right padding),
so a causal mask alone keeps every token from seeing padding and positions start at 0 in every row; no
attention mask is built. Log-probs and entropies come from the vocabulary-parallel logits without gathering
the vocabulary: maxima, sums of exponentials, the chosen token's logit and sum p*z are reduced over the TP
group. Packed (THD) sequences and context parallelism are not built yet.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlx import Component, hookimpl
from rlx.batch import trained_mask
from rlx.config import resolve_dtype
from rlx.context import BuildContext
from rlx.errors import UserError
from rlx.plugins.modeling.checks import CONFIG_PROBLEMS
from rlx.protocols import DispatchInfo, LossFn, RoleSpec
from rlx.records import LossContext, RoleSettings, UpdateContext
from rlx.registry import Requirement

if TYPE_CHECKING:
    import torch

    from rlx.batch import Batch

INSTALL_HINT = "pip install 'rlx[megatron]' (megatron-core and mbridge)"


class MegatronOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tensor_model_parallel_size: int = Field(1, ge=1, le=1024, description="Ranks that split each layer's "
                                            "weights (and the vocabulary); must divide the attention heads, the "
                                            "key/value heads and the vocabulary.")
    pipeline_model_parallel_size: int = Field(1, ge=1, le=1024, description="Pipeline stages; must divide the "
                                              "layers (times virtual_pipeline_model_parallel_size).")
    virtual_pipeline_model_parallel_size: int | None = Field(
        None, ge=2, le=1024, description="Model chunks per pipeline stage (interleaved schedule); needs "
        "pipeline_model_parallel_size > 1.")
    context_parallel_size: int = Field(1, ge=1, le=1024, description="Ranks that split each sequence; only 1 "
                                       "is supported yet.")
    sequence_parallel: bool = Field(False, description="Split the activations outside attention and MLP along "
                                    "the sequence over the tensor-parallel ranks (needs tensor_model_parallel_size "
                                    "> 1).")
    use_distributed_optimizer: bool = Field(False, description="Shard the fp32 master weights and Adam states "
                                            "over the data-parallel ranks (ZeRO-1).")
    recompute_granularity: Literal["full", "selective"] | None = Field(
        None, description="Activation recomputation: full layers, or only the attention core (selective).")
    recompute_method: Literal["uniform", "block"] | None = Field(
        None, description="With recompute_granularity=full: how layers are grouped for recomputation.")
    recompute_num_layers: int | None = Field(None, ge=1, le=100_000, description="With recompute_granularity=full:"
                                             " layers per group (uniform) or recomputed layers per stage (block).")
    num_threads: int | None = Field(None, gt=0, le=4096, description="torch CPU threads per process (default: "
                                    "torch's choice).")


# -- checks that need no torch --------------------------------------------------------------------------
def require_megatron(needed_for: str = "--backend megatron") -> None:
    for module, what in (("megatron.core", "megatron-core"), ("mbridge", "mbridge")):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise UserError(f"{needed_for} needs {what}, which is not installed.", INSTALL_HINT)


def layout_problems(options: MegatronOptions, world_size: int | None, hf_config: Any = None) -> list[str]:
    """Every way the parallel layout does not fit the processes or the model (empty: it fits)."""
    tp, pp, cp = (options.tensor_model_parallel_size, options.pipeline_model_parallel_size,
                  options.context_parallel_size)
    vpp = options.virtual_pipeline_model_parallel_size
    out = []
    if world_size is not None and world_size % (tp * pp * cp):
        out.append(f"tensor_model_parallel_size x pipeline_model_parallel_size x context_parallel_size = "
                   f"{tp} x {pp} x {cp} = {tp * pp * cp} does not divide the {world_size} training processes")
    if cp > 1:
        out.append("context_parallel_size > 1 is not supported by the megatron backend yet")
    if vpp is not None and pp == 1:
        out.append("virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1")
    if options.sequence_parallel and tp == 1:
        out.append("sequence_parallel needs tensor_model_parallel_size > 1")
    if options.recompute_granularity != "full" and (options.recompute_method or options.recompute_num_layers):
        out.append("recompute_method and recompute_num_layers apply to recompute_granularity=full only")
    if options.recompute_granularity == "full" and not (options.recompute_method and options.recompute_num_layers):
        out.append("recompute_granularity=full needs recompute_method and recompute_num_layers")
    if hf_config is not None:
        heads = int(hf_config.num_attention_heads)
        kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
        layers, vocab = int(hf_config.num_hidden_layers), int(hf_config.vocab_size)
        if heads % tp:
            out.append(f"tensor_model_parallel_size={tp} does not divide the model's {heads} attention heads")
        if kv % tp:
            out.append(f"tensor_model_parallel_size={tp} does not divide the model's {kv} key/value heads")
        if vocab % tp:
            out.append(f"tensor_model_parallel_size={tp} does not divide the model's vocabulary of {vocab}")
        stages = pp * (vpp or 1)
        if layers % stages:
            what = f"pipeline_model_parallel_size={pp}" + (f" x virtual_pipeline_model_parallel_size={vpp}"
                                                           if vpp else "")
            out.append(f"{what} = {stages} does not divide the model's {layers} layers")
    return out


def settings_problems(settings: dict[str, RoleSettings]) -> list[str]:
    """Role settings (``rlx.step.role_settings``) this backend does not implement."""
    out = []
    for role, setting in settings.items():
        section = "critic" if role == "critic" else "actor"
        forward = setting.forward
        if setting.lora is not None:
            out.append("LoRA (model.lora_rank > 0) is not supported by the megatron backend")
        if int(forward.ulysses_sequence_parallel_size or 1) > 1:
            out.append(f"{section}.ulysses_sequence_parallel_size > 1 belongs to the fsdp backends (use "
                       "backend.sequence_parallel with tensor parallelism)")
        if forward.model_dtype == "bfloat16":
            out.append(f"{section}.model_dtype=bfloat16 is not supported (the megatron backend keeps fp32 "
                       "master weights)")
    return sorted(set(out))


def check_layout(options: MegatronOptions, world_size: int | None, hf_config: Any = None) -> None:
    problems = layout_problems(options, world_size, hf_config)
    if problems:
        raise UserError("The megatron backend's parallel layout does not fit: " + "; ".join(problems) + ".",
                        "Choose backend.tensor_model_parallel_size / pipeline_model_parallel_size that divide "
                        "the processes (--nproc), the heads and the layers.")


def has_transformer_engine() -> bool:
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def check_engine(options: MegatronOptions) -> None:
    if options.sequence_parallel and not has_transformer_engine():
        raise UserError("backend.sequence_parallel=true needs Transformer Engine: megatron-core's local (torch) "
                        "norms do not support sequence parallelism.",
                        "pip install transformer_engine[pytorch], or set backend.sequence_parallel=false.")


# -- parallel state -------------------------------------------------------------------------------------
def init_parallel(options: MegatronOptions, device: str, seed: int) -> None:
    """megatron-core's groups over the default group (which the launcher initialised, or a one-rank one).
    Every role of a process shares them, so a second role must ask for the same layout."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from rlx.plugins.modeling.dist import ensure_process_group

    ensure_process_group(device)
    check_layout(options, dist.get_world_size())
    want = (options.tensor_model_parallel_size, options.pipeline_model_parallel_size)
    if mpu.model_parallel_is_initialized():
        have = (mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size())
        if have != want:
            raise UserError(f"This process already holds a megatron layout of TP x PP = {have}; another role "
                            f"asks for {want}.", "Every role of a run uses the same backend options.")
        return
    mpu.initialize_model_parallel(tensor_model_parallel_size=want[0], pipeline_model_parallel_size=want[1],
                                  virtual_pipeline_model_parallel_size=options.virtual_pipeline_model_parallel_size,
                                  context_parallel_size=options.context_parallel_size)
    if device.startswith("cuda"):
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def config_overrides(options: MegatronOptions, dtype: torch.dtype, on_cpu: bool) -> dict[str, Any]:
    """The TransformerConfig fields rlx sets on top of the bridge's model mapping."""
    import torch

    return {
        "tensor_model_parallel_size": options.tensor_model_parallel_size,
        "pipeline_model_parallel_size": options.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": options.virtual_pipeline_model_parallel_size,
        "context_parallel_size": options.context_parallel_size,
        "sequence_parallel": options.sequence_parallel,
        "params_dtype": dtype, "pipeline_dtype": dtype, "bf16": dtype == torch.bfloat16, "fp16": False,
        # RL scores tokens deterministically: no dropout (Qwen2 and Llama train without it too).
        "attention_dropout": 0.0, "hidden_dropout": 0.0,
        # Losses divide by global token counts: neither the schedule nor DDP may divide again.
        "calculate_per_token_loss": True,
        "variable_seq_lengths": True,
        "gradient_accumulation_fusion": False,
        # megatron-core's fused masked softmax is a compiled extension its wheel does not ship (Megatron-LM
        # builds it); without it the attention's softmax is torch's.
        "masked_softmax_fusion": importlib.util.find_spec("scaled_masked_softmax_cuda") is not None,
        # Initialisation also marks each parameter's tensor-parallel split (``tensor_model_parallel``,
        # ``partition_dim``), which the gradient norm, the checkpoints and the weight export read.
        "use_cpu_initialization": on_cpu, "perform_initialization": True,
        "recompute_granularity": options.recompute_granularity,
        "recompute_method": options.recompute_method,
        "recompute_num_layers": options.recompute_num_layers,
        "overlap_p2p_comm": False, "batch_p2p_comm": True,
    }


# -- sequences and the vocabulary-parallel head ------------------------------------------------------------
def right_aligned(micro: Batch, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids (b, L) with each row's valid prompt and response tokens first, then padding; the position
    (b, R) whose output predicts response token j: the row's prompt length - 1 + j). L is a multiple of
    ``multiple`` (sequence parallelism splits it over the TP ranks)."""
    import torch

    responses = micro["responses"]
    valid = torch.cat([micro["prompt_mask"], micro["response_mask"]], dim=1).bool()
    ids = torch.cat([micro["prompts"], responses], dim=1) * valid
    ids = ids.gather(1, torch.argsort((~valid).to(torch.int8), dim=1, stable=True))
    longest = max(int(valid.sum(1).max()) if len(micro) else 1, 1)
    length = math.ceil(longest / multiple) * multiple
    if ids.shape[1] >= length:
        ids = ids[:, :length]
    else:
        ids = torch.cat([ids, ids.new_zeros(ids.shape[0], length - ids.shape[1])], dim=1)
    plen = micro["prompt_mask"].sum(1, keepdim=True)
    steps = torch.arange(responses.shape[1], device=ids.device)[None]
    where = (plen - 1 + steps).clamp(0, length - 1)
    return ids.contiguous(), where


def vocab_parallel_log_probs(logits: torch.Tensor, targets: torch.Tensor, group: Any,
                             vocab_start: int, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` and entropies from logits split over the vocabulary (each TP rank holds
    columns ``vocab_start .. vocab_start + V/tp``), float32, never gathering the vocabulary; differentiable."""
    log_probs, entropy = _vocab_parallel_function().apply(logits.float(), targets, group, vocab_start, with_entropy)
    return log_probs, entropy if with_entropy else None


def _vocab_parallel_function() -> type:
    import torch
    import torch.distributed as dist

    def tp_all_reduce(t: torch.Tensor, group: Any, op: Any = None) -> torch.Tensor:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group)
        return t

    class VocabParallelLogProbs(torch.autograd.Function):
        """Forward: m = the global maximum, lse = m + log sum exp(z - m) (sums over the TP group), the chosen
        logit from the rank that holds it, entropy = (lse - m) - sum p (z - m) (around the maximum, so no
        large numbers cancel). Backward is local to each rank's columns: d log p_y / dz_v = [v = y] - p_v and
        d H / dz_v = -p_v (log p_v + H), with lse and H the global values from the forward pass (autograd
        through the all-reduces would miss the other ranks' share of d/d lse)."""

        @staticmethod
        def forward(ctx: Any, z: torch.Tensor, targets: torch.Tensor, group: Any, vocab_start: int,
                    with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
            m = tp_all_reduce(z.max(dim=-1).values, group, dist.ReduceOp.MAX)
            shifted = z - m[..., None]
            log_sum = tp_all_reduce(shifted.exp().sum(-1), group).log()
            lse = m + log_sum
            local = targets - vocab_start
            mine = (local >= 0) & (local < z.shape[-1])
            local = local.clamp(0, z.shape[-1] - 1)
            picked = tp_all_reduce(z.gather(-1, local[..., None]).squeeze(-1) * mine, group)
            entropy = torch.zeros_like(lse)
            if with_entropy:
                p = (shifted - log_sum[..., None]).exp()
                entropy = log_sum - tp_all_reduce((p * shifted).sum(-1), group)
            ctx.save_for_backward(z, lse, entropy, local, mine)
            return picked - lse, entropy

        @staticmethod
        def backward(ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None) -> tuple[Any, ...]:
            z, lse, entropy, local, mine = ctx.saved_tensors
            log_p = z - lse[..., None]
            p = log_p.exp()
            grad = torch.zeros_like(z)
            if g_lp is not None:
                grad -= g_lp[..., None] * p
                grad.scatter_add_(-1, local[..., None], (g_lp * mine)[..., None])
            if g_ent is not None:
                grad -= g_ent[..., None] * p * (log_p + entropy[..., None])
            return grad, None, None, None, None

    return VocabParallelLogProbs


# One TP rank: the head through the torch backends' chunked head (False: the vocabulary-parallel function at every
# TP size, the before of benchmarks/megatron_step.py's A/B, variant part ``tphead``).
WHOLE_VOCABULARY_HEAD = True


def chunked_head(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                 chunk: int, with_entropy: bool, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` and entropies (n,), float32, from hidden states (n, H) and this TP rank's
    shard of the head (V/tp, H): the logits of ``chunk`` positions at a time, in the compute dtype, reduced
    in float32 over the TP group (:func:`vocab_parallel_log_probs`). With gradients each chunk is
    checkpointed: its logits are formed again in the backward pass, so no (n, V/tp) tensor is kept. Entropy
    is 0 unless ``with_entropy``.

    With one TP rank (the whole vocabulary here) it is the torch backends' chunked head
    (:func:`rlx.plugins.modeling.head.chunked_head`, its element-wise work compiled where ``compiled``): the
    same numbers, compiled in two or three passes over each chunk's logits where the function above makes one
    per operation (on an H100 its forward passes' exp, sub, mul and div kernels were a fifth of the GPU kernel
    time of a 0.5b log-prob pass and update, not compiled)."""
    import torch
    from megatron.core import parallel_state as mpu
    from torch.utils.checkpoint import checkpoint

    if WHOLE_VOCABULARY_HEAD and mpu.get_tensor_model_parallel_world_size() == 1:
        from rlx.plugins.modeling.head import chunked_head as whole_vocabulary_head

        lp, ent = whole_vocabulary_head(hidden, weight, None, targets, temperature, chunk, compiled)
        return lp, ent if with_entropy else torch.zeros_like(lp)
    group = mpu.get_tensor_model_parallel_group()
    vocab_start = mpu.get_tensor_model_parallel_rank() * weight.shape[0]

    def one(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.nn.functional.linear(h, weight).float() / temperature
        lp, ent = vocab_parallel_log_probs(z, t, group, vocab_start, with_entropy)
        return lp, ent if ent is not None else torch.zeros_like(lp)

    keep = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    parts = [checkpoint(one, hidden[s:s + chunk], targets[s:s + chunk], use_reentrant=False) if keep
             else one(hidden[s:s + chunk], targets[s:s + chunk]) for s in range(0, hidden.shape[0], chunk)]
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat([lp for lp, _ in parts]), torch.cat([ent for _, ent in parts])


def contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself; in the backward pass its gradient is made contiguous."""
    global _CONTIGUOUS_GRAD
    if _CONTIGUOUS_GRAD is None:
        import torch

        class ContiguousGrad(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
                return x.view_as(x)

            @staticmethod
            def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
                return g.contiguous()

        _CONTIGUOUS_GRAD = ContiguousGrad
    return _CONTIGUOUS_GRAD.apply(t)


_CONTIGUOUS_GRAD: Any = None


@contextlib.contextmanager
def head_replaced(head: Any, where: torch.Tensor, targets: torch.Tensor, temperature: float, chunk: int,
                  with_entropy: bool, compiled: bool = False) -> Iterator[None]:
    """While inside, the last stage's ``output_layer`` (megatron-core's ``ColumnParallelLinear``) forms no
    logits: it receives an empty sequence, and its output becomes :func:`chunked_head`'s log-probs and
    entropies at the response positions ``where`` (b, R), stacked as (R, b, 2), which GPTModel returns
    (transposed) as its logits. The hidden states reach the head as the layer itself would take them: all-gathered
    over the sequence under sequence parallelism (gradients reduce-scattered), otherwise copied into the TP
    region (gradients all-reduced); the weight is the one GPTModel passes (the embedding's when tied)."""
    import torch
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    taken: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def before(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        taken.append((args[0], kwargs.get("weight")))
        return (args[0][:0], *args[1:]), kwargs

    def after(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> tuple[torch.Tensor, None]:
        hidden, weight = taken.pop()  # (s or s/tp, b, H)
        # (megatron-core's mappings reduce a non-contiguous gradient into a copy and return it unreduced:
        # contiguous_grad hands them contiguous ones)
        if module.sequence_parallel:
            hidden = contiguous_grad(gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True))
        b, r = where.shape
        picked = hidden.transpose(0, 1).gather(1, where[..., None].expand(-1, -1, hidden.shape[-1]))  # (b, R, H)
        if not module.sequence_parallel:
            picked = contiguous_grad(copy_to_tensor_model_parallel_region(picked))
        lp, ent = chunked_head(picked.reshape(b * r, -1), module.weight if weight is None else weight,
                               targets.reshape(-1), temperature, chunk, with_entropy, compiled)
        return torch.stack([lp, ent], dim=-1).view(b, r, 2).transpose(0, 1), None

    handles = [head.register_forward_pre_hook(before, with_kwargs=True),
               head.register_forward_hook(after, with_kwargs=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def run_model(model: Any, micro: Batch, multiple: int, head_chunk: int = 0, with_entropy: bool = True,
              temperature: float = 1.0, compiled_head: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One model chunk's forward pass on ``micro``: (its output: logits (b, L, V/tp), values (b, L, 1) or,
    before the last pipeline stage, hidden states; the positions (b, R) that score the response tokens).
    ``head_chunk`` > 0 on a last stage with a language-model head: the output is the response tokens' log-probs
    and entropies (b, R, 2) from :func:`head_replaced`, never the logits of every position (its element-wise
    work compiled where ``compiled_head``: ``use_torch_compile``)."""
    import torch

    ids, where = right_aligned(micro, multiple)
    positions = torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids)
    inner = getattr(model, "module", model)  # megatron's DDP wraps a trainable chunk
    if head_chunk and inner.post_process and is_lm_head(inner.output_layer):
        responses = micro["responses"].to(ids.device)
        with head_replaced(inner.output_layer, where, responses, float(temperature), head_chunk, with_entropy,
                           compiled_head):
            return model(ids, positions, None), where
    return model(ids, positions, None), where


def is_lm_head(layer: Any) -> bool:
    from megatron.core.tensor_parallel import ColumnParallelLinear

    return isinstance(layer, ColumnParallelLinear)


def model_outputs(output: torch.Tensor, where: torch.Tensor, micro: Batch, *, value_head: bool,
                  with_entropy: bool, head_done: bool = False, temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """A role's per-token outputs (b, R) from the last stage's output, 0 at padding: ``values``, or
    ``log_probs`` (and ``entropy``) at ``temperature`` from this TP rank's vocabulary shard
    (``head_done``: the output already holds them, from :func:`run_model`'s chunked head)."""
    from megatron.core import parallel_state as mpu

    mask = micro["response_mask"].to(output.device)
    if value_head:
        values = output.float().gather(1, where[..., None]).squeeze(-1)
        return {"values": values * mask}
    if head_done:
        out = {"log_probs": output[..., 0] * mask}
        if with_entropy:
            out["entropy"] = output[..., 1] * mask
        return out
    logits = output.gather(1, where[..., None].expand(-1, -1, output.shape[-1]))  # (b, R, V/tp)
    logits = logits.float() / float(temperature)
    vocab_start = mpu.get_tensor_model_parallel_rank() * output.shape[-1]
    log_probs, entropy = vocab_parallel_log_probs(logits, micro["responses"].to(output.device),
                                                  mpu.get_tensor_model_parallel_group(), vocab_start, with_entropy)
    out = {"log_probs": log_probs * mask}
    if entropy is not None:
        out["entropy"] = entropy * mask
    return out


# -- compiled layers ------------------------------------------------------------------------------------------
def compile_layers(chunks: list[Any]) -> int:
    """``actor.use_torch_compile`` (``critic.``) on this backend: each decoder layer of each chunk
    ``torch.compile``d in place with dynamic shapes (micro-batches change length), as the torch and fsdp2
    backends compile theirs; without Transformer Engine, megatron-core's local layers run their norms, rotary
    embedding, activation and residual additions as separate kernels, which the compiler fuses. Returns how many
    layers were compiled."""
    _quiet_group_lookup()
    count = 0
    for chunk in chunks:
        decoder = getattr(getattr(chunk, "module", chunk), "decoder", None)
        for layer in getattr(decoder, "layers", None) or []:
            layer.compile(dynamic=True)
            count += 1
    return count


def _quiet_group_lookup() -> None:
    """megatron-core's layers look up their tensor-parallel group on every call through
    ``get_tensor_model_parallel_group_if_none``, which also raises a deprecation warning each time; a warning
    inside a compiled region splits its graph (twice per linear layer). Every megatron-core module's reference
    to that helper is pointed at the same lookup without the warning."""
    import sys

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core import utils as mcore

    original = getattr(mcore, "_rlx_warning_group_lookup", mcore.get_tensor_model_parallel_group_if_none)

    def group_if_none(tp_group: Any, is_expert: bool = False, check_initialized: bool = True) -> Any:
        if not dist.is_initialized():
            return None
        if not parallel_state.is_initialized() or tp_group is not None:
            return tp_group
        if is_expert:
            return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
        return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)

    mcore._rlx_warning_group_lookup = original  # type: ignore[attr-defined]
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "get_tensor_model_parallel_group_if_none",
                                                        None) is original:
            module.get_tensor_model_parallel_group_if_none = group_if_none  # type: ignore[attr-defined]


# -- megatron-core's optimizer without Transformer Engine or Apex --------------------------------------------
def _foreach_l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], per_tensor: bool,
                     *args: Any) -> tuple[torch.Tensor, None]:
    """The total L2 norm of a list of tensors, as a (1,) float32 tensor on the device, from torch's
    multi-tensor norm (megatron-core's fallback reads every tensor's norm to the host, one sync each)."""
    import torch

    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device="cuda"), None
    norms = torch._foreach_norm(tensors)  # each in its tensor's dtype
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1), None


def _foreach_scale(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], scale: float) -> None:
    """dst = src * scale over two lists of tensors (dtypes may differ: float32 master weights into bf16
    parameters) with torch's multi-tensor kernels (megatron-core's fallback: two kernels per tensor)."""
    import torch

    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def use_torch_kernels(optimizer: Any) -> None:
    """Where neither Transformer Engine nor Apex is installed, megatron-core falls back to torch's AdamW in its
    default (per-group foreach) form and to Python loops for the gradient norm and the master-weight copies.
    Run the same arithmetic on torch's fused AdamW and multi-tensor kernels: the fallback's norm alone waits
    for the GPU once per parameter tensor."""
    import torch
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    if getattr(clip_grads, "l2_norm_impl", None) is getattr(mcore_utils, "local_multi_tensor_l2_norm", 0):
        clip_grads.l2_norm_impl = _foreach_l2_norm
    local_scale = getattr(mcore_utils, "local_multi_tensor_scale", 0)
    for module in (clip_grads, mcore_optimizer):
        if getattr(module, "multi_tensor_scale_impl", None) is local_scale:
            module.multi_tensor_scale_impl = _foreach_scale
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue  # Transformer Engine's or Apex's fused Adam: already one kernel
        params = [p for group in inner.param_groups for p in group["params"]]
        if params and all(p.is_cuda and p.dtype == torch.float32 for p in params):
            for group in inner.param_groups:
                group["fused"], group["foreach"] = True, False
            for p in params:  # a resumed state's step counts, as the fused kernel reads them: on the device
                state = inner.state.get(p, {})
                if isinstance(state.get("step"), torch.Tensor) and not state["step"].is_cuda:
                    state["step"] = state["step"].to(p.device, torch.float32)


# -- the worker -----------------------------------------------------------------------------------------
class MegatronWorker:
    """One role's model on this rank's share of a megatron-core layout (GPU only)."""

    def __init__(self, spec: RoleSpec, options: MegatronOptions, device: str = "auto") -> None:
        import torch
        from megatron.core import parallel_state as mpu

        from rlx.plugins.backends.megatron_convert import (
            build_chunks,
            check_architecture,
            load_hf,
            make_bridge,
            read_hf_config,
        )
        from rlx.plugins.modeling.dist import rank_device
        from rlx.plugins.modeling.model import pick_device

        require_megatron()
        if pick_device(device) == "cpu":
            raise UserError("--backend megatron needs NVIDIA GPUs: megatron-core's layers, pipeline transfers and "
                            "random-state tracking are CUDA-only.",
                            "Use --backend fsdp2 or torch on the CPU.")
        self.spec, self.options = spec, options
        if options.num_threads:
            torch.set_num_threads(options.num_threads)
        from rlx.run.models import apply_config_overrides

        self.hf_config = apply_config_overrides(read_hf_config(spec.model_path, spec.trust_remote_code),
                                                spec.config_overrides)
        check_architecture(self.hf_config, spec.model_path)
        check_engine(options)
        # The rank's GPU is current before megatron-core creates its NCCL groups and CUDA random states.
        self.device = rank_device(device)
        init_parallel(options, self.device, spec.seed)
        check_layout(options, None, self.hf_config)
        self.comm_device = "cuda" if self.device.startswith("cuda") else "cpu"
        torch.manual_seed(spec.seed)
        self.tp_rank, self.tp_size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
        self.pp_size = mpu.get_pipeline_model_parallel_world_size()
        self.dp_rank, self.dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
        self.last_stage = mpu.is_pipeline_last_stage(ignore_virtual=True)
        self.compute_dtype = getattr(torch, resolve_dtype(spec.dtype, self.device))
        overrides = config_overrides(options, self.compute_dtype, on_cpu=False)
        if spec.trainable and spec.gradient_checkpointing and options.recompute_granularity is None:
            # model.gradient_checkpointing=true: recompute every layer, as the other backends do
            overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        self.bridge = make_bridge(self.hf_config, self.compute_dtype, overrides)
        self.chunks = build_chunks(self.bridge, self.hf_config, value_head=spec.value_head,
                                   use_te=has_transformer_engine(), vpp=options.virtual_pipeline_model_parallel_size,
                                   device=self.device)
        load_hf(self.chunks, self.bridge, self.hf_config, spec.model_path, value_head=spec.value_head,
                seed=spec.seed)
        if spec.forward.use_torch_compile:
            compile_layers(self.chunks)
        self.update_budget, self.forward_budget = spec.forward.update_budget, spec.forward.forward_budget
        # actor.log_prob_chunk_size: the head's logits a chunk of response positions at a time (0: all at once)
        self.head_chunk = 0 if spec.value_head else int(spec.forward.log_prob_chunk_size)
        self.steps = 0
        self.optimizer: Any = None
        if spec.trainable:
            self._set_up_training()
        else:
            for chunk in self.chunks:
                chunk.eval()
                chunk.requires_grad_(False)
            self.model = self.chunks

    def _set_up_training(self) -> None:
        """megatron-core's DDP (fp32 gradient buffers summed over the DP group) around each chunk and its
        optimizer (fp32 master weights of bf16 parameters; sharded over DP with the distributed optimizer)."""
        import torch
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        spec, options = self.spec, self.options
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=options.use_distributed_optimizer)
        self.model = [DistributedDataParallel(config=self.bridge.config, ddp_config=ddp_config, module=chunk,
                                              disable_bucketing=i > 0) for i, chunk in enumerate(self.chunks)]
        for m in self.model:
            m.train()
        bf16 = self.compute_dtype == torch.bfloat16
        config = OptimizerConfig(optimizer="adam", lr=spec.lr, min_lr=0.0, weight_decay=spec.weight_decay,
                                 adam_beta1=spec.betas[0], adam_beta2=spec.betas[1], adam_eps=1e-8,
                                 clip_grad=spec.grad_clip, bf16=bf16, params_dtype=self.compute_dtype,
                                 use_distributed_optimizer=options.use_distributed_optimizer)
        self.optimizer = get_megatron_optimizer(config, self.model)
        if self.device.startswith("cuda"):
            use_torch_kernels(self.optimizer)

    def dispatch_info(self) -> DispatchInfo:
        return DispatchInfo(self.dp_rank, self.dp_size, self.tp_rank == 0 and self.last_stage)

    # -- the engine primitives rlx.step's shared loops use ---------------------------------------
    def to_device(self, micro: Batch) -> Batch:
        return micro.to(self.device)

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        if self.dp_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM,
                        group=mpu.get_data_parallel_group())
        return [float(v) for v in t.tolist()]

    def _run_chunk(self, model: Any, micro: Batch, with_entropy: bool = True,
                   temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        return run_model(model, micro, self.tp_size if self.options.sequence_parallel else 1, self.head_chunk,
                         with_entropy, temperature, compiled_head=self.spec.forward.use_torch_compile)

    def _outputs(self, output: torch.Tensor, where: torch.Tensor, micro: Batch, with_entropy: bool,
                 temperature: float = 1.0) -> dict[str, torch.Tensor]:
        return model_outputs(output, where, micro, value_head=self.spec.value_head, with_entropy=with_entropy,
                             head_done=self.head_chunk > 0, temperature=temperature)

    def forward(self, micro: Batch, *, grad: bool, entropy_grad: bool = True,
                temperature: float = 1.0) -> dict[str, torch.Tensor]:
        import contextlib

        import torch

        with contextlib.nullcontext() if grad else torch.no_grad():
            output, where = self._run_chunk(self.model[0], micro, True, temperature)
            out = self._outputs(output, where, micro, True, temperature)
        if not entropy_grad:
            out["entropy"] = out["entropy"].detach()
        return out

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def zero_grad(self) -> None:
        assert self.optimizer is not None, f"role {self.spec.role} is not trainable"
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self) -> tuple[float, bool, float]:
        """Sum gradients over DP (and the SP-replicated and tied-embedding ones over TP/PP), clip to the
        global norm over every shard, skip a non-finite step, step at this run's schedule."""
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        from rlx.plugins.modeling.model import lr_lambda

        assert self.optimizer is not None
        finalize_model_grads(self.model)
        found_inf = self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm())
        applied = not found_inf and math.isfinite(norm)
        lr = self.spec.lr * lr_lambda(self.spec)(self.steps)
        if applied:
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                clip_grad_by_total_norm_fp32(opt.get_parameters(), self.spec.grad_clip, norm)
                for group in opt.param_groups:
                    group["lr"] = lr
            applied = bool(self.optimizer.step_with_ready_grads())
        if not applied:  # a bad batch must not poison the weights
            self.zero_grad()
        self.steps += 1
        return norm, applied, lr

    # -- inference and training ------------------------------------------------------------------------
    def _eval(self, fn: Any) -> Any:
        import torch

        modes = [m.training for m in self.model]
        for m in self.model:
            m.eval()
        try:
            with torch.no_grad():
                return fn()
        finally:
            for m, mode in zip(self.model, modes):
                m.train(mode)

    def _forward_batch(self, batch: Batch, with_entropy: bool, temperature: float = 1.0) -> Batch:
        from rlx.batch import Batch
        from rlx.plugins.modeling.model import forward_micro_batch_size
        from rlx.step import MODEL_COLUMNS, micro_batches, run_forward

        size = forward_micro_batch_size(self.spec)
        if self.pp_size == 1:
            def one(mb: Batch) -> dict[str, torch.Tensor]:
                output, where = self._run_chunk(self.model[0], mb, with_entropy, temperature)
                return {k: v.cpu() for k, v in self._outputs(output, where, mb, with_entropy, temperature).items()}

            return self._eval(lambda: Batch(run_forward(self, batch, size, one, budget=self.forward_budget)))
        parts = micro_batches(self, batch.select(*MODEL_COLUMNS), size, self.forward_budget)
        results = self._eval(lambda: self._pipeline([mb for _, mb in parts], None, with_entropy,
                                                    temperature=temperature))
        if not self.last_stage or not results:
            return Batch({})
        import torch

        out = {k: torch.cat([r[k] for r in results]) for k in results[0]}
        if self.forward_budget is not None:
            order = torch.tensor([i for rows, _ in parts for i in rows or []])
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(len(order))
            out = {k: v[inverse] for k, v in out.items()}
        return Batch(out)

    def compute_log_probs(self, batch: Batch, with_entropy: bool = False, temperature: float = 1.0,
                          with_sum_pi_squared: bool = False) -> Batch:
        assert not self.spec.value_head, f"role {self.spec.role} is a value model"
        if with_sum_pi_squared:
            raise UserError("the megatron backend does not compute sum_pi_squared (the optimal-token-baseline "
                            "estimators need it).", "Use backend.name=torch, fsdp or fsdp2, or another estimator.")
        return self._forward_batch(batch, with_entropy, temperature)

    def compute_values(self, batch: Batch) -> Batch:
        assert self.spec.value_head, f"role {self.spec.role} has no value head"
        return self._forward_batch(batch, False)

    def update(self, minibatches: list[Batch], loss_fn: LossFn,
               context: UpdateContext | None = None) -> list[dict[str, float]]:
        from rlx.step import run_update

        for m in self.model:
            m.train()
        if self.pp_size == 1:
            return run_update(self, minibatches, loss_fn, self.spec.micro_batch_size, budget=self.update_budget,
                              context=context)
        return [self._pipeline_update(mini, loss_fn, context or UpdateContext()) for mini in minibatches]

    def train_step(self, batch: Batch, loss_fn: LossFn, context: UpdateContext | None = None) -> dict[str, float]:
        return self.update([batch], loss_fn, context)[0]

    # -- pipeline parallelism: megatron-core's schedules ------------------------------------------------
    def _pipeline(self, micros: list[Batch], loss_fn: LossFn | None, with_entropy: bool,
                  entropy_grad: bool = True, temperature: float = 1.0,
                  loss_context: LossContext | None = None) -> list[Any]:
        """Run ``micros`` through megatron-core's pipeline schedule (1F1B, or interleaved with virtual
        stages). ``loss_fn`` None: forward only, each micro-batch's outputs (on the CPU) come back on the last
        stage. Otherwise forward and backward with the algorithm's loss; (metrics, token weight) per
        micro-batch come back on the last stage."""
        import torch
        from megatron.core.pipeline_parallel import get_forward_backward_func

        micros = [self.to_device(mb) for mb in micros]
        if not micros:
            return []
        chunks = len(self.model)
        if chunks > 1 and len(micros) % self.pp_size:
            raise UserError(f"The interleaved pipeline schedule needs a multiple of pipeline_model_parallel_size="
                            f"{self.pp_size} micro-batches per call; this one has {len(micros)}.",
                            "Choose the micro-batch sizes (actor.micro_batch_size_per_device, "
                            "log_prob_micro_batch_size_per_device) so that each rank's rows make a multiple of "
                            "the pipeline stages, or leave virtual_pipeline_model_parallel_size unset.")

        def step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
            micro = next(data_iterator)
            output, where = self._run_chunk(model, micro, with_entropy, temperature)

            def loss_func(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
                outputs = self._outputs(out, where, micro, with_entropy, temperature)
                if not entropy_grad and "entropy" in outputs:
                    outputs["entropy"] = outputs["entropy"].detach()
                if loss_fn is None:
                    return (out.sum() * 0.0, torch.ones((), dtype=torch.int, device=out.device),
                            {k: v.detach().cpu() for k, v in outputs.items()})
                loss, metrics = loss_fn(outputs, micro, loss_context)
                weight = float(trained_mask(micro).sum())
                return loss, torch.ones((), dtype=torch.int, device=out.device), ({k: float(v) for k, v in
                                                                                   metrics.items()}, weight)

            return output, loss_func

        multiple = self.tp_size if self.options.sequence_parallel else 1
        longest = max(right_aligned(mb, multiple)[0].shape[1] for mb in micros)
        iterators = [iter(micros) for _ in range(chunks)]
        return get_forward_backward_func()(
            forward_step_func=step, data_iterator=iterators if chunks > 1 else iterators[0],
            model=self.model if chunks > 1 else self.model[0], num_microbatches=len(micros),
            seq_length=longest, micro_batch_size=max(len(mb) for mb in micros), forward_only=loss_fn is None)

    def _pipeline_update(self, mini: Batch, loss_fn: LossFn, context: UpdateContext) -> dict[str, float]:
        """One optimizer step over a mini-batch: the shared step's cut and counts, megatron-core's schedule."""
        from rlx.step import loss_context, micro_batches

        ctx = loss_context(self, mini, context)
        self.zero_grad()
        parts = [mb for _, mb in micro_batches(self, mini, self.spec.micro_batch_size, self.update_budget)]
        entropy_grad = bool(getattr(loss_fn, "needs_entropy_grad", True))
        results = self._pipeline(parts, loss_fn, True, entropy_grad, context.temperature, ctx)
        grad_norm, applied, lr = self.optimizer_step()
        sums: dict[str, float] = {}
        weight = 0.0
        for metrics, w in results if self.last_stage else []:
            weight += w
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v * w
        keys = sorted(sums)
        *totals, weight = self.all_reduce([sums[k] for k in keys] + [weight])
        step = {k: v / max(weight, 1.0) for k, v in zip(keys, totals)}
        step.update(grad_norm=grad_norm, lr=lr, skipped_step=float(not applied))
        return step

    # -- weights ----------------------------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors with Hugging Face names, one at a time, on every rank (every rank of the model-parallel
        group must iterate: pipeline stages broadcast, tensor-parallel shards are all-gathered)."""
        from rlx.plugins.backends.megatron_convert import export_hf

        yield from export_hf(self.chunks, self.bridge, self.hf_config, value_head=self.spec.value_head,
                             comm_device=self.comm_device)

    def save_pretrained(self, path: str, tokenizer: Any = None) -> None:
        """Rank 0 writes a Hugging Face folder from the gathered weights; the others take part in the gathers."""
        import torch.distributed as dist

        from rlx.plugins.backends.megatron_convert import write_hf_folder

        rank = dist.get_rank()
        state = {}
        for name, tensor in self.named_weights():
            if rank == 0:
                state[name] = tensor.to("cpu", copy=True)
        if rank == 0:
            write_hf_folder(path, self.hf_config, state, value_head=self.spec.value_head, tokenizer=tokenizer)
        del state
        dist.barrier()

    # -- checkpoints: megatron-core's distributed checkpointing -------------------------------------------
    def _sharded_state(self, loading: bool) -> dict[str, Any]:
        model = {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(self.chunks)}
        if self.optimizer is None:
            return model
        # Nested per chunk: virtual stages hold the same local names.
        return {**model, "optimizer": self.optimizer.sharded_state_dict(model, is_loading=loading)}

    def save_checkpoint(self, path: str) -> None:
        """All ranks write their shards with ``dist_checkpointing`` (``path/dist``, resharded on load for another
        layout) and their own step count and RNG states (``path/rank{r}.pt``)."""
        import torch
        import torch.distributed as dist
        from megatron.core import dist_checkpointing, tensor_parallel

        from rlx.plugins.backends.megatron_convert import DIST_DIR

        folder = os.path.join(path, DIST_DIR)
        if dist.get_rank() == 0:
            os.makedirs(folder, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(self._sharded_state(loading=False), folder)
        local = {"steps": torch.tensor(self.steps), "cpu_rng": torch.get_rng_state(),
                 "cuda_rng": torch.cuda.get_rng_state(),
                 "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
        torch.save(local, os.path.join(path, f"rank{dist.get_rank()}.pt"))
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        import torch
        import torch.distributed as dist
        from megatron.core import dist_checkpointing, tensor_parallel

        from rlx.plugins.backends.megatron_convert import DIST_DIR
        from rlx.run.checkpoint import torch_load

        folder = os.path.join(path, DIST_DIR)
        if not os.path.isdir(folder):
            raise UserError(f"{folder} is missing: {path} was not written by the megatron backend (or is damaged).",
                            "Resume with the backend that wrote the checkpoint.")
        try:
            state = dist_checkpointing.load(self._sharded_state(loading=True), folder)
        except Exception as exc:  # dist_checkpointing reports a damaged or mismatched folder in many types
            raise UserError(f"Cannot load {folder} into the {self.spec.role} model: {exc}",
                            "Resume from another checkpoint, with the model the run was started with.") from None
        for i, chunk in enumerate(self.chunks):
            chunk.load_state_dict(state[f"model{i}"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            if self.device.startswith("cuda"):
                use_torch_kernels(self.optimizer)  # the saved groups replace the loaded ones' settings
        own = os.path.join(path, f"rank{dist.get_rank()}.pt")
        local = torch_load(own if os.path.exists(own) else os.path.join(path, "rank0.pt"))
        self.steps = int(local["steps"])
        if os.path.exists(own):
            torch.set_rng_state(local["cpu_rng"])
            torch.cuda.set_rng_state(local["cuda_rng"])
            tensor_parallel.get_cuda_rng_tracker().set_states(local["tracker"])
        else:  # a rank that did not exist when the checkpoint was written
            torch.manual_seed(self.spec.seed + dist.get_rank())


class MegatronBackend:
    """Builds :class:`MegatronWorker` s for roles; picklable so process launchers can ship it."""

    def __init__(self, options: MegatronOptions, device: str, settings: dict[str, RoleSettings] | None = None
                 ) -> None:
        self.options, self.device, self.settings = options, device, settings or {}

    def worker(self, spec: RoleSpec, rank: int = 0, world_size: int = 1) -> MegatronWorker:
        from rlx.plugins.modeling.model import with_role_settings

        return MegatronWorker(with_role_settings(spec, self.settings), self.options, self.device)


def _training_processes(ctx: BuildContext) -> int | None:
    """The training pool's size when the launcher says it (``--nproc``; torchrun's WORLD_SIZE)."""
    if ctx.config is None:
        return None
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("WORLD_SIZE"):  # under torchrun: one pool
        return int(os.environ["WORLD_SIZE"])
    nproc = ctx.config.launcher.options().get("nproc")
    return int(nproc) if nproc is not None else 1


def build(options: MegatronOptions | None, ctx: BuildContext) -> MegatronBackend:
    """Checks what can be checked before any process starts: megatron-core and mbridge installed, the layout
    against the processes, the model's architecture, heads and layers."""
    from rlx.plugins.backends.megatron_convert import check_architecture, read_hf_config
    from rlx.plugins.modeling.model import settings_of

    options = options or MegatronOptions()
    require_megatron()
    device = ctx.config.trainer.device if ctx.config is not None else "auto"
    if device == "cpu":
        raise UserError("--backend megatron needs NVIDIA GPUs (trainer.device=cpu was given): megatron-core's "
                        "layers are CUDA-only.", "Use --backend fsdp2 or torch on the CPU.")
    hf_config = None
    if ctx.config is not None:
        path = ctx.config.model.path
        from rlx.run.data import resolve_path

        path = resolve_path(path)
        from rlx.run.models import apply_config_overrides

        hf_config = apply_config_overrides(read_hf_config(path, ctx.config.model.trust_remote_code),
                                           ctx.config.model.override_config)
        check_architecture(hf_config, path)
    check_layout(options, _training_processes(ctx), hf_config)
    check_engine(options)
    settings = settings_of(ctx)
    problems = settings_problems(settings)
    if problems:
        raise UserError("The megatron backend cannot run this config: " + "; ".join(problems) + ".",
                        "Turn these settings off, or use --backend fsdp2.")
    return MegatronBackend(options, device, settings)


MEGATRON_INSTALL = "pip install 'rlx[megatron]' (megatron-core and mbridge)"


@hookimpl
def rlx_train_backends() -> list[Component]:
    # rlx export reads the distributed checkpoints on the CPU without building the backend (extra's key
    # "export_checkpoint", see rlx.components.Component).
    return [Component(kind="backend", name="megatron", factory=build, config_model=MegatronOptions,
                      summary="megatron-core GPT models (Qwen2, Llama): tensor and pipeline parallelism, "
                              "bf16 with fp32 master weights, distributed checkpoints; GPUs only.",
                      extra={**CONFIG_PROBLEMS,
                             "requires": [Requirement("megatron.core", "megatron-core", MEGATRON_INSTALL),
                                          Requirement("mbridge", "mbridge", MEGATRON_INSTALL)],
                             "export_checkpoint": "rlx.plugins.backends.megatron_convert:export_checkpoint"})]
