"""Hugging Face <-> megatron-core for the ``megatron`` backend: architecture checks, the GPT model's
construction from a Hugging Face folder, and the weight conversion in both directions.

The per-tensor format (Megatron's fused QKV, grouped by key/value head for GQA; the fused gate/up
projection; how each fused tensor is cut over tensor-parallel ranks) and the ``TransformerConfig`` built
from a Hugging Face config come from ``mbridge`` (the bridge library: pure Python, runs without CUDA,
Transformer Engine or apex; ``megatron-bridge`` needs Transformer Engine and pins an older transformers).
What is device- and process-specific is done here with plain ``torch.distributed`` calls, so it works on
gloo as well as NCCL: mbridge's own loader and exporter allocate on ``torch.cuda.current_device()``. The
names of megatron-core's local layers (separate ``input_layernorm`` / ``pre_mlp_layernorm``, used without
Transformer Engine) and of the critic's value head are mapped here too.

Nothing here imports torch at module level.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from rlx.errors import UserError

if TYPE_CHECKING:
    import torch

# Hugging Face model types the bridge maps and this backend has been written for.
SUPPORTED_TYPES = ("qwen2", "llama")
# Llama 3.1-style rope scaling with these constants is what megatron-core's ``rope_scaling`` implements.
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
VALUE_HEAD = ("score.weight", "score.bias")


def read_hf_config(path: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UserError(f"Cannot read the model config of {path!r}: {exc}",
                        "Give model.path a Hugging Face model folder (config.json and safetensors).") from None


def rope_settings(hf_config: Any) -> dict[str, Any]:
    """GPTModel's rotary arguments for a Hugging Face config (transformers 5 keeps them in
    ``rope_parameters``, older releases in ``rope_theta``/``rope_scaling``)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling and not params.get("rope_type"):
        params.update(scaling)
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    out: dict[str, Any] = {"rotary_base": float(theta)}
    if kind == "default":
        return out
    if kind == "llama3" and all(float(params.get(k, v)) == v for k, v in _LLAMA3_ROPE.items()):
        out.update(rope_scaling=True, rope_scaling_factor=float(params["factor"]))
        return out
    raise UserError(f"The megatron backend cannot run rope type {kind!r} with {params} (megatron-core "
                    "implements plain rotary embeddings and Llama 3.1 scaling with factors 1/4/8192).",
                    "Use --backend fsdp2 or torch for this model.")


def check_architecture(hf_config: Any, path: str) -> None:
    """A model the bridge maps and megatron-core's GPT model reproduces, or a UserError."""
    kind = getattr(hf_config, "model_type", None)
    if kind not in SUPPORTED_TYPES:
        raise UserError(f"The megatron backend does not support the model type {kind!r} of {path!r} "
                        f"(supported: {', '.join(SUPPORTED_TYPES)}).",
                        "Use --backend fsdp2 or torch for this model.")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise UserError(f"{path!r} uses the activation {hf_config.hidden_act!r}; the megatron backend maps "
                        "SwiGLU (silu) models only.", "Use --backend fsdp2 or torch for this model.")
    if kind == "qwen2" and (getattr(hf_config, "use_sliding_window", False)
                            or "sliding_attention" in (getattr(hf_config, "layer_types", None) or [])):
        raise UserError(f"{path!r} uses sliding-window attention, which the megatron backend does not map.",
                        "Use --backend fsdp2 or torch for this model.")
    if kind == "llama" and getattr(hf_config, "mlp_bias", False):
        raise UserError(f"{path!r} has biases in its MLP, which the megatron backend does not map.",
                        "Use --backend fsdp2 or torch for this model.")
    rope_settings(hf_config)


def make_bridge(hf_config: Any, dtype: torch.dtype, overrides: dict[str, Any]) -> Any:
    """mbridge's bridge for ``hf_config`` on the current megatron parallel state, its TransformerConfig
    built with ``overrides`` (parallel layout, precision, recomputation)."""
    from mbridge import AutoBridge

    bridge = AutoBridge.from_config(hf_config, dtype=dtype)
    bridge.set_extra_args(**overrides)
    return bridge


def layer_spec(config: Any, use_te: bool, vp_stage: int | None) -> Any:
    """Transformer Engine's fused layers when ``use_te``, else megatron-core's local (plain torch) layers."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    if use_te:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
    return get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)


def _value_head_class() -> type:
    import torch

    class ValueHead(torch.nn.Module):
        """The critic's head in place of ``output_layer``: one output per position (``score`` of a Hugging
        Face ``*ForTokenClassification``), replicated on the tensor-parallel ranks. Under sequence
        parallelism each rank scores its slice of the sequence, the slices are gathered, and the head's
        gradients are summed over the tensor-parallel group (``sequence_parallel`` marks them for
        megatron-core's ``finalize_model_grads``)."""

        def __init__(self, hidden: int, sequence_parallel: bool, dtype: torch.dtype) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype))
            self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
            self.sequence_parallel = sequence_parallel
            for p in (self.weight, self.bias):
                p.sequence_parallel = sequence_parallel

        def forward(self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
                    ) -> tuple[torch.Tensor, None]:
            out = torch.nn.functional.linear(hidden, self.weight, self.bias)  # (s, b, 1)
            if self.sequence_parallel:
                from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

                # Every rank computes the same loss on the gathered values: the backward pass keeps each
                # rank's own slice of the gradient instead of summing identical copies.
                out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)
            return out, None

    return ValueHead


def build_chunks(bridge: Any, hf_config: Any, *, value_head: bool, use_te: bool, vpp: int | None,
                 device: str) -> list[Any]:
    """This rank's model chunks (one, or one per virtual pipeline stage): megatron-core GPT models holding
    its pipeline stage's layers and its tensor-parallel shards, on ``device``, not yet loaded."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel

    config = bridge.config
    tied = bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_head
    chunks = []
    for stage in range(vpp or 1):
        vp_stage = stage if vpp else None
        pre = mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = GPTModel(config=config, transformer_layer_spec=layer_spec(config, use_te, vp_stage),
                         vocab_size=hf_config.vocab_size, max_sequence_length=hf_config.max_position_embeddings,
                         pre_process=pre, post_process=post, share_embeddings_and_output_weights=tied,
                         position_embedding_type="rope", vp_stage=vp_stage, **rope_settings(hf_config))
        if value_head and post:
            model.output_layer = _value_head_class()(config.hidden_size, config.sequence_parallel,
                                                     config.params_dtype)
        model.model_type = getattr(model, "model_type", None) or _encoder_or_decoder()
        chunks.append(model.to(device))
    return chunks


def _encoder_or_decoder() -> Any:
    from megatron.core.enums import ModelType

    return ModelType.encoder_or_decoder


# -- names ----------------------------------------------------------------------------------------------
def global_names(chunk: Any) -> dict[str, str]:
    """Local parameter name -> its name in the whole model (a pipeline stage numbers its layers from 0)."""
    layers = {i: layer.layer_number - 1 for i, layer in enumerate(chunk.decoder.layers)} \
        if hasattr(chunk, "decoder") else {}
    out = {}
    for name in chunk.state_dict():
        if "_extra_state" in name:
            continue
        if name.startswith("decoder.layers."):
            index = int(name.split(".")[2])
            name_global = name.replace(f"decoder.layers.{index}.", f"decoder.layers.{layers[index]}.", 1)
        else:
            name_global = name
        out[name] = name_global
    return out


def hf_names(bridge: Any, name: str, *, tied: bool, value_head: bool) -> list[str]:
    """The Hugging Face tensors that make up the megatron-core tensor ``name`` (a global name)."""
    if name.startswith("output_layer."):
        if value_head:
            return ["score." + name.split(".", 1)[1]]
        return ["model.embed_tokens.weight" if tied else "lm_head.weight"]
    if name.startswith("decoder.layers."):
        layer = name.split(".")[2]
        if name.endswith(".input_layernorm.weight"):
            return [f"model.layers.{layer}.input_layernorm.weight"]
        if name.endswith(".pre_mlp_layernorm.weight"):
            return [f"model.layers.{layer}.post_attention_layernorm.weight"]
    return list(bridge._weight_name_mapping_mcore_to_hf(name))


def _is_tp_sharded(param: Any) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


# -- HF -> Megatron ---------------------------------------------------------------------------------------
class HFReader:
    """Tensors of a Hugging Face folder by name (one or several safetensors files), read lazily."""

    def __init__(self, folder: str) -> None:
        from safetensors import safe_open

        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        self.where: dict[str, Any] = {}
        self.handles = []
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.exists(path):
                raise UserError(f"{path} is missing: the megatron backend reads safetensors weights.",
                                "Give model.path a folder saved with safe_serialization (the default).")
            handle = safe_open(path, framework="pt")
            self.handles.append(handle)
            names = handle.keys()
            for key in names:
                self.where[key] = handle

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise UserError(f"The model folder has no tensor {name!r}.",
                            "Give model.path a complete Hugging Face Qwen2 or Llama folder.")
        return self.where[name].get_tensor(name)


def load_hf(chunks: list[Any], bridge: Any, hf_config: Any, folder: str, *, value_head: bool,
            seed: int) -> None:
    """Copy a Hugging Face folder's weights into this rank's chunks. Tensor-parallel rank 0 reads and
    converts each tensor and scatters the shards over the tensor-parallel group (gloo or NCCL). A critic
    whose folder has no ``score`` head gets a new one: normal(0, initializer_range) from ``seed``, bias 0
    (as transformers initialises it)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    tp_size, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    group = mpu.get_tensor_model_parallel_group()
    src = dist.get_global_rank(group, 0)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_head
    if tp_rank == 0 and not os.path.isdir(folder):  # a hub id: its files from the Hugging Face cache
        from huggingface_hub import snapshot_download

        folder = snapshot_download(folder, allow_patterns=["*.safetensors", "*.json"])
    reader = HFReader(folder) if tp_rank == 0 else None
    for chunk in chunks:
        state = chunk.state_dict()
        for local, name in global_names(chunk).items():
            param = state[local]
            names = hf_names(bridge, name, tied=tied, value_head=value_head)
            parts: list[torch.Tensor] | None = None
            if reader is not None:
                if value_head and names[0] in VALUE_HEAD and names[0] not in reader:
                    full = _new_head(names[0], param, hf_config, seed)
                else:
                    full = bridge._weight_to_mcore_format(name, [reader.get(n) for n in names])
                parts = [full] if tp_size == 1 else list(bridge._weight_split_across_tp(name, full, param, tp_size))
                parts = [p.to(param.device, param.dtype).contiguous() for p in parts]
                for p in parts:
                    if p.shape != param.shape:
                        raise UserError(f"{folder}: {names} give a {tuple(p.shape)} shard for {name} "
                                        f"{tuple(param.shape)}.", "The folder does not match its config.json.")
            if tp_size == 1:
                assert parts is not None
                param.data.copy_(parts[0])
            else:
                shard = torch.empty_like(param.data)
                dist.scatter(shard, parts, src=src, group=group)
                param.data.copy_(shard)


def _new_head(name: str, param: Any, hf_config: Any, seed: int) -> torch.Tensor:
    import torch

    if name.endswith(".bias"):
        return torch.zeros(param.shape, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    std = float(getattr(hf_config, "initializer_range", 0.02))
    return torch.randn(tuple(param.shape), generator=gen, dtype=torch.float32) * std


# -- Megatron -> HF ---------------------------------------------------------------------------------------
def export_hf(chunks: list[Any], bridge: Any, hf_config: Any, *, value_head: bool,
              comm_device: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Full Hugging Face tensors, one megatron tensor at a time, on every rank: each pipeline stage's
    tensors are broadcast over the pipeline group (names first), tensor-parallel shards all-gathered and
    merged by the bridge. Every rank of the model-parallel group must iterate to the end. The tied output
    layer of a last stage is the embedding (already sent by the first stage) and is skipped."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    tp_size = mpu.get_tensor_model_parallel_world_size()
    tp_group, pp_group = mpu.get_tensor_model_parallel_group(), mpu.get_pipeline_model_parallel_group()
    pp_size, pp_rank = mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipeline_model_parallel_rank()
    tied = bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_head
    mine = []
    for chunk in chunks:
        # Parameters keep megatron-core's tensor-parallel attributes; state_dict() entries are plain views.
        tensors = {**chunk.state_dict(keep_vars=True), **dict(chunk.named_parameters())}
        for local, name in global_names(chunk).items():
            if tied and name == "output_layer.weight":
                continue
            mine.append((name, tensors[local]))
    listing: list[Any] = [None] * pp_size
    meta = [(n, tuple(t.shape), str(t.dtype).removeprefix("torch."), _is_tp_sharded(t),
             int(getattr(t, "partition_dim", 0))) for n, t in mine]
    if pp_size > 1:
        dist.all_gather_object(listing, meta, group=pp_group)
    else:
        listing = [meta]
    for stage, entries in enumerate(listing):
        own = dict(mine) if stage == pp_rank else {}
        for name, shape, dtype, sharded, dim in entries:
            if stage == pp_rank:
                t = own[name].detach()
            else:
                t = torch.empty(shape, dtype=getattr(torch, dtype), device=comm_device)
            if pp_size > 1:
                t = t.to(comm_device).contiguous()
                dist.broadcast(t, src=dist.get_global_rank(pp_group, stage), group=pp_group)
            if sharded and tp_size > 1:
                shards = [torch.empty_like(t) for _ in range(tp_size)]
                dist.all_gather(shards, t.contiguous(), group=tp_group)
                t = bridge._weight_merge_across_tp(name, shards, _Sharded(dim))
            names = hf_names(bridge, name, tied=tied, value_head=value_head)
            if len(names) == 1:
                yield names[0], t
            else:
                converted, tensors = bridge._weight_to_hf_format(name, t)
                if list(converted) != names:
                    raise RuntimeError(f"the bridge maps {name} to {converted}, expected {names}")
                yield from zip(converted, tensors)


class _Sharded:
    """What the bridge's merge reads of a parameter (which may live on another pipeline stage): its
    tensor-parallel split dimension."""

    def __init__(self, partition_dim: int) -> None:
        self.tensor_model_parallel = True
        self.partition_dim = partition_dim
