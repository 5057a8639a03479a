"""The training step every backend shares: micro-batch loops, exact gradient accumulation, metrics.

A backend implements the few model-specific primitives of :class:`StepEngine` (a forward pass, backward,
the optimizer step, a collective over its data-parallel group); :func:`run_update` and
:func:`run_forward` hold the loops once, so the ``torch``, ``fsdp2``/``fsdp`` (and later ``megatron``)
backends differ only in how they hold the model.

Exactness across micro-batches and data-parallel ranks: a loss divides by the token and sequence counts
of the whole *global* mini-batch (``meta["minibatch_tokens"]`` / ``meta["minibatch_seqs"]``, summed over
the data-parallel group here), so summing the micro-batches' gradients on every rank and over ranks gives
exactly the mini-batch gradient. Every rank runs the same number of forward passes (collectives of a
sharded model must match), which the loops arrange by splitting each rank's rows into the group's
largest micro-batch count.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from rlx.batch import Batch
    from rlx.protocols import LossFn

# The columns a model's forward pass reads; nothing else travels to the device.
MODEL_COLUMNS = ("prompts", "prompt_mask", "responses", "response_mask")


class StepEngine(Protocol):
    """What :func:`run_update` needs from a backend's worker."""

    dp_size: int

    def forward(self, micro: Batch, *, grad: bool, entropy_grad: bool = True) -> dict[str, torch.Tensor]:
        """Outputs on ``micro`` (already on the device): ``log_probs``/``entropy`` (b, R), or ``values``."""

    def backward(self, loss: torch.Tensor) -> None: ...

    def zero_grad(self) -> None: ...

    def optimizer_step(self) -> tuple[float, bool, float]:
        """Clip and step: (global grad norm, whether the step was applied, the lr it used)."""

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """``op`` (``sum`` or ``max``) over the data-parallel group; the values themselves on one process."""

    def to_device(self, micro: Batch) -> Batch: ...


def micro_batches(engine: StepEngine, batch: Batch, size: int) -> list[Batch]:
    """``batch`` cut into micro-batches of at most ``size`` rows, as many on every rank as on the rank
    that needs the most (a rank with fewer rows gets smaller ones)."""
    local = math.ceil(len(batch) / size) if len(batch) else 0
    count = int(engine.all_reduce([float(local)], op="max")[0])
    if count == local:
        return batch.split(size)
    if len(batch) < count:
        raise RuntimeError(f"a data-parallel rank got {len(batch)} rows for {count} micro-batches; "
                           "the driver must give every rank enough rows")
    return batch.chunk(count)


def run_forward(engine: StepEngine, batch: Batch, size: int, fn: Callable[[Batch], Any]) -> list[Any]:
    """``fn(micro_batch)`` over ``batch`` in micro-batches (no gradients; the engine sets eval mode)."""
    return [fn(engine.to_device(mb)) for mb in micro_batches(engine, batch.select(*MODEL_COLUMNS), size)]


def run_update(engine: StepEngine, minibatches: list[Batch], loss_fn: LossFn,
               micro_size: int) -> list[dict[str, float]]:
    """One optimizer step per mini-batch (this rank's rows of it), accumulating over micro-batches.

    Returns one metrics dict per step: the loss's metrics averaged over the mini-batch's tokens (on every
    rank, so the ranks return the same values), and
    ``grad_norm``, ``lr`` and ``skipped_step`` (1 when a non-finite gradient norm skipped the update).
    """
    entropy_grad = bool(getattr(loss_fn, "needs_entropy_grad", True))
    out = []
    for mini in minibatches:
        mask = mini["response_mask"]
        tokens, seqs = engine.all_reduce([float(mask.sum()), float((mask.sum(-1) > 0).sum())])
        mini.meta["minibatch_tokens"], mini.meta["minibatch_seqs"] = tokens, seqs
        engine.zero_grad()
        sums: dict[str, float] = {}
        weight = 0.0
        for mb in micro_batches(engine, mini, micro_size):
            mb = engine.to_device(mb)
            outputs = engine.forward(mb, grad=True, entropy_grad=entropy_grad)
            loss, metrics = loss_fn(outputs, mb)
            engine.backward(loss)
            w = float(mb["response_mask"].sum())
            weight += w
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * w
        grad_norm, applied, lr = engine.optimizer_step()
        # Token-weighted over the whole mini-batch, every rank's micro-batches included.
        keys = sorted(sums)
        *totals, weight = engine.all_reduce([sums[k] for k in keys] + [weight])
        step = {k: v / max(weight, 1.0) for k, v in zip(keys, totals)}
        step.update(grad_norm=grad_norm, lr=lr, skipped_step=float(not applied))
        out.append(step)
    return out
