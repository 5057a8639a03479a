"""Data-parallel dispatch, one rule for every launcher: a call's data is split by data-parallel rank
(:func:`shard`; under dynamic batch sizes first reordered so the ranks get nearly equal token counts,
:func:`balance`), the workers' results are combined (:func:`gather`) and put back in the rows' order
(:func:`unbalance`). A worker says which rank it is with ``dispatch_info()`` (:func:`dispatch_info`).
"""

from __future__ import annotations

from typing import Any

from rlx.batch import Batch, concat_rollouts
from rlx.protocols import DispatchInfo
from rlx.step import row_tokens


def shard(value: Any, parts: int) -> list[Any]:
    """Split a call's data argument by data-parallel rank: a batch into ``parts`` nearly equal chunks, a
    list of batches (mini-batches of an update) chunk by chunk; anything else goes whole to every rank."""
    if parts == 1:
        return [value]
    if isinstance(value, Batch):
        if len(value) < parts:
            raise ValueError(f"{len(value)} rows cannot be split over {parts} data-parallel ranks")
        return value.chunk(parts)
    if isinstance(value, list) and value and all(isinstance(v, Batch) for v in value):
        per_item = [shard(v, parts) for v in value]
        return [[chunks[r] for chunks in per_item] for r in range(parts)]
    return [value] * parts


def balanced_roles(config: Any) -> frozenset[str]:
    """The roles whose calls are balanced over data-parallel ranks by tokens: those with dynamic batch sizes
    (``actor.use_dynamic_bsz``, which the reference follows, and ``critic.use_dynamic_bsz``), as verl
    balances under dynamic batch sizes. Without it a rank's micro-batches are counted in rows, and moving
    rows between ranks would only change the float order of the update's sums."""
    if config is None:
        return frozenset()
    return frozenset(role for role, on in (("actor", config.actor.use_dynamic_bsz),
                                           ("ref", config.actor.use_dynamic_bsz),
                                           ("critic", config.critic.use_dynamic_bsz)) if on)


def balance(value: Any, parts: int) -> tuple[Any, list[int] | None]:
    """A call's data reordered so that :func:`shard` gives every data-parallel rank as many rows as before
    with nearly equal token counts (``rlx.dispatch.balanced_order``), and the order to undo on its per-row
    results (None: nothing to undo; the mini-batches of an update, each balanced, return metrics)."""
    if isinstance(value, Batch):
        order = balanced_order(value, parts)
        return (value, None) if order is None else (value.index(order), order)
    if isinstance(value, list) and value and all(isinstance(v, Batch) for v in value):
        return [balance_for_ranks(v, parts) for v in value], None
    return value, None


def unbalance(result: Any, order: list[int] | None) -> Any:
    """Per-row results of a balanced call back in the rows' original order."""
    if order is None or not isinstance(result, Batch):
        return result
    inverse = [0] * len(order)
    for position, row in enumerate(order):
        inverse[row] = position
    return result.index(inverse)


def gather(results: list[Any]) -> Any:
    """Combine the data-parallel ranks' results: batches are concatenated (rollouts of different response
    widths padded first), metric dicts averaged, lists (one entry per optimizer step) entry by entry."""
    if len(results) == 1:
        return results[0]
    first = results[0]
    if isinstance(first, Batch):
        # Responses of different widths: the narrower ones are padded with 0 under a response_mask of 0 (no
        # reader looks at a padded position: decoding stops at the mask, attention and losses mask it out).
        return concat_rollouts(results, 0)
    if isinstance(first, dict):
        return {k: sum(r[k] for r in results) / len(results) for k in first}
    if isinstance(first, list):
        return [gather([r[i] for r in results]) for i in range(len(first))]
    return results


def dispatch_info(worker: Any, rank: int, world_size: int) -> DispatchInfo:
    """What a worker reports (``worker.dispatch_info()``); by default each rank is its own data-parallel rank."""
    info = getattr(worker, "dispatch_info", None)
    return info() if callable(info) else DispatchInfo(rank, world_size, True)


def balanced_order(batch: Batch, parts: int) -> list[int] | None:
    """The order of ``batch``'s rows after which ``chunk(parts)`` gives every data-parallel rank as many rows
    as it gives now, with nearly equal token counts (:func:`row_tokens`): each row, heaviest first, goes to
    the rank with the fewest tokens that still has room, so the ranks' totals differ by at most about the
    longest row. Rows keep their order within a rank. None when there is nothing to balance: one rank, no
    more rows than ranks, or no prompt and response masks to count tokens by."""
    n = len(batch)
    if parts <= 1 or n <= parts or "prompt_mask" not in batch or "response_mask" not in batch:
        return None
    tokens = row_tokens(batch)
    room = [n * (r + 1) // parts - n * r // parts for r in range(parts)]
    load = [0] * parts
    ranks: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(n), key=lambda i: (-tokens[i], i)):
        r = min((r for r in range(parts) if room[r]), key=lambda r: (load[r], r))
        ranks[r].append(i)
        load[r] += tokens[i]
        room[r] -= 1
    return [i for rows in ranks for i in sorted(rows)]


def balance_for_ranks(batch: Batch, parts: int) -> Batch:
    """``batch``'s rows in :func:`balanced_order` (``batch`` itself when there is nothing to balance). For an
    update the order of a mini-batch's rows does not change its gradient (the loss is a sum over rows with
    global counts), up to the order of float additions."""
    order = balanced_order(batch, parts)
    return batch if order is None else batch.index(order)
