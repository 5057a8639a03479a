"""Arithmetic word problems in verl's row shape, for the real-model recipe (no download needed).

Each row: ``prompt`` (one user message), ``data_source`` (``arith_words/<task>``), ``reward_model``
``{"style": "rule", "ground_truth": "<number>"}`` and ``extra_info``. The GSM8K reward reads the number
after ``####``, so the prompt asks for that format. Problems in the test split never occur in the
train split (they are drawn first and excluded).

Tasks, easiest first:
- ``one_step_small``: one addition or subtraction of numbers up to 20.
- ``one_step``: one addition or subtraction of numbers up to 50 ("Tom has 23 apples and buys 14 more").
- ``one_step_large``: the same with numbers up to 500.
- ``two_step``: two operations in a row ("... buys 14 more, then gives away 9").

    python examples/real_model/make_data.py --task one_step --out ~/data/arith_words
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

NAMES = ["Tom", "Anna", "Liam", "Mia", "Noah", "Emma", "Omar", "Sara", "Ivan", "Lena", "Ken", "Zoe"]
THINGS = ["apples", "books", "marbles", "stickers", "coins", "pencils", "cards", "shells", "cookies", "stamps"]
INSTRUCTION = "Write the final answer on the last line, after '####'."
TASKS = ("one_step_small", "one_step", "one_step_large", "two_step")
HIGH = {"one_step_small": 20, "one_step": 50, "one_step_large": 500, "two_step": 50}


def _step(rng: random.Random, total: int, high: int, name: str, thing: str) -> tuple[str, int]:
    """One operation on ``total``: a clause and the new total (never negative)."""
    if total > 1 and rng.random() < 0.5:
        k = rng.randint(1, total - 1)
        return rng.choice([f"gives {k} {thing} to a friend", f"loses {k} {thing}", f"uses {k} {thing}"]), total - k
    k = rng.randint(1, high)
    return rng.choice([f"buys {k} more {thing}", f"finds {k} more {thing}", f"gets {k} more {thing}"]), total + k


def problem(rng: random.Random, task: str) -> tuple[str, int]:
    high = HIGH[task]
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    total = rng.randint(2, high)
    text = f"{name} has {total} {thing}."
    clauses = []
    for _ in range(2 if task == "two_step" else 1):
        clause, total = _step(rng, total, high, name, thing)
        clauses.append(clause)
    text += f" Then {name} " + ", and then ".join(clauses) + f". How many {thing} does {name} have now?"
    return text, total


def rows(task: str, n: int, seed: int, exclude: set[str]) -> list[dict]:
    rng, out, seen = random.Random(seed), [], set(exclude)
    while len(out) < n:
        question, answer = problem(rng, task)
        if question in seen:
            continue
        seen.add(question)
        out.append({
            "prompt": [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}],
            "data_source": f"arith_words/{task}",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"question": question, "index": len(out)},
        })
    return out


def write(path: Path, data: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(data)
    pq.write_table(table, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=TASKS, default="one_step")
    parser.add_argument("--out", required=True, help="folder for train.parquet and test.parquet")
    parser.add_argument("--train-size", type=int, default=4000)
    parser.add_argument("--test-size", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    test = rows(args.task, args.test_size, args.seed + 1, set())
    train = rows(args.task, args.train_size, args.seed, {r["extra_info"]["question"] for r in test})
    write(out / "test.parquet", test)
    write(out / "train.parquet", train)
    print(f"wrote {len(train)} train and {len(test)} test problems ({args.task}) to {out}")


if __name__ == "__main__":
    main()
