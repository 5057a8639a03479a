"""Data-parallel dispatch, one rule for every launcher: a call's data is split by data-parallel rank
(:func:`shard`; under dynamic batch sizes first reordered so the ranks get nearly equal token counts,
:func:`balance`), the workers' results are combined (:func:`gather`) and put back in the rows' order
(:func:`unbalance`). A worker says which rank it is with ``dispatch_info()`` (:func:`dispatch_info`).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable
from typing import Any

from rlx.batch import Batch, concat_rollouts
from rlx.protocols import DispatchInfo
from rlx.step import prompt_shares, row_tokens


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


def balanced_roles(config: Any) -> dict[str, bool]:
    """The roles whose calls are balanced over data-parallel ranks by tokens, each with whether its workers
    carry a shared prompt once (``share_prompts`` with packed rows, no Ulysses, not megatron; then a prompt's
    rows go to one rank together). Balanced are those with dynamic batch sizes (``actor.use_dynamic_bsz``,
    which the reference follows, and ``critic.use_dynamic_bsz``), as verl balances under dynamic batch sizes.
    Without it a rank's micro-batches are counted in rows, and moving rows between ranks would only change the
    float order of the update's sums."""
    if config is None:
        return {}
    actor, critic = config.actor, config.critic

    def shares(role: Any) -> bool:  # as the workers decide (TorchWorker.share_prompts), as far as the config says
        return bool(role.share_prompts and role.use_remove_padding and role.ulysses_sequence_parallel_size == 1
                    and config.backend.name != "megatron")

    return {name: shares(role) for name, role in (("actor", actor), ("ref", actor), ("critic", critic))
            if role.use_dynamic_bsz}


def balance(value: Any, parts: int, share_prompts: bool = False) -> tuple[Any, list[int] | None]:
    """A call's data reordered so that :func:`shard` gives every data-parallel rank as many rows as before
    with nearly equal token counts (``rlx.dispatch.balanced_order``), and the order to undo on its per-row
    results (None: nothing to undo; the mini-batches of an update, each balanced, return metrics)."""
    if isinstance(value, Batch):
        order = balanced_order(value, parts, share_prompts)
        return (value, None) if order is None else (value.index(order), order)
    if isinstance(value, list) and value and all(isinstance(v, Batch) for v in value):
        return [balance_for_ranks(v, parts, share_prompts) for v in value], None
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


def balanced_order(batch: Batch, parts: int, share_prompts: bool = False) -> list[int] | None:
    """The order of ``batch``'s rows after which ``chunk(parts)`` gives every data-parallel rank as many rows
    as it gives now, with nearly equal token counts (:func:`row_tokens`): each row, heaviest first, goes to
    the rank with the fewest tokens that still has room, so the ranks' totals differ by at most about the
    longest row. Rows keep their order within a rank. None when there is nothing to balance: one rank, no
    more rows than ranks, or no prompt and response masks to count tokens by.

    ``share_prompts`` (the ranks' workers carry a shared prompt once, ``actor.share_prompts``): what is placed
    is a prompt's rows together, weighed with the prompt once (a GRPO group stays on one rank, so its prompt
    is carried once in all, not once on every rank its rows reach). A group larger than any rank's room left
    is cut: as many of its rows as fit go to the rank with the most room, the rest is placed again. Then
    groups of equal size are swapped between the heaviest and the lightest rank while that narrows the gap.
    Whole groups are coarse where a rank holds few of them: of the three orders (by groups, by rows, and the
    batch's own, whose plain split keeps neighbouring rows together), the one whose heaviest rank carries the
    fewest tokens, prompts counted once on each rank, is taken.
    """
    n = len(batch)
    if parts <= 1 or n <= parts or "prompt_mask" not in batch or "response_mask" not in batch:
        return None
    room = [n * (r + 1) // parts - n * r // parts for r in range(parts)]
    tokens = row_tokens(batch)
    ranks = _place([[i] for i in range(n)], lambda rows: sum(tokens[i] for i in rows), room)
    if not (share_prompts and "prompts" in batch):
        return _order(ranks)
    shares = prompt_shares(batch)
    groups = _place(shares.members(), shares.load, room)
    _swap_evenly(groups, shares.load)
    plain = [[list(range(n * r // parts, n * (r + 1) // parts))] for r in range(parts)]

    def heaviest(placed: list[list[list[int]]]) -> int:
        return max(shares.load([row for item in items for row in item]) for items in placed)

    best = min((groups, plain, ranks), key=heaviest)  # the first of the lightest: groups where they tie
    return None if best is plain else _order(best)


def _order(ranks: list[list[list[int]]]) -> list[int]:
    """The rows of each rank's items in row order, rank after rank."""
    return [i for placed in ranks for i in sorted(row for item in placed for row in item)]


def _place(items: list[list[int]], load: Callable[[list[int]], int], room: list[int]) -> list[list[list[int]]]:
    """``items`` (lists of rows) over ranks with ``room[r]`` rows each (in all, as many as the items hold):
    heaviest first, each to the lightest rank with room for it, or cut where none has (see
    :func:`balanced_order`). Returns the items of each rank."""
    parts = len(room)
    room = list(room)
    totals = [0] * parts
    ranks: list[list[list[int]]] = [[] for _ in range(parts)]
    queue = [(-load(item), item[0], item) for item in items]  # heaviest first (items start at distinct rows)
    heapq.heapify(queue)
    while queue:
        neg_load, _, item = heapq.heappop(queue)
        fits = [r for r in range(parts) if room[r] >= len(item)]
        if fits:
            r = min(fits, key=lambda r: (totals[r], r))
        else:
            r = max(range(parts), key=lambda r: (room[r], -totals[r], -r))
            item, rest = item[:room[r]], item[room[r]:]
            heapq.heappush(queue, (-load(rest), rest[0], rest))
            neg_load = -load(item)
        ranks[r].append(item)
        totals[r] -= neg_load
        room[r] -= len(item)
    return ranks


def _swap_evenly(ranks: list[list[list[int]]], load: Callable[[list[int]], int]) -> None:
    """Swap items of equal size between the heaviest and the lightest rank, the pair that brings them
    closest, while one narrows their gap (a few rounds: the placement is already near even)."""
    loads = [[load(item) for item in placed] for placed in ranks]
    totals = [sum(row) for row in loads]
    for _ in range(4 * len(ranks)):
        heavy = max(range(len(ranks)), key=lambda r: (totals[r], -r))
        light = min(range(len(ranks)), key=lambda r: (totals[r], r))
        gap = totals[heavy] - totals[light]
        lighter: dict[int, list[tuple[int, int]]] = {}  # the light rank's (load, index) by item size, sorted
        for b, y in enumerate(ranks[light]):
            lighter.setdefault(len(y), []).append((loads[light][b], b))
        for pairs in lighter.values():
            pairs.sort()
        best: tuple[int, int, int] | None = None  # (the gap after the swap, index in heavy, index in light)
        for a, x in enumerate(ranks[heavy]):
            pairs = lighter.get(len(x), [])
            k = bisect.bisect_left(pairs, (2 * loads[heavy][a] - gap) // 2 - 1, key=lambda p: p[0])
            for _, b in pairs[max(k - 1, 0):k + 2]:  # the loads nearest to moving half the gap
                moved = loads[heavy][a] - loads[light][b]
                if 0 < moved < gap and (best is None or abs(gap - 2 * moved) < best[0]):
                    best = (abs(gap - 2 * moved), a, b)
        if best is None:
            return
        _, a, b = best
        moved = loads[heavy][a] - loads[light][b]
        ranks[heavy][a], ranks[light][b] = ranks[light][b], ranks[heavy][a]
        loads[heavy][a], loads[light][b] = loads[light][b], loads[heavy][a]
        totals[heavy] -= moved
        totals[light] += moved


def balance_for_ranks(batch: Batch, parts: int, share_prompts: bool = False) -> Batch:
    """``batch``'s rows in :func:`balanced_order` (``batch`` itself when there is nothing to balance). For an
    update the order of a mini-batch's rows does not change its gradient (the loss is a sum over rows with
    global counts), up to the order of float additions."""
    order = balanced_order(batch, parts, share_prompts)
    return batch if order is None else batch.index(order)
