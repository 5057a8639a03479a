"""What each kind of component must provide. Protocols, not base classes: anything with these
methods is a backend, an engine, an algorithm, a reward or a logger.

Tensor shapes use B for sequences in the batch, P for the padded prompt length and R for the padded
response length. Prompts are left-padded, responses right-padded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from rlx.batch import Batch


# ---------------------------------------------------------------------------------------------
# Rollout
@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses. ``n`` samples are drawn for each prompt."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filtering
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    greedy: bool = False
    seed: int | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates responses for a batch of prompts.

    ``generate`` takes a batch with ``input_ids`` (B, P) and ``attention_mask`` (B, P), left-padded,
    and returns a batch of B*n rows (each prompt's samples adjacent) with tensors:
    ``prompts`` (B*n, P), ``prompt_mask`` (B*n, P), ``responses`` (B*n, R), ``response_mask`` (B*n, R)
    and ``rollout_log_probs`` (B*n, R) when the engine computes them. Non-tensor columns of the
    input are repeated for each sample.
    """

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights (full, unsharded tensors named as in the HF model)."""

    def sleep(self) -> None:
        """Free device memory (weights and KV cache) while training runs on the same device."""

    def wake_up(self) -> None:
        """Take back the memory freed by :meth:`sleep`."""

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# Training backend
LossFn = Callable[[Mapping[str, "torch.Tensor"], "Batch"], tuple["torch.Tensor", dict[str, float]]]
"""``loss_fn(outputs, micro_batch) -> (loss, metrics)``.

``outputs`` holds ``log_probs`` (b, R), ``entropy`` (b, R) and, for a critic, ``values`` (b, R).
The loss returned is the micro-batch's share of the mini-batch loss (already divided by the
mini-batch's token or sequence count, found in ``micro_batch.meta``), so the backend only
sums gradients over micro-batches.
"""


@dataclass
class RoleSpec:
    """What a backend builds for one role: ``actor``, ``ref`` or ``critic``."""

    role: str
    model_path: str
    trainable: bool
    dtype: str = "float32"
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    total_steps: int = 1
    lr_schedule: str = "constant"
    grad_clip: float = 1.0
    micro_batch_size: int = 4
    gradient_checkpointing: bool = False
    value_head: bool = False
    seed: int = 0
    trust_remote_code: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class TrainWorker(Protocol):
    """One role's model on one process: computes log-probs and values, and trains."""

    def compute_log_probs(self, batch: Batch, with_entropy: bool = False) -> Batch:
        """Return a batch with ``log_probs`` (B, R) (and ``entropy`` (B, R) if asked)."""

    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on a mini-batch, split into micro-batches with gradient accumulation."""

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Full tensors for the rollout engine, named as in the Hugging Face model."""

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def save_pretrained(self, path: str) -> None:
        """Write the model (and tokenizer) in Hugging Face format."""


# ---------------------------------------------------------------------------------------------
# Algorithm
@runtime_checkable
class Algorithm(Protocol):
    """An RL algorithm: advantages from rewards, and the losses that use them."""

    needs_ref: bool
    needs_critic: bool

    def compute_advantages(self, batch: Batch) -> Batch:
        """Add ``advantages`` (B, R) and ``returns`` (B, R) to a scored batch (``token_level_scores``)."""

    def policy_loss_fn(self) -> LossFn:
        """The actor's loss, used by :meth:`TrainWorker.train_step`."""

    def metrics(self, batch: Batch) -> dict[str, float]:
        """Per-step statistics of the batch (advantages, returns, KL, ...)."""


# ---------------------------------------------------------------------------------------------
# Reward
@dataclass
class RewardBatch:
    """What a reward sees: one entry per response. Plain Python values, no tensors."""

    prompts: list[str]
    responses: list[str]
    ground_truths: list[Any]
    data_sources: list[str]
    extra_infos: list[dict[str, Any]]
    response_lengths: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.responses)


@dataclass
class RewardOutput:
    """Scores, one per response, and optional per-response extra values logged as metrics."""

    scores: list[float]
    extra: dict[str, list[float]] = field(default_factory=dict)


RewardFn = Callable[[RewardBatch], "list[float] | RewardOutput"]


# ---------------------------------------------------------------------------------------------
# Loggers
@dataclass
class RunInfo:
    """What a logger knows about the run it records."""

    output_dir: str
    project: str
    experiment: str
    config: dict[str, Any]
    resumed: bool = False


@runtime_checkable
class Logger(Protocol):
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        """A few (prompt, response, reward) rows to look at."""

    def finish(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# Launchers and worker groups
@runtime_checkable
class WorkerGroup(Protocol):
    """Workers of one role. The controller calls methods on the group, never on a worker.

    ``call(method, batch)`` splits ``batch`` by data-parallel rank, runs ``method`` on each worker
    and gathers the results (batches are concatenated, metric dicts averaged).
    ``call_all(method, *args)`` runs ``method`` on every worker with the same arguments.
    """

    world_size: int

    def call(self, method: str, batch: Batch, *args: Any, **kwargs: Any) -> Any: ...

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class Launcher(Protocol):
    def create_group(self, role: str, build: Callable[[int, int], Any], world_size: int) -> WorkerGroup:
        """Start ``world_size`` workers, each built on its own process by ``build(rank, world_size)``."""

    def shutdown(self) -> None: ...
