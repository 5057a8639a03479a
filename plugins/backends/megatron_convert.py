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
import warnings
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
# Where a checkpoint's ``dist_checkpointing`` shards lie, under the role's checkpoint folder.
DIST_DIR = "dist"
# The model's tensors in a distributed checkpoint (the optimizer's start with "optimizer.").
_MODEL_KEYS = ("embedding.", "decoder.", "output_layer.")


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


def make_bridge(hf_config: Any, dtype: torch.dtype, overrides: dict[str, Any], *, one_process: bool = False
                ) -> Any:
    """mbridge's bridge for ``hf_config`` on the current megatron parallel state, its TransformerConfig
    built with ``overrides`` (parallel layout, precision, recomputation). ``one_process``: for converting
    whole tensors in a process without megatron's groups (no layout at all)."""
    from mbridge import AutoBridge

    if one_process:
        from mbridge.core.parallel_states import ParallelStates

        bridge = AutoBridge.from_config(hf_config, dtype=dtype, parallel_states=ParallelStates())
    else:
        bridge = AutoBridge.from_config(hf_config, dtype=dtype)
    bridge.set_extra_args(**overrides)
    return bridge


def layer_spec(config: Any, use_te: bool, vp_stage: int | None) -> Any:
    """Transformer Engine's fused layers when ``use_te``, else megatron-core's local (plain torch) layers with
    PyTorch's fused attention (:func:`sdpa_attention_class`) as the attention core."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    if use_te:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
    spec.submodules.self_attention.submodules.core_attention = sdpa_attention_class()
    return spec


_SDPA: type | None = None


def sdpa_attention_class() -> type:
    """megatron-core's local ``DotProductAttention`` with its forward pass on
    ``torch.nn.functional.scaled_dot_product_attention`` (flash or memory-efficient kernels on a GPU, never
    the (query, key) score matrix in memory), for causal self-attention without dropout, mask or bias, as
    rlx runs it. Anything else (attention dropout, an explicit mask, query-key layer scaling, another
    softmax) takes megatron-core's own path. The weights, names and checkpoints are the parent's."""
    global _SDPA
    if _SDPA is not None:
        return _SDPA
    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SDPAttention(DotProductAttention):
        def _fused(self, attention_mask: Any, attn_mask_type: Any, attention_bias: Any,
                   packed_seq_params: Any) -> bool:
            kind = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            dropout = self.attention_dropout.p if self.training else 0.0
            return (attention_mask is None and attention_bias is None and packed_seq_params is None
                    and kind == AttnMaskType.causal and dropout == 0.0 and self.softmax_offset is None
                    and not self.config.apply_query_key_layer_scaling and self.scale_mask_softmax.window_size is None)

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                    attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None
                    ) -> torch.Tensor:
            if not self._fused(attention_mask, attn_mask_type, attention_bias, packed_seq_params):
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                       packed_seq_params)
            # [s, b, heads, d] -> [b, heads, s, d]; key/value hold the query groups (GQA)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            groups = q.size(1) // k.size(1)
            context = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=groups > 1)
            # [b, heads, s, d] -> [s, b, heads * d]
            return context.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), self.hidden_size_per_partition)

    _SDPA = SDPAttention
    return SDPAttention


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
            yield from to_hf(bridge, name, t, tied=tied, value_head=value_head)


def to_hf(bridge: Any, name: str, tensor: torch.Tensor, *, tied: bool, value_head: bool
          ) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors of one whole (tensor-parallel-merged) megatron-core tensor with global name
    ``name``: itself renamed, or a fused tensor (QKV, [gate; up]) cut by the bridge."""
    names = hf_names(bridge, name, tied=tied, value_head=value_head)
    if len(names) == 1:
        yield names[0], tensor
        return
    converted, tensors = bridge._weight_to_hf_format(name, tensor)
    if list(converted) != names:
        raise RuntimeError(f"the bridge maps {name} to {converted}, expected {names}")
    yield from zip(converted, tensors)


class _Sharded:
    """What the bridge's merge reads of a parameter (which may live on another pipeline stage): its
    tensor-parallel split dimension."""

    def __init__(self, partition_dim: int) -> None:
        self.tensor_model_parallel = True
        self.partition_dim = partition_dim


# -- a distributed checkpoint -> HF, in one process ---------------------------------------------------------
def read_checkpoint(folder: str, hf_config: Any, *, value_head: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The model weights of a ``dist_checkpointing`` folder (``torch_dist`` format: PyTorch's distributed
    checkpoint with megatron-core's keys) as full Hugging Face tensors, read on the CPU in this one process
    whatever layout wrote them: the shards of every TP/PP/DP rank are placed by their global offsets when read,
    and the layers of one name are stacked along a leading axis (one entry per layer). One tensor in memory at
    a time, in the dtype it was saved in (a bf16 run's parameters, not its fp32 master copies)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from rlx.plugins.modeling.dist import dcp_failure

    reader, metadata = _dist_reader(folder)
    bridge = make_bridge(hf_config, torch.float32, {}, one_process=True)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_head
    layers = int(hf_config.num_hidden_layers)
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata) or not key.startswith(_MODEL_KEYS):
            continue  # the optimizer's tensors, layers' extra state (bytes)
        full = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load({key: full}, storage_reader=reader, no_dist=True)
        except (Exception, CheckpointException) as exc:  # a shard file missing or damaged
            raise UserError(f"Cannot read {key} from {folder}: {dcp_failure(exc)}",
                            "Export another checkpoint of the run.") from None
        try:
            if key.startswith("decoder.layers."):
                if full.shape[0] != layers:
                    raise UserError(f"{folder} holds {full.shape[0]} layers of {key}; the model's config.json "
                                    f"says {layers}.", "Export with the model the run was trained from.")
                for i in range(layers):
                    name = key.replace("decoder.layers.", f"decoder.layers.{i}.", 1)
                    yield from to_hf(bridge, name, full[i], tied=tied, value_head=value_head)
            else:
                yield from to_hf(bridge, key, full, tied=tied, value_head=value_head)
        except (NotImplementedError, KeyError, ValueError, RuntimeError) as exc:
            raise UserError(f"{folder}: cannot map the megatron tensor {key} to a Hugging Face name ({exc}).",
                            "Export with the model the run was trained from (a Qwen2 or Llama folder).") from None


def _dist_reader(folder: str) -> tuple[Any, Any]:
    """A reader of the checkpoint folder that never runs code from it (the index read with the fsdp backends'
    restricted unpickler, the tensors with ``weights_only``), and its index."""
    from rlx.plugins.modeling.dist import dcp_failure, safe_dcp_reader

    if not os.path.isdir(folder):
        raise UserError(f"{folder} is missing: the checkpoint was not written by the megatron backend, or is "
                        "damaged.", "Export with the backend that wrote the checkpoint, or another checkpoint.")
    try:
        with open(os.path.join(folder, "metadata.json")) as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as exc:
        raise UserError(f"{folder}/metadata.json cannot be read ({exc}): not a megatron-core distributed "
                        "checkpoint.", "Export another checkpoint of the run.") from None
    if backend != "torch_dist":
        raise UserError(f"{folder} was written in megatron-core's {backend!r} format; rlx reads 'torch_dist' "
                        "(what the megatron backend writes).", "Export a checkpoint written by rlx.")
    reader = safe_dcp_reader(folder)
    try:
        return reader, reader.read_metadata()
    except UserError:
        raise
    except Exception as exc:  # a missing or garbled .metadata
        raise UserError(f"Cannot read {folder}/.metadata: {dcp_failure(exc)}",
                        "Export another checkpoint of the run.") from None


def write_hf_folder(path: str, hf_config: Any, state: dict[str, torch.Tensor], *, value_head: bool,
                    tokenizer: Any = None) -> None:
    """A Hugging Face folder (safetensors, config, generation config, tokenizer) from full tensors: a
    ``*ForCausalLM``, or a ``*ForTokenClassification`` with one label for a critic. ``config.json`` records the
    tensors' dtype. Every weight the architecture has must be in ``state`` (no silently random weights)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    config = copy.deepcopy(hf_config)
    if value_head:
        config.num_labels = 1
    cls = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    floating = [t.dtype for t in state.values() if t.is_floating_point()]
    dtype = floating[0] if floating else torch.float32
    with torch.device("meta"):
        shell = cls.from_config(config, dtype=dtype)
    tied = bool(getattr(config, "tie_word_embeddings", False)) and not value_head
    wanted = set(shell.state_dict()) - ({"lm_head.weight"} if tied else set())
    missing, unknown = sorted(wanted - set(state)), sorted(set(state) - wanted)
    if missing or unknown:
        raise UserError(f"The weights do not fit the model's config.json: missing {missing[:5]}, unexpected "
                        f"{unknown[:5]}.", "Export with the model the run was trained from.")
    shell.save_pretrained(path, state_dict=state, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def export_checkpoint(checkpoint: str, spec: Any, out: str, tokenizer: Any = None) -> None:
    """``rlx export`` for the megatron backend: a role's checkpoint folder (``checkpoint/dist``) to a Hugging
    Face folder ``out``, in this one process on the CPU, without megatron-core's model or groups (its
    distributed checkpoints otherwise load on GPUs only). ``spec`` is the role's ``RoleSpec``."""
    from rlx.plugins.backends.megatron import require_megatron

    require_megatron("rlx export of a megatron checkpoint")  # the bridge's tensor conversions
    from rlx.run.models import apply_config_overrides

    hf_config = apply_config_overrides(read_hf_config(spec.model_path, spec.trust_remote_code),
                                       getattr(spec, "config_overrides", None) or {})
    check_architecture(hf_config, spec.model_path)
    with warnings.catch_warnings():
        # Importing megatron-core and mbridge warns that Transformer Engine and apex are missing: no layer is
        # built here, so neither matters.
        warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")
        warnings.filterwarnings("ignore", message="full scope is deprecated")
        state = dict(read_checkpoint(os.path.join(checkpoint, DIST_DIR), hf_config, value_head=spec.value_head))
    write_hf_folder(out, hf_config, state, value_head=spec.value_head, tokenizer=tokenizer)
