"""What the driver's split of a GRPO batch over data-parallel ranks leaves each rank to carry, and what a rank's
token budget cuts into micro-batches (issue 31): counted, not timed, so it runs on any CPU and needs no model.

Under dynamic batch sizes the driver reorders each call's rows so the ranks carry nearly equal tokens
(``rlx.dispatch.balanced_order``). With ``share_prompts`` on (the default), a rank's packed micro-batches carry
each prompt once, so what a rank carries is its responses plus each of its prompts once. Three orders compete:

- ``plain``: the batch as it comes (a GRPO group's rows are neighbours, so a plain split mostly keeps them);
- ``rows``: row by row, heaviest first to the lightest rank (the balance before the fifth session: it evens
  whole-row tokens, scattering a group's rows over the ranks, so each carries the prompt again);
- ``chosen``: today's, groups placed whole (prompt once) where that beats the other two.

The table gives the heaviest rank's tokens (what the step waits for) and all ranks' tokens together (the work
done), for ``--ranks`` ranks. ``micro`` gives, for one rank's rows at the budget ``--budget`` (shared prompts
counted once), the largest micro-batch under first-fit (before) and under today's even groups: the same
number of passes, a lower peak of activation memory. ``ms`` is the driver's time to compute the order.

    python benchmarks/dispatch_balance.py            # the shapes below, seeds 0-2
    python benchmarks/dispatch_balance.py --smoke    # CI: one small shape, one seed
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import torch

from rlx.batch import Batch
from rlx.dispatch import balanced_order, shard
from rlx.step import _first_fit, _token_bins, prompt_shares


@dataclass(frozen=True)
class Shape:
    name: str
    prompts: int  # prompts in the call (a mini-batch of the update, or the whole batch for log-probs)
    n: int  # responses per prompt
    prompt_tokens: tuple[int, int]  # uniform range
    response_mean: int  # responses: exponential around this, at least 8, at most response_max
    response_max: int


SHAPES = [
    # verl's GSM8K GRPO examples: 1024 prompts x 5 (the log-prob pass over the whole batch), mini-batches of 256
    Shape("gsm8k batch 1024x5", 1024, 5, (60, 250), 220, 1024),
    Shape("gsm8k mini-batch 256x5", 256, 5, (60, 250), 220, 1024),
    # a math run with long answers: 128 prompts x 16 in mini-batches of 32 prompts
    Shape("math mini-batch 32x16", 32, 16, (80, 400), 900, 4096),
    # rlx's GRPO benchmark shape (grpo_vs_trl.py), 8 prompts of 214 tokens x 8 samples, ragged answers
    Shape("bench 8x8", 8, 8, (214, 214), 180, 256),
]


def grpo_batch(shape: Shape, seed: int) -> Batch:
    """A GRPO call's rows: each prompt repeated for its n responses, left-padded prompts, right-padded answers."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = shape.prompt_tokens
    plens = torch.randint(lo, hi + 1, (shape.prompts,), generator=g).repeat_interleave(shape.n)
    draws = torch.empty(shape.prompts * shape.n).exponential_(1.0, generator=g) * shape.response_mean
    rlens = draws.long().clamp(8, shape.response_max)
    width_p, width_r = hi, shape.response_max
    prompt_mask = (torch.arange(width_p) >= width_p - plens[:, None]).long()
    ids = torch.randint(3, 30000, (shape.prompts, width_p), generator=g).repeat_interleave(shape.n, 0)
    return Batch({"prompts": ids * prompt_mask, "prompt_mask": prompt_mask,
                  "response_mask": (torch.arange(width_r) < rlens[:, None]).long()})


def carried(batch: Batch, ranks: int, order: list[int] | None) -> list[int]:
    """The tokens each rank carries with its prompts counted once."""
    shares = prompt_shares(batch)
    rows = list(range(len(batch))) if order is None else order
    return [shares.load(rows[len(rows) * r // ranks:len(rows) * (r + 1) // ranks]) for r in range(ranks)]


def micro(batch: Batch, budget: int) -> tuple[int, int, int]:
    """(micro-batches, largest under first-fit, largest now) for ``batch`` as one rank's rows at ``budget``."""
    from rlx.step import _shared_items

    shares = prompt_shares(batch)
    loads = [load for _, load in _shared_items(shares, budget)]
    order = sorted(range(len(loads)), key=lambda i: (-loads[i], i))
    old = _first_fit(loads, order, budget)[1]
    new = [sum(loads[i] for i in b) for b in _token_bins(loads, budget, 0)]
    return len(new), max(old), max(new)


def measure(shape: Shape, ranks: int, seed: int, budget: int) -> dict[str, object]:
    batch = grpo_batch(shape, seed)
    start = time.perf_counter()
    chosen = balanced_order(batch, ranks, share_prompts=True)
    ms = (time.perf_counter() - start) * 1000
    rows = balanced_order(batch, ranks, share_prompts=False)
    loads = {"plain": carried(batch, ranks, None), "rows": carried(batch, ranks, rows),
             "chosen": carried(batch, ranks, chosen)}
    heaviest_rank = max(range(ranks), key=lambda r: loads["chosen"][r])
    count, micro_old, micro_new = micro(shard(batch.index(chosen) if chosen else batch, ranks)[heaviest_rank], budget)
    return {"shape": shape.name, "ranks": ranks, "seed": seed, "ms": ms,
            **{f"{k}_max": max(v) for k, v in loads.items()}, **{f"{k}_sum": sum(v) for k, v in loads.items()},
            "micro_batches": count, "micro_first_fit": micro_old, "micro_even": micro_new}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--budget", type=int, default=16384, help="a rank's tokens per micro-batch")
    parser.add_argument("--json", help="one JSON line per shape, ranks and seed")
    parser.add_argument("--smoke", action="store_true", help="one small shape, one seed, 2 ranks (CI)")
    args = parser.parse_args()
    shapes, ranks, seeds = (SHAPES[-1:], [2], 1) if args.smoke else (SHAPES, args.ranks, args.seeds)
    rows = [measure(s, r, seed, args.budget) for s in shapes for r in ranks for seed in range(seeds)]
    for row in rows:  # what must hold: the chosen order is never heavier than the other two
        assert row["chosen_max"] <= min(row["plain_max"], row["rows_max"]), row
        assert row["micro_even"] <= args.budget, row
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"heaviest rank's tokens (prompts once per rank), mean of {seeds} seed(s); micro-batches of one rank at "
          f"a budget of {args.budget}")
    print("| shape | ranks | plain | rows (before) | chosen | vs rows | work vs rows | micro-batches | largest: "
          "first-fit | even | ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in shapes:
        for r in ranks:
            mine = [row for row in rows if row["shape"] == s.name and row["ranks"] == r]

            def mean(key: str, mine: list[dict[str, object]] = mine) -> float:
                return statistics.mean(float(row[key]) for row in mine)  # type: ignore[arg-type]

            heavier = mean("chosen_max") / mean("rows_max") - 1
            work = mean("chosen_sum") / mean("rows_sum") - 1
            print(f"| {s.name} | {r} | {mean('plain_max'):.0f} | {mean('rows_max'):.0f} | {mean('chosen_max'):.0f} "
                  f"| {heavier:+.1%} | {work:+.1%} | {mean('micro_batches'):.1f} | {mean('micro_first_fit'):.0f} "
                  f"| {mean('micro_even'):.0f} | {mean('ms'):.1f} |")


if __name__ == "__main__":
    main()
