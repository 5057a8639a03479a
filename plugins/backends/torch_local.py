"""The ``torch`` training backend: plain PyTorch on one process (CPU or one GPU).

It loads Hugging Face causal LMs, computes per-token log-probs and entropies in micro-batches, and
trains with AdamW, gradient accumulation, global-norm clipping and a warm-up schedule. The FSDP2
backend builds on the same worker, sharding the model across processes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlx import Component, hookimpl
from rlx.config import resolve_dtype
from rlx.context import BuildContext
from rlx.protocols import LossFn, RoleSpec

if TYPE_CHECKING:
    import torch

    from rlx.batch import Batch


MODEL_FILE, OPTIM_FILE = "model.safetensors", "optim.pt"


def rng_file(rank: int) -> str:
    return "rng.pt" if rank == 0 else f"rng_rank{rank}.pt"


class TorchBackendOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="Attention kernel passed to from_pretrained.")
    num_threads: int | None = Field(None, gt=0, le=4096, description="torch CPU threads (default: torch's choice).")


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
    min_ratio = float(spec.extra.get("min_lr_ratio", 0.0))

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


def _response_outputs(model: Any, batch: Batch) -> torch.Tensor:
    """The model's outputs at the positions before each response token: (b, R, V) for a language
    model, (b, R, 1) for a value model. Position t holds the state (prompt, response[:t])."""
    import torch

    prompts, responses = batch["prompts"], batch["responses"]  # (b, P), (b, R)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)  # (b, P+R)
    input_ids = torch.cat([prompts, responses], dim=1)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                   use_cache=False).logits
    p, r = prompts.shape[1], responses.shape[1]
    return logits[:, p - 1:p + r - 1].float()


def response_log_probs(model: Any, batch: Batch, temperature: float, with_entropy: bool,
                       entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (b, R) of the response tokens under ``model`` (logits divided by temperature).

    With ``entropy_grad=False`` the entropy is only a metric: it is computed outside the autograd
    graph, which then keeps no (b, R, V) intermediates for it.
    """
    import torch

    from rlx.plugins.algorithms.functional import entropy_from_logits, log_probs_from_logits

    responses = batch["responses"]  # (b, R)
    logits = _response_outputs(model, batch)  # (b, R, V): position t predicts response token t
    if temperature and temperature != 1.0:
        logits = logits / temperature
    log_probs = log_probs_from_logits(logits, responses)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
    return log_probs, entropy


def response_values(model: Any, batch: Batch) -> torch.Tensor:
    """Values (b, R) of a value model; values[:, t] scores the state before response token t.
    Padding is 0."""
    import torch

    values = _response_outputs(model, batch).squeeze(-1)  # (b, R)
    return torch.where(batch["response_mask"].bool(), values, torch.zeros((), dtype=values.dtype,
                                                                           device=values.device))


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
        torch.manual_seed(spec.seed)
        # Mixed precision: a trainable role keeps float32 master weights (AdamW on bf16 weights loses
        # small updates) and runs its forward passes under autocast in model.dtype on a GPU; a frozen
        # role (the reference) is simply loaded in model.dtype.
        self.compute_dtype = getattr(torch, resolve_dtype(spec.dtype, self.device))
        dtype = torch.float32 if spec.trainable else self.compute_dtype
        if spec.value_head:
            self.model = load_value_model(spec, dtype, options.attn_implementation).to(self.device)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                spec.model_path, dtype=dtype, trust_remote_code=spec.trust_remote_code,
                attn_implementation=options.attn_implementation,
            ).to(self.device)
        self.autocast = spec.trainable and self.device != "cpu" and self.compute_dtype != torch.float32
        if spec.trainable and spec.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self._set_up_optimizer()

    def _set_up_optimizer(self) -> None:
        """AdamW and the learning-rate schedule for a trainable role; a frozen one gets no gradients."""
        import torch

        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        if self.spec.trainable:
            self.model.train()
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.spec.lr, betas=self.spec.betas,
                                               weight_decay=self.spec.weight_decay)
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

    # -- the engine primitives rlx.training's shared loops use ---------------------------------
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
                return {"values": response_values(self.model, micro).float()}
            temperature = float(micro.meta.get("temperature", 1.0))
            log_probs, entropy = response_log_probs(self.model, micro, temperature, with_entropy=True,
                                                    entropy_grad=entropy_grad)
            return {"log_probs": log_probs, "entropy": entropy}

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
    def _forward_no_grad(self, batch: Batch, fn: Any) -> list[Any]:
        """``fn(micro_batch)`` over the batch in micro-batches, without gradients, in eval mode.

        Eval mode: a model configured with dropout must still score each token deterministically.
        """
        import torch

        from rlx.training import run_forward

        size = int(self.spec.extra.get("log_prob_micro_batch_size", self.spec.micro_batch_size))
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self._precision():
                return run_forward(self, batch, size, fn)
        finally:
            self.model.train(was_training)

    def compute_values(self, batch: Batch) -> Batch:
        """Critic values (B, R) of the states before each response token; 0 at padding."""
        import torch

        from rlx.batch import Batch

        assert self.spec.value_head, f"role {self.spec.role} has no value head"
        out = self._forward_no_grad(batch, lambda mb: response_values(self.model, mb).float().cpu())
        return Batch({"values": torch.cat(out)})

    def compute_log_probs(self, batch: Batch, with_entropy: bool = False) -> Batch:
        import torch

        from rlx.batch import Batch

        assert not self.spec.value_head, f"role {self.spec.role} is a value model"
        temperature = float(batch.meta.get("temperature", 1.0))
        out = self._forward_no_grad(batch, lambda mb: response_log_probs(self.model, mb, temperature, with_entropy))
        tensors = {"log_probs": torch.cat([lp for lp, _ in out]).cpu()}
        if with_entropy:
            tensors["entropy"] = torch.cat([ent for _, ent in out]).cpu()
        return Batch(tensors)

    # -- training ---------------------------------------------------------------------------
    def update(self, minibatches: list[Batch], loss_fn: LossFn) -> list[dict[str, float]]:
        """One optimizer step per mini-batch (``rlx.training.run_update``)."""
        from rlx.training import run_update

        self.model.train()
        return run_update(self, minibatches, loss_fn, self.spec.micro_batch_size)

    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over ``batch`` (a mini-batch), accumulating over micro-batches."""
        return self.update([batch], loss_fn)[0]

    # -- weights and checkpoints ------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def save_checkpoint(self, path: str) -> None:
        """Model weights as safetensors; optimizer, scheduler and RNG states as tensor files that load
        with ``weights_only=True`` (no pickled objects), so resuming never runs code from a file."""
        import torch
        from safetensors.torch import save_model

        os.makedirs(path, exist_ok=True)
        if self.rank == 0:  # the replicas are identical; each rank keeps its own random state
            save_model(self.model, os.path.join(path, MODEL_FILE))
            if self.optimizer is not None:
                torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                           os.path.join(path, OPTIM_FILE))
        torch.save({"cpu": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
                   os.path.join(path, rng_file(self.rank)))

    def load_checkpoint(self, path: str) -> None:
        import torch

        from rlx.checkpoint import torch_load
        from rlx.errors import UserError

        weights = os.path.join(path, MODEL_FILE)
        if os.path.exists(weights):
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
        if self.rank != 0:
            return
        self.model.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)


class TorchBackend:
    """Builds :class:`TorchWorker` s for roles; picklable so process launchers can ship it."""

    def __init__(self, options: TorchBackendOptions, device: str) -> None:
        self.options, self.device = options, device

    def worker(self, spec: RoleSpec, rank: int = 0, world_size: int = 1) -> TorchWorker:
        return TorchWorker(spec, self.options, self.device, rank, world_size)


def build(options: TorchBackendOptions | None, ctx: BuildContext) -> TorchBackend:
    device = ctx.config.trainer.device if ctx.config is not None else "auto"
    return TorchBackend(options or TorchBackendOptions(), device)


@hookimpl
def rlx_train_backends() -> list[Component]:
    return [Component(kind="backend", name="torch", factory=build, config_model=TorchBackendOptions,
                      summary="Plain PyTorch on one process (CPU or one GPU); AdamW, grad accumulation.")]
