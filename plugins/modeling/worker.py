"""``TorchWorker``: one role's Hugging Face model on one process, trained with AdamW (gradient accumulation,
global-norm clipping, a warm-up schedule; float32 master weights under autocast), computing log-probs, entropies
and values in micro-batches through :mod:`rlx.step`. The ``torch`` backend is this worker; the fsdp backends
shard it, and ``rlx rm`` trains a reward model with it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlx.config import resolve_dtype
from rlx.plugins.modeling import checkpointing
from rlx.plugins.modeling.compile import compile_decoder_layers
from rlx.plugins.modeling.head import response_log_probs, response_values
from rlx.plugins.modeling.model import (
    check_attention,
    forward_micro_batch_size,
    hf_config,
    load_value_model,
    lr_lambda,
    pick_device,
    restore_scheduler,
    rng_file,
    trained_dtype,
)
from rlx.plugins.modeling.moe import apply_router_dtype
from rlx.plugins.modeling.packing import runs_packed_sdpa, supports_packing, use_packed_sdpa
from rlx.protocols import LossFn, RoleSpec
from rlx.records import LoraSpec, UpdateContext

if TYPE_CHECKING:
    import torch

    from rlx.batch import Batch


MODEL_FILE, OPTIM_FILE = "model.safetensors", "optim.pt"


class TorchBackendOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = Field(
        "sdpa", description="Attention kernel passed to from_pretrained. Packed sequences: sdpa and eager mask "
        "each sequence off (a block-diagonal mask), flash_attention_2 (flash-attn installed) and flex_attention "
        "(GPU: it has no backward on the CPU) skip the work across sequences.")
    num_threads: int | None = Field(None, gt=0, le=4096, description="torch CPU threads (default: torch's choice).")


class TorchWorker:
    """One role's model on one device."""

    # ``RoleSpec.lora`` (rlx.plugins.modeling.lora.settings) when the model carries peft adapters.
    lora: LoraSpec | None = None

    def __init__(self, spec: RoleSpec, options: TorchBackendOptions, device: str = "auto", rank: int = 0,
                 world_size: int = 1) -> None:
        import torch

        from rlx.plugins.modeling.vision import causal_lm_class, freeze_vision_tower

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
            config = hf_config(spec)
            base = causal_lm_class(config).from_pretrained(
                spec.model_path, config=config, dtype=dtype, trust_remote_code=spec.trust_remote_code,
                attn_implementation=options.attn_implementation)
        apply_router_dtype(base, spec.router_dtype, f"the {spec.role}'s model")
        if self.lora is not None:
            from rlx.plugins.modeling import lora

            base = lora.apply(base, self.lora, value_head=spec.value_head, adapter_dtype=master)
        if spec.freeze_vision_tower:
            freeze_vision_tower(base, f"the {spec.role}'s model")
        self.model = base.to(self.device)
        self.autocast = (spec.trainable and self.device != "cpu" and master == torch.float32
                         and self.compute_dtype != torch.float32)
        hf_model = self.model.get_base_model() if self.lora is not None else self.model
        if spec.trainable and spec.gradient_checkpointing:
            checkpointing.enable(hf_model)
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

    @property
    def share_prompts(self) -> bool:
        """Rows with one prompt carry it once (``forward.share_prompts``): packed rows on rlx's packed attention
        only, which reads the layout that says so (not Ulysses' attention, which cuts whole sequences)."""
        return self.packed and bool(self.spec.forward.share_prompts) and runs_packed_sdpa(self.hf_model)

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

    def forward(self, micro: Batch, *, grad: bool, entropy_grad: bool = True,
                temperature: float = 1.0) -> dict[str, torch.Tensor]:

        import torch

        with self._precision(), (contextlib.nullcontext() if grad else torch.no_grad()):
            if self.spec.value_head:
                return {"values": self._values(micro)}
            return self._log_probs(micro, float(temperature), True, entropy_grad)

    def _values(self, micro: Batch) -> torch.Tensor:
        return response_values(self.model, micro, packed=self.packed, share_prompts=self.share_prompts).float()

    def _log_probs(self, micro: Batch, temperature: float, with_entropy: bool,
                   entropy_grad: bool = True) -> dict[str, torch.Tensor]:
        log_probs, entropy = response_log_probs(
            self.model, micro, temperature, with_entropy, entropy_grad, packed=self.packed,
            chunk_size=self.chunk_size, compile_head=self.compile_head, hf_model=self.hf_model,
            share_prompts=self.share_prompts)
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
                                         budget=self.forward_budget, share_prompts=self.share_prompts))
        finally:
            self.model.train(was_training)

    def compute_values(self, batch: Batch) -> Batch:
        """Critic values (B, R) of the states before each response token; 0 at padding."""
        assert self.spec.value_head, f"role {self.spec.role} has no value head"
        return self._forward_no_grad(batch, lambda mb: {"values": self._values(mb)})

    def compute_log_probs(self, batch: Batch, with_entropy: bool = False, temperature: float = 1.0,
                          with_sum_pi_squared: bool = False) -> Batch:
        assert not self.spec.value_head, f"role {self.spec.role} is a value model"
        if with_sum_pi_squared:
            if with_entropy:
                raise ValueError("with_sum_pi_squared and with_entropy are not computed in one pass")
            return self._forward_no_grad(batch, lambda mb: self._sum_pi_squared(mb, float(temperature)))
        return self._forward_no_grad(batch, lambda mb: self._log_probs(mb, float(temperature), with_entropy))

    def _sum_pi_squared(self, micro: Batch, temperature: float) -> dict[str, torch.Tensor]:
        """``log_probs`` and ``sum_pi_squared`` (b, R) from the whole logits (the chunked head is not used)."""
        from rlx.plugins.modeling.head import response_sum_pi_squared

        log_probs, squares = response_sum_pi_squared(self.model, micro, temperature, packed=self.packed,
                                                     hf_model=self.hf_model, share_prompts=self.share_prompts)
        return {"log_probs": log_probs, "sum_pi_squared": squares}

    def compute_ref_log_probs(self, batch: Batch, temperature: float = 1.0) -> Batch:
        """The reference policy's log-probs under LoRA: this model with its adapter switched off (the
        untouched base), instead of a second copy of the base in a reference worker."""
        assert self.lora is not None, f"role {self.spec.role} has no LoRA adapter to switch off"
        with self.model.disable_adapter():
            return self.compute_log_probs(batch, temperature=temperature)

    # -- training ---------------------------------------------------------------------------
    def update(self, minibatches: list[Batch], loss_fn: LossFn,
               context: UpdateContext | None = None) -> list[dict[str, float]]:
        """One optimizer step per mini-batch (``rlx.step.run_update``)."""
        from rlx.step import run_update

        self.model.train()
        return run_update(self, minibatches, loss_fn, self.spec.micro_batch_size, budget=self.update_budget,
                          context=context, share_prompts=self.share_prompts)

    def train_step(self, batch: Batch, loss_fn: LossFn, context: UpdateContext | None = None) -> dict[str, float]:
        """One optimizer step over ``batch`` (a mini-batch), accumulating over micro-batches."""
        return self.update([batch], loss_fn, context)[0]

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
