"""How well each algorithm learns the built-in job: `rlx train --preset tiny --algorithm A` for seeds 1-5.

    python benchmarks/builtin_learning.py                       # 6 algorithms x seeds 1-5, 2 runs at a time
    python benchmarks/builtin_learning.py --algorithms grpo ppo --seeds 1 2 --jobs 1 --out /tmp/bl
    python benchmarks/builtin_learning.py --smoke --out /tmp/bl  # CI: each algorithm, seed 1, 2 steps (seconds)

Every run is `OMP_NUM_THREADS=1` (the preset trains on one torch thread) and writes only metrics.jsonl.
Prints two markdown tables: one row per run (greedy exact-match accuracy on builtin:arith-test before
training and at the end, the best validation, the mean training reward of the first 5 and the last 10
steps, and the run's wall time), then per algorithm the mean training reward in blocks of 20 steps
(the reward curve) and the validation accuracy at each validation, averaged over the seeds.
Runs finished by an earlier call with the same --out are read again instead of being run.
``--smoke`` (the same runs, only 2 steps each, validated at steps 0 and 2) fails unless every run logged
both steps and both validations; without --out it runs in a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ALGORITHMS = ["grpo", "rloo", "reinforce_plus_plus", "remax", "dapo", "ppo"]
ACC = "val/rlx/arith/acc"
SMOKE_STEPS = 2


def run(algorithm: str, seed: int, out: Path, extra: list[str]) -> float:
    """Train one run (unless it already finished); returns its wall time in seconds."""
    folder = out / f"{algorithm}-s{seed}"
    done = folder / "wall_seconds.json"
    if done.exists():
        return float(json.loads(done.read_text())["seconds"])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "rlx", "train", "--preset", "tiny", "--algorithm", algorithm,
           f"trainer.seed={seed}", f"trainer.output_dir={folder}", "trainer.val_before_train=true",
           "trainer.loggers=[jsonl]", "trainer.save_freq=0", "trainer.save_hf_model=false", "trainer.log_samples=0",
           *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{algorithm} seed {seed} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    done.write_text(json.dumps({"seconds": seconds}))
    return seconds


def summarise(folder: Path) -> dict:
    from rlx.plugins.loggers.jsonl import read_metrics

    rows = read_metrics(folder)
    train = [r for r in rows if "reward/mean" in r]
    rewards = [r["reward/mean"] for r in train]
    val = [(r["step"], r[ACC]) for r in rows if ACC in r]
    return {"steps": len(train), "rewards": rewards, "val": val,
            "acc_start": val[0][1], "acc_end": val[-1][1], "acc_best": max(a for _, a in val),
            "reward_start": mean(rewards[:5]), "reward_end": mean(rewards[-10:])}


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", default=ALGORITHMS)
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="default 1-5 (with --smoke 1)")
    parser.add_argument("--jobs", type=int, default=2,
                        help="runs at a time, each on one thread (2 on a 2-core machine; up to the cores elsewhere)")
    parser.add_argument("--out", type=Path, default=None, help="default outputs/builtin_learning (with --smoke "
                        "a temporary folder: finished runs in --out are read again, not run)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"seed 1 only (unless --seeds), {SMOKE_STEPS} steps per run, checked (CI)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. trainer.total_steps=60")
    args = parser.parse_args()
    args.seeds = args.seeds or ([1] if args.smoke else [1, 2, 3, 4, 5])
    if args.smoke:
        args.overrides = [f"trainer.total_steps={SMOKE_STEPS}", f"trainer.test_freq={SMOKE_STEPS}", *args.overrides]
    with tempfile.TemporaryDirectory() as tmp:
        args.out = args.out or (Path(tmp) if args.smoke else Path("outputs/builtin_learning"))
        args.out.mkdir(parents=True, exist_ok=True)
        report(args)


def report(args: argparse.Namespace) -> None:
    runs = [(a, s) for a in args.algorithms for s in args.seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        seconds = list(pool.map(lambda r: run(r[0], r[1], args.out, args.overrides), runs))
    results = {r: summarise(args.out / f"{r[0]}-s{r[1]}") | {"seconds": t} for r, t in zip(runs, seconds)}
    if args.smoke:
        bad = [f"{a} seed {s}: {r['steps']} steps, validations at {[step for step, _ in r['val']]}"
               for (a, s), r in results.items()
               if r["steps"] != SMOKE_STEPS or [step for step, _ in r["val"]] != [0, SMOKE_STEPS]
               or not all(math.isfinite(x) for x in r["rewards"])]
        if bad:
            raise SystemExit("smoke run failed:\n  " + "\n  ".join(bad))

    print("| algorithm | seed | accuracy start -> end (best) | reward first 5 -> last 10 steps | steps | seconds |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (a, s), r in results.items():
        print(f"| {a} | {s} | {r['acc_start']:.2f} -> {r['acc_end']:.2f} ({r['acc_best']:.2f}) | "
              f"{r['reward_start']:.3f} -> {r['reward_end']:.3f} | {r['steps']} | {r['seconds']:.0f} |")

    print("\nMean over the seeds: training reward per block of 20 steps; validation accuracy at each validation.\n")
    for a in args.algorithms:
        mine = [results[(a, s)] for s in args.seeds]
        blocks = range(0, min(len(r["rewards"]) for r in mine), 20)
        curve = [mean([mean(r["rewards"][b:b + 20]) for r in mine]) for b in blocks]
        steps = [step for step, _ in mine[0]["val"]]
        acc = [mean([dict(r["val"])[step] for r in mine]) for step in steps]
        print(f"- {a}: reward {' '.join(f'{x:.2f}' for x in curve)}; accuracy "
              + ", ".join(f"{step}: {x:.2f}" for step, x in zip(steps, acc)))


if __name__ == "__main__":
    main()
