"""The training step every backend shares: micro-batch loops, exact gradient accumulation, metrics.

A backend implements the few model-specific primitives of :class:`StepEngine` (a forward pass, backward,
the optimizer step, a collective over its data-parallel group); :func:`run_update` and
:func:`run_forward` hold the loops once, so the ``torch``, ``fsdp2``/``fsdp`` (and later ``megatron``)
backends differ only in how they hold the model.

Exactness across micro-batches and data-parallel ranks: a loss divides by the token and sequence counts
of the whole *global* mini-batch (:class:`rlx.records.LossContext`, its third argument, summed over
the data-parallel group here), so summing the micro-batches' gradients on every rank and over ranks gives
exactly the mini-batch gradient. Every rank runs the same number of forward passes (collectives of a
sharded model must match), which the loops arrange by splitting each rank's rows into the group's
largest micro-batch count.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

from rlx import _compat
from rlx.batch import trained_mask
from rlx.records import ForwardOptions, LossContext, RoleSettings, UpdateContext, lora_spec

if TYPE_CHECKING:
    import torch

    from rlx.batch import Batch
    from rlx.config import RLXConfig
    from rlx.protocols import LossFn

# The columns a model's forward pass reads; nothing else travels to the device.
MODEL_COLUMNS = ("prompts", "prompt_mask", "responses", "response_mask")


class StepEngine(Protocol):
    """What :func:`run_update` needs from a backend's worker."""

    dp_size: int

    def forward(self, micro: Batch, *, grad: bool, entropy_grad: bool = True,
                temperature: float = 1.0) -> dict[str, torch.Tensor]:
        """Outputs on ``micro`` (already on the device): ``log_probs``/``entropy`` (b, R), or ``values``."""

    def backward(self, loss: torch.Tensor) -> None: ...

    def zero_grad(self) -> None: ...

    def optimizer_step(self) -> tuple[float, bool, float]:
        """Clip and step: (global grad norm, whether the step was applied, the lr it used)."""

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """``op`` (``sum`` or ``max``) over the data-parallel group; the values themselves on one process."""

    def to_device(self, micro: Batch) -> Batch: ...


def row_tokens(batch: Batch) -> list[int]:
    """Tokens of each row: its valid prompt and response tokens (the packed length of its sequence)."""
    return [int(v) for v in (batch["prompt_mask"].sum(-1) + batch["response_mask"].sum(-1)).tolist()]


# Token-budget micro-batches of nearly equal tokens (_token_bins); False: first-fit's, as before 2026-12-07
# (benchmarks/grpo_vs_trl.py --first-fit-micro-batches is the A/B).
EVEN_MICRO_BATCHES = True


def _token_bins(tokens: list[int], budget: int, count: int) -> list[list[int]]:
    """Row indices in ``count`` groups of at most ``budget`` tokens each (``count`` is at most the number of
    rows), or in as many as first-fit decreasing needs if that is more, with nearly equal token counts.

    First-fit decreasing says how many groups are needed; the rows, heaviest first, then go each to the
    lightest group it fits in (so the last group is not a remainder: a lower peak of activation memory for
    the same passes). Where that does not fit them all, first-fit's groups are kept, and the heaviest of
    several rows are halved until there are ``count``.
    """
    order = sorted(range(len(tokens)), key=lambda i: (-tokens[i], i))
    bins, loads = _first_fit(tokens, order, budget)
    even = _even_bins(tokens, order, budget, max(count, len(bins))) if EVEN_MICRO_BATCHES else None
    if even is not None:
        return even
    while len(bins) < count:
        b = max((b for b in range(len(bins)) if len(bins[b]) > 1), key=lambda b: loads[b])
        rows = bins.pop(b)
        loads.pop(b)
        for half in (rows[0::2], rows[1::2]):  # rows are heaviest first: alternating splits the load evenly
            bins.append(half)
            loads.append(sum(tokens[i] for i in half))
    return [sorted(rows) for rows in bins]


def _first_fit(tokens: list[int], order: list[int], budget: int) -> tuple[list[list[int]], list[int]]:
    """The rows (``order``: heaviest first) first-fit into groups of at most ``budget`` tokens, with their loads."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + tokens[i] <= budget:
                bins[b].append(i)
                loads[b] += tokens[i]
                break
        else:
            bins.append([i])
            loads.append(tokens[i])
    return bins, loads


def _even_bins(tokens: list[int], order: list[int], budget: int, count: int) -> list[list[int]] | None:
    """The rows (``order``: heaviest first) in ``count`` groups, each row to the lightest group it fits in
    within ``budget``; None where one fits in none."""
    bins: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for i in order:
        fits = [b for b in range(count) if loads[b] + tokens[i] <= budget]
        if not fits:
            return None
        b = min(fits, key=lambda b: (loads[b], len(bins[b]), b))  # rows of no tokens fill empty groups too
        bins[b].append(i)
        loads[b] += tokens[i]
    return [sorted(rows) for rows in bins]


def distinct_prompts(prompts: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts (b, P) with their mask, equal token for token and in padding (a GRPO prompt's responses):
    (the first row of each distinct prompt, and for each row the index of its prompt among those, numbered from
    0 in no particular order)."""
    import torch

    real = mask.long()
    tokens = prompts.long() * real
    # Rows grouped by a 64-bit hash of their tokens and padding (a 1-d unique, not one over whole rows), then
    # checked token for token against their group's first row; a collision falls back to comparing whole rows.
    groups = torch.unique(_row_hash(tokens, real), return_inverse=True)[1]
    firsts = _firsts(groups)
    if not (torch.equal(tokens, tokens[firsts][groups]) and torch.equal(real, real[firsts][groups])):
        rows = torch.cat([tokens, real], dim=1)  # padding cannot make two prompts equal
        groups = torch.unique(rows, dim=0, return_inverse=True)[1]
        firsts = _firsts(groups)
    return firsts, groups


def _row_hash(tokens: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """(b,) int64: each row's tokens and padding under fixed random weights (sums wrap around)."""
    import torch

    weights = torch.randint(1, 2**62, (2, tokens.shape[1]), generator=torch.Generator().manual_seed(0))
    weights = weights.to(tokens.device)
    return (tokens * weights[0] + real * weights[1]).sum(1)


def _firsts(groups: torch.Tensor) -> torch.Tensor:
    """The first row of each group (numbered from 0) of ``groups`` (b,)."""
    import torch

    count = int(groups.max()) + 1 if groups.numel() else 0
    order = torch.arange(groups.shape[0], device=groups.device)
    firsts = torch.full((count,), groups.shape[0], dtype=torch.long, device=groups.device)
    return firsts.scatter_reduce(0, groups, order, "amin")


def prompt_groups(batch: Batch) -> torch.Tensor:
    """(b,) the group of each row: rows with the same prompt are one group (:func:`distinct_prompts`)."""
    return distinct_prompts(batch["prompts"], batch["prompt_mask"])[1]


class PromptShares(NamedTuple):
    """Per row: its prompt's group (:func:`prompt_groups`), its valid prompt and response tokens."""

    groups: list[int]
    prompts: list[int]
    responses: list[int]

    def load(self, rows: list[int]) -> int:
        """The tokens ``rows`` put through a model that carries each shared prompt once."""
        seen: set[int] = set()
        total = 0
        for row in rows:
            total += self.responses[row] + (0 if self.groups[row] in seen else self.prompts[row])
            seen.add(self.groups[row])
        return total

    def members(self) -> list[list[int]]:
        """The rows of each prompt, in row order (prompts in the order of their first row)."""
        rows: dict[int, list[int]] = {}
        for row, group in enumerate(self.groups):
            rows.setdefault(group, []).append(row)
        return list(rows.values())


def prompt_shares(batch: Batch) -> PromptShares:
    """The :class:`PromptShares` of ``batch`` (it needs ``prompts``, ``prompt_mask`` and ``response_mask``)."""
    return PromptShares([int(g) for g in prompt_groups(batch).tolist()],
                        [int(v) for v in batch["prompt_mask"].sum(-1).tolist()],
                        [int(v) for v in batch["response_mask"].sum(-1).tolist()])


def _shared_items(shares: PromptShares, budget: int) -> list[tuple[list[int], int]]:
    """The rows as items for micro-batches whose rows share their prompts (``share_prompts``): each item
    the rows of one prompt, in row order, cut where the prompt (counted once) and the responses so far would
    pass ``budget``; with its tokens."""
    items: list[tuple[list[int], int]] = []
    for rows in shares.members():
        item: list[int] = []
        for row in rows:
            if item and shares.load([*item, row]) > budget:
                items.append((item, shares.load(item)))
                item = []
            item.append(row)
        items.append((item, shares.load(item)))
    return items


def _shared_bins(items: list[tuple[list[int], int]], shares: PromptShares, budget: int,
                 count: int) -> list[list[int]]:
    """``count`` groups of rows from ``items``, none over ``budget`` tokens (prompts counted once): whole items
    in nearly even groups (:func:`_token_bins`), as many groups as the items allow; then, while there are fewer
    than ``count`` (another rank needs more micro-batches), the group of the most tokens halved by its rows in
    row order (a part of a group never holds more tokens than the group, and a prompt's rows stay together as
    far as they can)."""
    held = _token_bins([load for _, load in items], budget, min(count, len(items)))
    bins = [sorted(row for k in part for row in items[k][0]) for part in held]
    while len(bins) < count:
        rows = bins.pop(max((b for b in range(len(bins)) if len(bins[b]) > 1), key=lambda b: shares.load(bins[b])))
        bins += [rows[:len(rows) // 2], rows[len(rows) // 2:]]
    return [sorted(rows) for rows in bins]


def micro_batches(engine: StepEngine, batch: Batch, size: int, budget: tuple[int, str] | None = None,
                  share_prompts: bool = False) -> list[tuple[list[int] | None, Batch]]:
    """``batch`` cut into micro-batches, as many on every rank as on the rank that needs the most (a rank
    with fewer rows gets smaller ones), each with the batch's row indices it holds (None: consecutive).

    Without ``budget``: at most ``size`` rows each. With ``budget`` = (max tokens, the option that sets
    it): rows grouped so that no micro-batch holds more than max tokens (:func:`row_tokens`). With
    ``share_prompts`` as well (the engine's packed rows carry a shared prompt once): a prompt's rows are kept
    together where the budget allows, and the prompt counts once.
    """
    shares: PromptShares | None = None
    items: list[tuple[list[int], int]] = []
    if budget is None:
        local = math.ceil(len(batch) / size) if len(batch) else 0
    else:
        max_tokens, option = budget
        tokens = row_tokens(batch)
        longest = max(tokens, default=0)
        if longest > max_tokens:
            from rlx.errors import UserError

            raise UserError(f"A sequence of {longest} tokens (prompt and response) is longer than the token budget "
                            f"of one micro-batch, {option}={max_tokens}.",
                            f"Raise {option} to at least data.max_prompt_length + data.max_response_length, or "
                            "turn use_dynamic_bsz off.")
        loads = tokens
        if share_prompts:
            shares = prompt_shares(batch)
            items = _shared_items(shares, max_tokens)
            loads = [load for _, load in items]
        local = len(_first_fit(loads, sorted(range(len(loads)), key=lambda i: (-loads[i], i)), max_tokens)[0])
    count = int(engine.all_reduce([float(local)], op="max")[0])
    if len(batch) < count:
        raise RuntimeError(f"a data-parallel rank got {len(batch)} rows for {count} micro-batches; "
                           "the driver must give every rank enough rows")
    if budget is not None:
        if shares is not None:
            bins = _shared_bins(items, shares, budget[0], count)
        else:
            bins = _token_bins(tokens, budget[0], count)
        return [(rows, batch.index(rows)) for rows in bins]
    if count == local:
        return [(None, mb) for mb in batch.split(size)]
    return [(None, mb) for mb in batch.chunk(count)]


def run_forward(engine: StepEngine, batch: Batch, size: int, fn: Callable[[Batch], dict[str, torch.Tensor]],
                budget: tuple[int, str] | None = None, share_prompts: bool = False) -> dict[str, torch.Tensor]:
    """``fn(micro_batch)`` (per-row tensors by name) over ``batch`` in micro-batches (no gradients; the
    engine sets eval mode), concatenated in the batch's row order. ``share_prompts``: see :func:`micro_batches`."""
    import torch

    parts = micro_batches(engine, batch.select(*MODEL_COLUMNS), size, budget, share_prompts)
    outputs = [fn(engine.to_device(mb)) for _, mb in parts]
    if not outputs:
        return {}
    out = {k: torch.cat([o[k] for o in outputs]) for k in outputs[0]}
    if budget is not None:
        order = torch.tensor([i for rows, _ in parts for i in rows or []])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        out = {k: v[inverse.to(v.device)] for k, v in out.items()}
    return out


def role_settings(config: RLXConfig | None, role: str) -> RoleSettings:
    """The forward-pass settings of a role from the config (``RoleSpec.forward``): packing, the chunked head,
    token budgets, compilation and the trained weights' dtype; and its LoRA adapters (``RoleSpec.lora``). The
    reference scores like the actor's log-prob passes (with LoRA on, no reference worker is built: the actor
    scores with its adapter off). No config: the defaults."""
    if config is None:
        return RoleSettings()
    lora = lora_spec(config.model)
    if role == "critic":
        c = config.critic
        return RoleSettings(ForwardOptions(
            use_remove_padding=c.use_remove_padding, share_prompts=c.share_prompts, use_dynamic_bsz=c.use_dynamic_bsz,
            ppo_max_token_len=c.ppo_max_token_len_per_gpu, ppo_max_token_len_option="critic.ppo_max_token_len_per_gpu",
            log_prob_max_token_len=c.forward_max_token_len_per_gpu,
            log_prob_max_token_len_option="critic.forward_max_token_len_per_gpu",
            ulysses_sequence_parallel_size=c.ulysses_sequence_parallel_size, use_torch_compile=c.use_torch_compile,
            model_dtype=c.model_dtype), lora, dict(config.model.override_config), config.model.router_dtype)
    a = config.actor
    return RoleSettings(ForwardOptions(
        use_remove_padding=a.use_remove_padding, share_prompts=a.share_prompts, use_dynamic_bsz=a.use_dynamic_bsz,
        log_prob_chunk_size=a.log_prob_chunk_size,
        ppo_max_token_len=a.ppo_max_token_len_per_gpu, ppo_max_token_len_option="actor.ppo_max_token_len_per_gpu",
        log_prob_max_token_len=a.log_prob_max_token_len_per_gpu,
        log_prob_max_token_len_option="actor.log_prob_max_token_len_per_gpu",
        ulysses_sequence_parallel_size=a.ulysses_sequence_parallel_size, use_torch_compile=a.use_torch_compile,
        model_dtype=a.model_dtype), lora, dict(config.model.override_config), config.model.router_dtype)


def loss_context(engine: StepEngine, mini: Batch, context: UpdateContext) -> LossContext:
    """The mini-batch's :class:`LossContext`: its response tokens and sequences summed over the data-parallel
    group (every rank calls this, as the all-reduce needs)."""
    mask = trained_mask(mini)
    tokens, seqs = engine.all_reduce([float(mask.sum()), float((mask.sum(-1) > 0).sum())])
    return LossContext(tokens, seqs, context.max_response_length, context.old_from_update)


def run_update(engine: StepEngine, minibatches: list[Batch], loss_fn: LossFn, micro_size: int,
               budget: tuple[int, str] | None = None, context: UpdateContext | None = None,
               share_prompts: bool = False) -> list[dict[str, float]]:
    """One optimizer step per mini-batch (this rank's rows of it), accumulating over micro-batches of
    ``micro_size`` rows, or of at most ``budget[0]`` tokens when a budget is given (dynamic batch size;
    ``share_prompts``: see :func:`micro_batches`).
    The forward passes run at ``context.temperature``; the loss gets a :class:`LossContext` with the
    mini-batch's global counts.

    Returns one metrics dict per step: the loss's metrics averaged over the mini-batch's tokens (on every
    rank, so the ranks return the same values), and
    ``grad_norm``, ``lr`` and ``skipped_step`` (1 when a non-finite gradient norm skipped the update).
    """
    entropy_grad = bool(getattr(loss_fn, "needs_entropy_grad", True))
    context = context or UpdateContext()
    out = []
    for mini in minibatches:
        ctx = loss_context(engine, mini, context)
        engine.zero_grad()
        sums: dict[str, float] = {}
        weight = 0.0
        for _, mb in micro_batches(engine, mini, micro_size, budget, share_prompts):
            mb = engine.to_device(mb)
            outputs = engine.forward(mb, grad=True, entropy_grad=entropy_grad, temperature=context.temperature)
            loss, metrics = loss_fn(outputs, mb, ctx)
            engine.backward(loss)
            w = float(trained_mask(mb).sum())
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


# Names that lived here in rlx 0.1 (issue 26 moved them); kept for one release, with a DeprecationWarning.
__getattr__ = _compat.moved_attributes(__name__, {
    "balance_for_ranks": "rlx.dispatch",
    "balanced_order": "rlx.dispatch",
})
