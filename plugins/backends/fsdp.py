"""The ``fsdp2`` and ``fsdp`` training backends: one role's model sharded over the data-parallel processes.

``fsdp2`` applies ``torch.distributed.fsdp.fully_shard`` to every decoder layer (the classes a Hugging Face
model lists in ``_no_split_modules``) and then to the root; ``fsdp`` wraps the model in FSDP1's
``FullyShardedDataParallel`` with a transformer-layer auto-wrap policy. Both keep float32 master weights and
reduce gradients in float32; on a GPU the forward and backward passes run in ``model.dtype`` (bf16 by
default) through FSDP's own mixed precision, on the CPU everything is float32. Everything model-independent
(micro-batch loops, exact accumulation, non-finite skips, metrics) is the shared ``rlx.step`` step; this
module supplies only its primitives: the data-parallel group, a gradient sum over ranks, and clipping of the
global norm across shards.

Process group. The worker uses the default (world) group that the launcher initialised before building it;
every rank is one data-parallel rank, unless the role's ``ulysses_sequence_parallel_size`` (sp) is above 1:
then groups of sp consecutive ranks split each sequence between them and count as one data-parallel rank
(``rlx.plugins.backends.ulysses``). Parameters are sharded over every rank either way. Without an
initialised group (``--backend fsdp2`` in a single process) the worker initialises a one-rank group itself
(gloo on the CPU, NCCL on a GPU, over an in-memory store), so a one-process run goes through exactly the
same sharded code.

Exact gradients over ranks. A loss is already divided by the *global* token count, so the mini-batch
gradient is the *sum* of the ranks' gradients: ``fsdp2`` sets FSDP's gradient divide factor to 1 with
sum-only reductions;
FSDP1 always averages over all ranks, so ``fsdp`` multiplies the loss by the number of ranks before
``backward``.

Model loading (say which and why). ``fsdp2``: meta-device init and a rank-0 load. Every rank builds the
model from its config on the meta device (no memory), shards it and allocates only its own shards; rank 0
alone reads the Hugging Face folder to CPU memory, and ``set_model_state_dict(full_state_dict=True,
broadcast_from_rank0=True)`` sends each rank its shards; buffers that are not in the state dict (the
rotary ``inv_freq``) are broadcast from rank 0. Peak host memory is one full model on rank 0 and one
shard elsewhere, so 8 ranks of a machine do not hold 8 copies. ``fsdp``: every rank loads the folder to
its CPU memory and FSDP1 shards it (every rank reads the same files, and a new value head is initialised
from the role's seed, so the copies agree without a broadcast). FSDP1's
meta-device path (``param_init_fn``) re-creates each module's parameters one module at a time, which
unties tied embeddings (``lm_head.weight`` is ``embed_tokens.weight`` in many small models); FSDP1 is the
legacy engine, kept for users who need it, and its peak host memory is one model per rank during load.

Checkpoints (``torch.distributed.checkpoint``). Model and optimizer state are written by all ranks
together into ``PATH/dcp`` (each rank its shards) and are resharded on load: a checkpoint written by N
ranks loads into M ranks, for any N and M. The scheduler state and the RNG states are per rank
(``PATH/rank{r}.pt``, plain tensor files read with ``weights_only``); they are not resharded. On a load
with more ranks than wrote the checkpoint, a new rank r takes rank 0's scheduler state (the schedule is the
same on every rank) and seeds its RNG with ``seed + r``. Loading never runs code from a file: DCP's reader
would ``pickle.load`` the ``.metadata`` file and its planner ``torch.load(weights_only=False)`` every
non-tensor entry; here the metadata is read by an unpickler that builds only DCP's metadata classes and the
few torch and path types they hold, and non-tensor entries load with ``weights_only=True``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlx import Component, _compat, hookimpl
from rlx.config import resolve_dtype
from rlx.context import BuildContext
from rlx.errors import UserError
from rlx.plugins.backends.ulysses import (
    SequenceParallel,
    check_heads,
    check_processes,
    option_name,
    ulysses_size,
    use_ulysses_attention,
)
from rlx.plugins.modeling import checkpointing
from rlx.plugins.modeling.checks import COMPILE_FSDP1, CONFIG_PROBLEMS, LORA_FSDP1
from rlx.plugins.modeling.dist import (
    DCP_DIR,
    _safe_planner,
    dcp_failure,
    ensure_process_group,
    rank_device,
    safe_dcp_reader,
)
from rlx.plugins.modeling.model import (
    check_attention,
    hf_config,
    load_value_model,
    pick_device,
    restore_scheduler,
    settings_of,
    trained_dtype,
    with_role_settings,
)
from rlx.plugins.modeling.worker import TorchWorker
from rlx.protocols import DispatchInfo, RoleSpec
from rlx.records import RoleSettings

if TYPE_CHECKING:
    import torch

    from rlx.batch import Batch


class FSDPCommonOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = Field(
        "sdpa", description="Attention kernel passed to from_pretrained. Packed sequences: sdpa and eager mask "
        "each sequence off (a block-diagonal mask), flash_attention_2 (flash-attn installed) and flex_attention "
        "(GPU: it has no backward on the CPU) skip the work across sequences.")
    cpu_offload: bool = Field(False, description="Keep parameters, gradients and optimizer states in CPU "
                                                 "memory between uses (GPU only; slower, far less GPU memory).")
    num_threads: int | None = Field(None, gt=0, description="torch CPU threads per process (default: torch's "
                                                           "choice).")


class FSDP2Options(FSDPCommonOptions):
    reshard_after_forward: bool = Field(
        True, description="Free the gathered parameters after each layer's forward pass (ZeRO-3); False keeps "
                          "them until the backward pass (ZeRO-2-like: more memory, fewer all-gathers).")


class FSDPOptions(FSDPCommonOptions):
    pass


# -- safe reading of DCP checkpoints --------------------------------------------------------------


# -- the worker -----------------------------------------------------------------------------------
class FSDPWorker(TorchWorker):
    """One role's model sharded over the data-parallel group (``fsdp2`` or ``fsdp``).

    It reuses :class:`TorchWorker`'s forward passes, inference and update loop (``rlx.step``) and
    replaces how the model is built and the primitives that cross ranks.
    """

    def __init__(self, spec: RoleSpec, options: FSDP2Options | FSDPOptions, device: str = "auto",
                 engine: Literal["fsdp2", "fsdp"] = "fsdp2") -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if options.cpu_offload and pick_device(device) == "cpu":
            raise UserError(f"backend.cpu_offload=true ({engine}) needs a GPU (trainer.device=cpu keeps "
                            "everything on the CPU already).", "Set backend.cpu_offload=false or trainer.device=cuda.")
        if options.num_threads:
            torch.set_num_threads(options.num_threads)
        ensure_process_group(pick_device(device))
        self.spec, self.options, self.engine = spec, options, engine
        self.device = rank_device(device)
        check_attention(options.attn_implementation, self.device, spec)
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.comm_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        # Parameters are sharded over every rank (as verl does), sequence-parallel groups included.
        self.mesh = init_device_mesh(torch.device(self.device).type, (world,))
        self._set_up_groups(world)
        self.lora = spec.lora
        if self.lora is not None and engine == "fsdp":
            raise UserError(LORA_FSDP1, "Use backend.name=fsdp2 (or torch) for LoRA, or model.lora_rank=0.")
        if spec.forward.use_torch_compile and engine == "fsdp":
            section = "critic" if spec.role == "critic" else "actor"
            raise UserError(f"{section}.{COMPILE_FSDP1}",
                            f"Use backend.name=fsdp2, or {section}.use_torch_compile=false.")
        # model_dtype=float32 (the default): a trainable role keeps float32 master weights and computes in
        # model.dtype through FSDP's mixed precision. model_dtype=bfloat16: weights, gradients and AdamW
        # moments in bf16. A frozen role (the reference), and the frozen base under LoRA, is stored in the
        # compute dtype; LoRA adapters are held in the trained dtype.
        self.adapter_dtype = trained_dtype(spec)
        self.compute_dtype = self.adapter_dtype if self.adapter_dtype == torch.bfloat16 else getattr(
            torch, resolve_dtype(spec.dtype, self.device))
        self.master_dtype = self.adapter_dtype if spec.trainable and self.lora is None else self.compute_dtype
        self.autocast = False  # FSDP casts parameters itself; no autocast around the forward passes
        torch.manual_seed(spec.seed)
        # FSDP1 divides the reduced gradients by the number of ranks, but a loss is already divided by the
        # global token count: multiplying it back makes the reduction a sum.
        self.loss_scale = float(world) if engine == "fsdp" else 1.0
        if engine == "fsdp2":
            self.model = self._build_fsdp2()
            self._set_up_forward(self._plain(self.model))
        else:
            self.model = self._build_fsdp1()
            self._set_up_forward(self.model.module)  # the Hugging Face model inside the FSDP1 wrapper
        self._set_up_optimizer()

    def _set_up_groups(self, world: int) -> None:
        """Data-parallel and Ulysses sequence-parallel groups: groups of ``sp`` consecutive ranks share one
        data-parallel rank (``rlx.plugins.backends.ulysses``); without sequence parallelism every rank is
        its own data-parallel rank of the world group."""
        import torch
        from torch.distributed.device_mesh import init_device_mesh

        size = ulysses_size(self.spec.forward, self.spec.role)
        self.sp_size, self.sp = size, None
        self.dp_size, self.dp_rank, self.dp_group = world // size, self.rank // size, None
        if size == 1:
            return
        check_heads(size, self._config(), self.spec.role)
        check_processes(size, world, self.spec.role)
        grid = init_device_mesh(torch.device(self.device).type, (world // size, size), mesh_dim_names=("dp", "sp"))
        self.dp_group = grid.get_group("dp")
        self.sp = SequenceParallel(grid.get_group("sp"), size, self.rank % size)

    def dispatch_info(self) -> DispatchInfo:
        """A sequence-parallel group is one data-parallel rank: all its ranks get that rank's share, and its
        first rank returns the results (the others hold the same)."""
        return DispatchInfo(self.dp_rank, self.dp_size, collect=self.rank % self.sp_size == 0)

    def _set_up_forward(self, hf_model: Any) -> None:
        super()._set_up_forward(hf_model)
        if self.sp is None:
            return
        option = option_name(self.spec.role)
        if not self.packed:
            padding = f"{'critic' if self.spec.role == 'critic' else 'actor'}.use_remove_padding"
            if not self.spec.forward.use_remove_padding:
                raise UserError(f"{option}={self.sp_size} needs packed sequences, but {padding} is false.",
                                f"Set {padding}=true, or {option}=1.")
            from rlx.plugins.modeling.vision import is_vision_config

            why = ("a vision-language model's rows stay padded" if is_vision_config(getattr(hf_model, "config", None))
                   else "its attention does not go through transformers' attention interface")
            raise UserError(f"{option}={self.sp_size} needs packed sequences, but the {self.spec.role} model cannot "
                            f"pack them ({why}).", f"Set {option}=1 for this model.")
        use_ulysses_attention(hf_model, self.spec.role)  # and with it no shared prompts (TorchWorker.share_prompts)
        # A token budget is per GPU, and a sequence-parallel group of sp GPUs holds sp times as many (verl's
        # rule), so a micro-batch of a group may hold that many.
        if self.update_budget is not None and self.forward_budget is not None:
            scale = f" x {option}"
            self.update_budget = (self.update_budget[0] * self.sp_size, self.update_budget[1] + scale)
            self.forward_budget = (self.forward_budget[0] * self.sp_size, self.forward_budget[1] + scale)

    def _log_probs(self, micro: Batch, temperature: float, with_entropy: bool,
                   entropy_grad: bool = True) -> dict[str, torch.Tensor]:
        if self.sp is None:
            return super()._log_probs(micro, temperature, with_entropy, entropy_grad)
        log_probs, entropy = self.sp.log_probs(self.model, self.hf_model, micro, temperature, with_entropy,
                                               entropy_grad, self.chunk_size, self.compile_head)
        return {"log_probs": log_probs} if entropy is None else {"log_probs": log_probs, "entropy": entropy}

    def _sum_pi_squared(self, micro: Batch, temperature: float) -> dict[str, torch.Tensor]:
        if self.sp is not None:
            raise UserError("sum_pi_squared (for the optimal-token-baseline estimators) is not computed with Ulysses "
                            "sequence parallelism.", "Set actor.ulysses_sequence_parallel_size=1 or use another "
                            "estimator.")
        return super()._sum_pi_squared(micro, temperature)

    def _values(self, micro: Batch) -> torch.Tensor:
        if self.sp is None:
            return super()._values(micro)
        return self.sp.values(self.model, micro).float()

    # -- building --------------------------------------------------------------------------------
    def _config(self) -> Any:
        return hf_config(self.spec)

    def _load_full(self) -> Any:
        """The role's Hugging Face model from its folder, on the CPU in the master dtype."""
        from rlx.plugins.modeling.vision import causal_lm_class

        if self.spec.value_head:
            return load_value_model(self.spec, self.master_dtype, self.options.attn_implementation)
        config = hf_config(self.spec)
        return causal_lm_class(config).from_pretrained(
            self.spec.model_path, config=config, dtype=self.master_dtype,
            trust_remote_code=self.spec.trust_remote_code, attn_implementation=self.options.attn_implementation)

    def _empty_model(self) -> Any:
        """The role's model built from its config on the meta device (no memory, no initialisation)."""
        import torch
        from transformers import AutoModelForTokenClassification

        from rlx.plugins.modeling.vision import causal_lm_class

        spec = self.spec
        kwargs: dict[str, Any] = {"num_labels": 1} if spec.value_head else {}
        config = hf_config(spec, **kwargs)
        if spec.value_head:
            config.classifier_dropout = 0.0
        cls = AutoModelForTokenClassification if spec.value_head else causal_lm_class(config)
        with torch.device("meta"):
            return cls.from_config(config, dtype=self.master_dtype, trust_remote_code=spec.trust_remote_code,
                                   attn_implementation=self.options.attn_implementation)

    def _prepare(self, model: Any) -> None:
        """Before wrapping: keep what ``save_pretrained`` needs of the plain model (class, config, generation
        config), switch on gradient checkpointing and put the routers in ``model.router_dtype``."""
        from transformers import GenerationConfig

        from rlx.plugins.modeling.moe import apply_router_dtype

        apply_router_dtype(model, self.spec.router_dtype, f"the {self.spec.role}'s model")
        self.hf_class, self.hf_config = type(model), model.config
        try:
            self.generation_config: Any = GenerationConfig.from_pretrained(self.spec.model_path)
        except OSError:
            self.generation_config = getattr(model, "generation_config", None)
        if self.spec.trainable and self.spec.gradient_checkpointing:
            # non-reentrant checkpointing: the re-entrant form does not work with FSDP's hooks
            checkpointing.enable(model, {"use_reentrant": False})

    def _freeze(self, model: Any) -> None:
        """actor.freeze_vision_tower: the vision tower's parameters (and adapters) do not train."""
        if self.spec.freeze_vision_tower:
            from rlx.plugins.modeling.vision import freeze_vision_tower

            freeze_vision_tower(model, f"the {self.spec.role}'s model")

    def _wrap(self, model: Any) -> Any:
        """The Hugging Face model with fresh LoRA adapters (frozen base) when LoRA is on, else itself."""
        if self.lora is None:
            return model
        from rlx.plugins.modeling import lora

        return lora.apply(model, self.lora, value_head=self.spec.value_head, adapter_dtype=self.adapter_dtype)

    def _plain(self, model: Any) -> Any:
        """The Hugging Face model inside peft's wrapper (``model`` itself without LoRA)."""
        return model.get_base_model() if self.lora is not None else model

    def _layer_classes(self, model: Any) -> set[type]:
        names = set(getattr(self._plain(model), "_no_split_modules", None) or [])
        classes = {type(m) for m in model.modules() if type(m).__name__ in names}
        if not classes:
            raise UserError(f"Cannot shard {self.spec.model_path!r} with {self.engine}: its model class "
                            f"{type(model).__name__} names no decoder-layer class (_no_split_modules).",
                            "Use the torch backend for this model.")
        return classes

    def _build_fsdp2(self) -> Any:
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        options = self.options
        assert isinstance(options, FSDP2Options)
        if not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):
            raise UserError(f"--backend fsdp2 needs torch >= 2.8 (installed: {torch.__version__}): older FSDP2 "
                            "cannot sum gradients over ranks without rescaling them.",
                            "Upgrade torch, or use --backend fsdp.")
        model = self._empty_model()
        self._prepare(model)
        with torch.device("meta"):  # the adapters too: rank 0's initial values reach every rank below
            model = self._wrap(model)
        self._freeze(model)
        full = self._wrap(self._load_full()) if self.rank == 0 else None
        mp = MixedPrecisionPolicy()
        if self.spec.trainable and self.compute_dtype != torch.float32:
            mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        kwargs = {"mesh": self.mesh, "reshard_after_forward": options.reshard_after_forward, "mp_policy": mp,
                  "offload_policy": CPUOffloadPolicy() if options.cpu_offload else OffloadPolicy()}
        layers = self._layer_classes(model)
        for module in list(model.modules()):
            if type(module) in layers:
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)
        # Shards are allocated on the device even with CPU offload: the broadcast from rank 0 runs on the
        # communication device (NCCL cannot send CPU tensors); offloaded shards move to the CPU afterwards.
        model.to_empty(device=self.device)
        state = full.state_dict() if full is not None else {}
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        # Buffers outside the state dict (rotary inv_freq) are plain, unsharded tensors: rank 0's values.
        loaded = dict(full.named_buffers()) if full is not None else {}
        for name, buf in model.named_buffers():
            tmp = (loaded[name] if full is not None else torch.empty_like(buf, device="cpu")).to(self.comm_device)
            dist.broadcast(tmp, src=0)
            buf.copy_(tmp)
        del full, state
        if options.cpu_offload:
            model.to("cpu")
            for module in model.modules():  # buffers are used by the forward pass, on the device
                for name, buf in module.named_buffers(recurse=False):
                    module._buffers[name] = buf.to(self.device)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # A plain sum over ranks (losses divide by global counts): gloo has neither AVG nor
                # PREMUL_SUM, and a SUM with no scaling is also the cheapest reduction under NCCL.
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        return model

    def _build_fsdp1(self) -> Any:
        import torch
        from torch.distributed.fsdp import CPUOffload, MixedPrecision
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = self._load_full()
        self._prepare(model)
        self._freeze(model)
        mp = None
        if self.spec.trainable and self.compute_dtype != torch.float32:
            mp = MixedPrecision(param_dtype=self.compute_dtype, reduce_dtype=torch.float32,
                                buffer_dtype=torch.float32)
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy(self._layer_classes(model)), mixed_precision=mp,
                    cpu_offload=CPUOffload(offload_params=self.options.cpu_offload),
                    device_id=torch.device(self.device), device_mesh=self.mesh, use_orig_params=True)

    # -- the engine primitives rlx.step's shared loops use ---------------------------------
    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        import torch
        import torch.distributed as dist

        if self.dp_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.dp_group)
        return [float(v) for v in t.tolist()]

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()

    def clip_gradients(self) -> torch.Tensor:
        """FSDP already summed the gradients over ranks in its reduce-scatter; clip to the global norm over
        every shard (the step itself is the torch backend's)."""
        if self.engine == "fsdp":
            return self.model.clip_grad_norm_(self.spec.grad_clip)
        return self._clip_fsdp2(self.spec.grad_clip)

    def _clip_fsdp2(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients to a global L2 norm over all shards of all ranks; return that norm.

        The norm is computed from the local shards and all-reduced on the communication device, so it
        also works when the gradients live in CPU memory under an NCCL group (cpu_offload), where a
        DTensor reduction would run NCCL on CPU tensors. The clip coefficient is torch's own formula.
        """
        import torch
        import torch.distributed as dist

        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        sq = torch.zeros((), dtype=torch.float32, device=self.comm_device)
        for g in local:
            sq += torch.linalg.vector_norm(g, dtype=torch.float32).to(self.comm_device) ** 2
        dist.all_reduce(sq)
        total = sq.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in local:
            g.mul_(coef.to(g.device, g.dtype))
        return total.cpu()

    # -- weights ---------------------------------------------------------------------------------
    def _sharded_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=False))

    def _full(self, t: Any) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            if t.device.type != self.comm_device:  # CPU-offloaded shards under NCCL
                t = t.to(self.comm_device)
            return t.full_tensor()
        return t

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors with Hugging Face names, one at a time, on every rank (all ranks must iterate:
        each tensor is an all-gather of its shards)."""
        gathered = ((name, self._full(tensor).detach()) for name, tensor in self._sharded_state().items())
        if self.lora is None:
            yield from gathered
            return
        from rlx.plugins.modeling.lora import merge_stream, scale_of

        # base + adapter merged tensor by tensor under the base's names; the sharded model stays unmerged
        yield from merge_stream(gathered, scale_of(self.lora))

    def weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """:meth:`named_weights` grouped into lists of at most ``bucket_bytes`` (a larger tensor alone)."""
        from rlx.plugins.modeling.weights import buckets

        yield from buckets(self.named_weights(), bucket_bytes)

    # -- checkpoints -----------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        """What a checkpoint holds: under LoRA only the trainable tensors of the model (the base is re-loaded
        from model.path on resume), and the optimizer state of a trainable role."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.optimizer is None:
            model, optim = self._sharded_state(), None
        else:
            model, optim = get_state_dict(self.model, self.optimizer)
        if self.lora is not None:
            from rlx.plugins.modeling.lora import is_adapter

            model = {name: tensor for name, tensor in model.items() if is_adapter(name)}
        return {"model": model} if optim is None else {"model": model, "optim": optim}

    def _check_lora_matches(self, folder: str, path: str) -> None:
        """A checkpoint written with LoRA resumes only with LoRA, and one without only without."""
        from rlx.plugins.modeling.lora import is_adapter

        metadata = safe_dcp_reader(folder).read_metadata()
        written = any(is_adapter(key) for key in metadata.state_dict_metadata if key.startswith("model."))
        if written != (self.lora is not None):
            how = "with LoRA adapters" if written else "without LoRA (all weights)"
            raise UserError(f"{path} was written {how}, but this run has model.lora_rank="
                            f"{self.lora.rank if self.lora else 0}.",
                            "Resume (or export) with the model.lora_* settings the run was started with.")

    def save_checkpoint(self, path: str) -> None:
        """Every rank writes its shards of model and optimizer (DCP, into ``path/dcp``) and its own
        scheduler and RNG states (``path/rank{r}.pt``); returns when all ranks have finished writing."""
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        os.makedirs(path, exist_ok=True)
        dcp.save(self._state(), storage_writer=dcp.FileSystemWriter(os.path.join(path, DCP_DIR)))
        local: dict[str, Any] = {"cpu_rng": torch.get_rng_state(),
                                 "cuda_rng": torch.cuda.get_rng_state() if self.device != "cpu" else None}
        if self.scheduler is not None:
            local["scheduler"] = self.scheduler.state_dict()
        torch.save(local, os.path.join(path, f"rank{self.rank}.pt"))
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

        from rlx.run.checkpoint import torch_load

        folder = os.path.join(path, DCP_DIR)
        if not os.path.isdir(folder):
            raise UserError(f"{folder} is missing: {path} was not written by the {self.engine} backend "
                            "(or is damaged).", "Resume with the backend that wrote the checkpoint, or "
                            "start a new run from the exported model.")
        self._check_lora_matches(folder, path)
        state = self._state()
        try:
            dcp.load(state, storage_reader=safe_dcp_reader(folder), planner=_safe_planner())
        except UserError:
            raise
        except (Exception, CheckpointException) as exc:  # DCP gathers every rank's failure into one text
            text = str(exc)
            if "Refused to load" in text:
                reason = text[text.index("Refused to load"):].splitlines()[0]
                raise UserError(reason, "rlx never unpickles arbitrary objects from checkpoints. Resume from "
                                "a checkpoint written by rlx.") from None
            raise UserError(f"Cannot load {folder} into the {self.spec.role} model: {dcp_failure(exc)}",
                            "The checkpoint is damaged or belongs to another model or optimizer; resume "
                            "from another checkpoint, with the model the run was started with.") from None
        # under LoRA the state holds the adapters alone: the base keeps the weights loaded from model.path
        options = StateDictOptions(strict=self.lora is None)
        if self.optimizer is None:
            set_model_state_dict(self.model, state["model"], options=options)
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"], options=options)
        own = os.path.join(path, f"rank{self.rank}.pt")
        local = torch_load(own if os.path.exists(own) else os.path.join(path, "rank0.pt"))
        if self.scheduler is not None:
            restore_scheduler(self.scheduler, local["scheduler"])
        if os.path.exists(own):
            torch.set_rng_state(local["cpu_rng"])
            if local["cuda_rng"] is not None and self.device != "cpu":
                torch.cuda.set_rng_state(local["cuda_rng"])
        else:  # a rank that did not exist when the checkpoint was written
            torch.manual_seed(self.spec.seed + self.rank)

    def save_pretrained(self, path: str, tokenizer: Any = None) -> None:
        """Rank 0 writes a Hugging Face folder (safetensors, config, generation config, tokenizer) from the
        gathered full state dict; the other ranks take part in the gather and write nothing."""
        import torch
        import torch.distributed as dist

        # One tensor gathered at a time, kept (in CPU memory) by rank 0 only. (FSDP1's own rank-0 full
        # state dict with CPU offload crashes on CPU parameters in torch 2.13.)
        state = {}
        for name, tensor in self.named_weights():
            if self.rank == 0:
                state[name] = tensor.to("cpu", copy=True)
        if self.rank == 0:
            with torch.device("meta"):
                shell = self.hf_class(self.hf_config)
            if self.generation_config is not None:
                shell.generation_config = self.generation_config
            shell.save_pretrained(path, state_dict=state, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
        del state
        dist.barrier()


    def save_adapter(self, path: str, tokenizer: Any = None) -> None:
        """The LoRA adapter as a peft folder (adapter_config.json, adapter_model.safetensors) that
        ``PeftModel.from_pretrained(base, path)`` loads: every rank takes part in gathering the trainable
        tensors, rank 0 writes them."""
        import torch.distributed as dist

        from rlx.plugins.modeling.lora import is_adapter

        if self.lora is None:
            raise UserError(f"The {self.spec.role} has no LoRA adapter (the run trained every weight).",
                            "Export the merged model instead (without --adapter-only).")
        state = {}
        for name, tensor in self._sharded_state().items():
            if is_adapter(name):
                full = self._full(tensor).detach()
                if self.rank == 0:
                    state[name] = full.to("cpu", copy=True)
        if self.rank == 0:
            self.model.save_pretrained(path, state_dict=state)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
        del state
        dist.barrier()


class FSDPBackend:
    """Builds :class:`FSDPWorker` s for roles; picklable so process launchers can ship it."""

    def __init__(self, options: FSDP2Options | FSDPOptions, device: str, engine: Literal["fsdp2", "fsdp"],
                 settings: dict[str, RoleSettings] | None = None) -> None:
        self.options, self.device, self.engine, self.settings = options, device, engine, settings or {}

    def worker(self, spec: RoleSpec, rank: int = 0, world_size: int = 1) -> FSDPWorker:
        return FSDPWorker(with_role_settings(spec, self.settings), self.options, self.device, self.engine)


def build_fsdp2(options: FSDP2Options | None, ctx: BuildContext) -> FSDPBackend:
    device = ctx.config.trainer.device if ctx.config is not None else "auto"
    return FSDPBackend(options or FSDP2Options(), device, "fsdp2", settings_of(ctx))


def build_fsdp(options: FSDPOptions | None, ctx: BuildContext) -> FSDPBackend:
    device = ctx.config.trainer.device if ctx.config is not None else "auto"
    return FSDPBackend(options or FSDPOptions(), device, "fsdp", settings_of(ctx))


@hookimpl
def rlx_train_backends() -> list[Component]:
    return [
        Component(kind="backend", name="fsdp2", factory=build_fsdp2, config_model=FSDP2Options, extra=CONFIG_PROBLEMS,
                  summary="FSDP2 (fully_shard per decoder layer) over the data-parallel processes; "
                          "bf16 compute, fp32 master weights and gradient reduction, DCP checkpoints."),
        Component(kind="backend", name="fsdp", factory=build_fsdp, config_model=FSDPOptions, extra=CONFIG_PROBLEMS,
                  summary="FSDP1 (FullyShardedDataParallel, transformer-layer wrapping); "
                          "bf16 compute, fp32 master weights and gradient reduction, DCP checkpoints."),
    ]


# Names that lived here in rlx 0.1 (issue 26 moved them); kept for one release, with a DeprecationWarning.
__getattr__ = _compat.moved_attributes(__name__, {
    "read_dcp_metadata": "rlx.plugins.modeling.dist",
})
