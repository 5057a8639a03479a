"""Issue 31's report: every figure of its goals from one call on one H200, side by side with its goal.

    python benchmarks/perf_report.py OUT                      # one GPU: all three groups, about 12 minutes
    python benchmarks/perf_report.py OUT --only step          # the device tool's 10-minute calls: two calls,
    python benchmarks/perf_report.py OUT --only decode,megatron   # the step's (TRL beside rlx) and the rest
    python benchmarks/perf_report.py OUT --smoke              # the CPU: the same pipeline on tiny models (CI)

It runs the benchmark scripts one after another, each in a process of its own (so one's compilation caches,
CUDA graphs and memory do not bend another's figures), reads their JSON outputs and prints one markdown table:

- ``decode``: ``decode_speed.py``, the ``hf`` engine's generate call at batch 8, 64, 512 and 1024 on SmolLM2-135M's
  shape (goal: at most 4 ms a decode step at 512) and 64 x 256 on Qwen2.5-0.5B's (goal: at most 0.30 s), each
  with its memory-bandwidth floor.
- ``step``: ``grpo_vs_trl.py`` twice: TRL's ``GRPOTrainer`` beside rlx's memory-lean configuration (bf16 weights,
  checkpointing, engine weights discarded while training; goal: at least 8x TRL's step at or below TRL's peak
  memory), then rlx's fast configuration (goal: at least 12x TRL's step, TRL's from the first run of the call).
- ``megatron``: ``megatron_step.py step``, the megatron backend's actor update MFU at 0.5B and 1.5B
  (goals: 35% and 50%), with its best settings (one token-budget micro-batch, compiled layers) and the defaults.

Everything is also written to OUT/report.json and OUT/report.md. Numbers from different calls are not
compared: TRL's own step time moves between calls (4.3-9.9 s measured), so the step's ratios are taken within
the call that ran both (the ``step`` group always runs TRL and both rlx settings together). Estimated times on
an H200, first compilations included: decode 4 min, step 5 min, megatron 3-4 min.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# The two GRPO configurations the issue names (docs/benchmarks.md, "One GPU: a GRPO step against TRL's").
# The lean budget holds a whole step's 18,096 tokens once each prompt is carried once (actor.share_prompts, on by
# default): one micro-batch, at 5.81 GiB against TRL's 6.79 GiB (H100, 2026-12-07; docs/benchmarks.md).
LEAN = ["rollout.free_on_sleep=discard", "actor.use_torch_compile=true", "actor.use_dynamic_bsz=true",
        "actor.ppo_max_token_len_per_gpu=20480", "actor.log_prob_chunk_size=512"]
FAST = ["actor.model_dtype=bfloat16", "actor.use_torch_compile=true", "actor.use_dynamic_bsz=true",
        "actor.ppo_max_token_len_per_gpu=32768", "actor.log_prob_chunk_size=4096"]
MEGATRON_VARIANTS = ["budget12288+compile", "default"]


def run(cmd: list[str], log: Path, timeout: int) -> tuple[int, float]:
    """Run one benchmark, its output teed to ``log``; (exit status, seconds). A timeout is status 124."""
    print(f"$ {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    with log.open("w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=HERE.parent)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = 124
    seconds = time.perf_counter() - start
    tail = log.read_text().splitlines()[-15:]
    print("\n".join("    " + line for line in tail), flush=True)
    print(f"  -> exit {code} in {seconds:.0f} s", flush=True)
    return code, seconds


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def decode(out: Path, smoke: bool, timeout: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    if smoke:
        run([sys.executable, str(HERE / "decode_speed.py"), "--smoke", "--out", str(out / "decode_tiny.json")],
            out / "decode_tiny.log", timeout)
        for r in read_json(out / "decode_tiny.json") or [{"error": "no output"}]:
            rows.append(decode_row(r, f"tiny, {r.get('rows')} rows (smoke)", None, None))
        return rows
    jobs = [("135m", ["8", "64", "512", "1024"]), ("0.5b", ["64"])]
    for shape, batches in jobs:
        path = out / f"decode_{shape}.json"
        run([sys.executable, str(HERE / "decode_speed.py"), "--shape", shape, "--batch", *batches, "--check",
             "--prefill", "--out", str(path)], out / f"decode_{shape}.log", timeout)
        found = read_json(path) or []
        for r in found:
            if shape == "135m":
                goal = ("ms_per_decode_step", 4.0, "at most 4 ms a decode step") if r.get("rows") == 512 else None
                rows.append(decode_row(r, f"generation, 135m, {r.get('rows')} rows", goal, "ms_per_decode_step"))
            else:
                rows.append(decode_row(r, "generation, 0.5b, 64 x 256", ("generate_s", 0.30, "at most 0.30 s"),
                                       "generate_s"))
        if not found:
            rows.append({"figure": f"generation, {shape}", "measured": "failed (see the log)", "met": False})
    return rows


def decode_row(r: dict[str, Any], figure: str, goal: tuple[str, float, str] | None,
               key: str | None) -> dict[str, Any]:
    if "error" in r:
        return {"figure": figure, "measured": f"error: {r['error']}", "met": False}
    measured = (f"{r['generate_s']:.3f} s, {r['ms_per_step']:.2f} ms/step"
                + (f" ({r['ms_per_decode_step']:.2f} ms a decode step, prefill {r['prefill_s']:.3f} s)"
                   if r.get("ms_per_decode_step") else "")
                + (f", log-prob diff {r['log_prob_diff']:.4f}" if r.get("log_prob_diff") is not None else ""))
    row = {"figure": figure, "measured": measured,
           "floor": f"{r['floor_ms_per_step']:.3f} ms/step ({r['floor_generate_s']:.3f} s)", "raw": r}
    if goal and key and r.get(key) is not None:
        row["goal"] = goal[2]
        row["met"] = r[key] <= goal[1]
    return row


def step(out: Path, smoke: bool, timeout: int) -> list[dict[str, Any]]:
    script = str(HERE / "grpo_vs_trl.py")
    steps = ["--steps", "2"] if smoke else ["--steps", "4"]
    smoke_flag = ["--smoke"] if smoke else []
    # the smoke run checks the settings, not compilation (its CPU kernels take minutes; test_compile.py has them)
    lean, fast = ([o for o in settings if not (smoke and "use_torch_compile" in o)] for settings in (LEAN, FAST))
    run([sys.executable, script, str(out / "step_lean"), *smoke_flag, *steps, "--parts", "rlx_bf16,trl", *lean],
        out / "step_lean.log", timeout)
    run([sys.executable, script, str(out / "step_fast"), *smoke_flag, *steps, "--parts", "rlx", *fast],
        out / "step_fast.log", timeout)
    lean_results = read_json(out / "step_lean" / "results.json") or {}
    fast_results = read_json(out / "step_fast" / "results.json") or {}
    trl, trl_peak = lean_results.get("trl/timing/step"), lean_results.get("trl/peak_gib")
    peak_text = f"{trl_peak:.2f} GiB" if trl_peak is not None else "n/a"
    rows = [{"figure": "TRL GRPOTrainer step (bf16, checkpointing)",
             "measured": f"{trl:.3f} s/step, peak {peak_text}" if trl else "not run (trl not installed?)",
             "raw": {k: v for k, v in lean_results.items() if k.startswith("trl/")}}]
    for name, results, part, goal in (("memory-lean", lean_results, "rlx_bf16", 8.0),
                                      ("fast", fast_results, "rlx", 12.0)):
        seconds, peak = results.get(f"{part}/timing/step"), results.get(f"{part}/peak_gib")
        if seconds is None:
            rows.append({"figure": f"rlx GRPO step, {name}", "measured": "failed (see the log)", "met": False})
            continue
        gen, update = results.get(f"{part}/timing/gen", 0.0), results.get(f"{part}/timing/update_actor", 0.0)
        row: dict[str, Any] = {"figure": f"rlx GRPO step, {name}",
                               "measured": f"{seconds:.3f} s/step (generation {gen:.3f} s, update {update:.3f} s), "
                               "peak " + (f"{peak:.2f} GiB" if peak is not None else "n/a"),
                               "raw": {k: v for k, v in results.items() if k.startswith(part + "/")}}
        if trl and not smoke:  # the CPU's ratios mean nothing: the smoke run checks the pipeline
            ratio = trl / seconds
            row["measured"] += f"; {ratio:.2f}x TRL's step"
            row["goal"] = f"at least {goal:.0f}x TRL" + (" at or below TRL's peak" if name == "memory-lean" else "")
            row["met"] = ratio >= goal and (name != "memory-lean" or (peak is not None and trl_peak is not None
                                                                       and peak <= trl_peak))
        rows.append(row)
    return rows


def megatron(out: Path, smoke: bool, timeout: int) -> list[dict[str, Any]]:
    path = out / "megatron.jsonl"
    if smoke:
        code, _ = run([sys.executable, str(HERE / "megatron_step.py"), "step", "--smoke", "--json", str(path)],
                      out / "megatron.log", timeout)
        found = read_jsonl(path)
        return [{"figure": "megatron (smoke: the model, the FLOPs count and the row, CPU)",
                 "measured": "ok" if code == 0 and found else f"failed (exit {code})", "met": code == 0}]
    run([sys.executable, str(HERE / "megatron_step.py"), "step", "--shape", "0.5b", "1.5b", "--steps", "3",
         "--variants", *MEGATRON_VARIANTS, "--json", str(path)], out / "megatron.log", timeout)
    rows = []
    goals = {"0.5b": 0.35, "1.5b": 0.50}
    for r in read_jsonl(path):
        goal = goals[r["shape"]] if r["variant"] == MEGATRON_VARIANTS[0] else None
        row = {"figure": f"megatron actor update, {r['shape']}, {r['variant']}",
               "measured": f"update MFU {r['update_mfu']:.1%} (update {r['update_s']:.3f} s, log-prob pass "
                           f"{r['log_prob_s']:.3f} s, {r['tokens_per_s_per_gpu']:,.0f} tokens/s, peak "
                           f"{r['peak_gib']:.1f} GiB)", "raw": r}
        if goal:
            row["goal"], row["met"] = f"at least {goal:.0%} MFU", r["update_mfu"] >= goal
        rows.append(row)
    if not rows:
        rows.append({"figure": "megatron actor update", "measured": "failed (see the log)", "met": False})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| figure | goal | measured | floor | met |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        met = {True: "yes", False: "**no**", None: ""}[r.get("met")]
        lines.append(f"| {r['figure']} | {r.get('goal', '')} | {r['measured']} | {r.get('floor', '')} | {met} |")
    return "\n".join(lines)


def gpu_name() -> str:
    """The card the figures came from (they are compared only within one card: floors and TRL's step move)."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip() or "none"
    except (OSError, subprocess.TimeoutExpired):
        return "none"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--only", default="decode,step,megatron", help="comma-separated: decode, step, megatron")
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU (CI): the pipeline, not figures")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per benchmark process")
    args = ap.parse_args(argv)
    groups = [g for g in args.only.split(",") if g]
    unknown = sorted(set(groups) - {"decode", "step", "megatron"})
    if unknown:
        ap.error(f"unknown group(s) {', '.join(unknown)} (decode, step, megatron)")
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for group in groups:
        rows += {"decode": decode, "step": step, "megatron": megatron}[group](args.out, args.smoke, args.timeout)
    report = f"GPU: {gpu_name()}\n\n" + table(rows)
    print("\n" + report)
    (args.out / "report.json").write_text(json.dumps(rows, indent=1, default=str))
    (args.out / "report.md").write_text(report + "\n")
    if args.smoke:
        failed = [r["figure"] for r in rows if r.get("met") is False or "error" in r["measured"]
                  or "failed" in r["measured"]]
        if failed:
            print(f"smoke failed: {failed}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
