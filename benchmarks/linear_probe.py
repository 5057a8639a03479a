"""The decode step's linear products: cuBLAS against the Triton candidates of ``rlx::skinny_linear``
(plugins/rollout/hf_linear.py), per shape and batch size, beside the memory-bandwidth floor (issue 31).

Shapes (x (b, K) @ W (N, K)^T, bf16): Qwen2.5-0.5B's qkv (N 1152, K 896, bias), o (896, 896), gate_up
(9728, 896), down (896, 4864); SmolLM2-135M's qkv (960, 576), o (576, 576), gate_up (3072, 576), down
(576, 1536); with ``--head`` the tied output heads too (151936 x 896, 49152 x 576). For each shape and b it
runs the op's own measurement (:class:`Tuner`: every option recorded in a CUDA graph of calls that cycle
through copies of W larger than the L2 cache, as in the decode step, each candidate's result checked against
cuBLAS's first) and prints cuBLAS's microseconds per call, each candidate's (or why it failed: a candidate
that does not compile or run on this GPU is reported and skipped), the choice, the floor (W's, x's and y's
bytes over 4.8 TB/s) and the speed-up over cuBLAS; then per model and b the four products of one layer
summed, and times the layers.

    python benchmarks/linear_probe.py --batch 8 64 512 --json linear_probe.json        # one GPU
    PYTHONPATH=/tmp/triton_site python benchmarks/linear_probe.py --smoke               # CPU interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from decode_speed import bandwidth  # the card's memory bandwidth (this folder is on the path when run as a script)

MODELS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {"layers": 24, "shapes": {"qkv": (1152, 896, True), "o": (896, 896, False),
                                              "gate_up": (9728, 896, False), "down": (896, 4864, False)},
                     "head": (151936, 896, False)},
    "smollm2-135m": {"layers": 30, "shapes": {"qkv": (960, 576, False), "o": (576, 576, False),
                                              "gate_up": (3072, 576, False), "down": (576, 1536, False)},
                     "head": (49152, 576, False)},
}
SMOKE_MODELS: dict[str, dict[str, Any]] = {  # odd sizes: partial tiles, splits on a pretend 8-SM GPU
    "tiny": {"layers": 2, "shapes": {"qkv": (40, 72, True), "down": (24, 200, False)}, "head": (136, 48, False)},
}


def floor_us(rows: int, n: int, k: int, element: int) -> float:
    return (n * k + rows * k + rows * n) * element / bandwidth() * 1e6


def wall_clock(name: str, fn: Any, w: Any) -> float:
    """The smoke run's timer (the interpreter has no GPU time): one call's wall-clock microseconds."""
    start = time.perf_counter()
    fn(w)
    return (time.perf_counter() - start) * 1e6


def probe(model: str, product: str, rows: int, n: int, k: int, with_bias: bool, dtype: Any, device: str,
          smoke: bool) -> dict[str, Any]:
    import torch

    from rlx.plugins.rollout import hf_linear

    g = torch.Generator().manual_seed(rows * 7 + n + k)
    x = torch.randn(rows, k, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(device=device, dtype=dtype)
    bias = (torch.randn(n, generator=g) * 0.1).to(device=device, dtype=dtype) if with_bias else None
    tuner = hf_linear.Tuner(timer=wall_clock if smoke else None, capturing=lambda: False,
                            sms=8 if smoke else None)
    choice = tuner.measure(x, w, bias)
    element = x.element_size()
    record = {"model": model, "product": product, "b": rows, "N": n, "K": k, "bias": with_bias,
              "dtype": str(dtype).removeprefix("torch."), "weight_mb": n * k * element / 1e6,
              "floor_us": floor_us(rows, n, k, element), "cublas_us": choice.times_us[hf_linear.CUBLAS],
              "times_us": choice.times_us, "failed": choice.failed, "chosen": choice.name,
              "chosen_us": choice.times_us[choice.name], "speedup": choice.speedup}
    del x, w, bias
    if not smoke:
        torch.cuda.empty_cache()
    return record


def report(record: dict[str, Any]) -> None:
    head = (f"{record['model']} {record['product']} b={record['b']} N={record['N']} K={record['K']}"
            f"{' +bias' if record['bias'] else ''}: W {record['weight_mb']:.2f} MB, floor {record['floor_us']:.2f} us")
    print(head)
    cublas = record["cublas_us"]
    for name, us in sorted(record["times_us"].items(), key=lambda item: item[1]):
        mark = " <- chosen" if name == record["chosen"] else ""
        floors = us / record["floor_us"]
        print(f"    {name:52s} {us:9.2f} us  x{cublas / us:5.2f} vs cuBLAS  {floors:5.1f} x floor{mark}")
    for name, why in record["failed"].items():
        print(f"    {name:52s}    FAILED  {why}")


def summary(records: list[dict[str, Any]], models: dict[str, dict[str, Any]]) -> None:
    print("\n== summary (us per call; per layer: the products of one layer summed)")
    print(f"{'model':14s} {'product':8s} {'b':>5s} {'cuBLAS':>8s} {'chosen':>8s} {'floor':>7s} {'speedup':>8s}  choice")
    for r in records:
        print(f"{r['model']:14s} {r['product']:8s} {r['b']:5d} {r['cublas_us']:8.2f} {r['chosen_us']:8.2f} "
              f"{r['floor_us']:7.2f} {r['speedup']:7.2f}x  {r['chosen']}")
    for model, spec in models.items():
        for rows in sorted({r["b"] for r in records if r["model"] == model}):
            layer = [r for r in records if r["model"] == model and r["b"] == rows and r["product"] in spec["shapes"]]
            if len(layer) != len(spec["shapes"]):
                continue
            cublas, chosen = sum(r["cublas_us"] for r in layer), sum(r["chosen_us"] for r in layer)
            floor = sum(r["floor_us"] for r in layer)
            print(f"{model} b={rows}: per layer cuBLAS {cublas:.1f} us, chosen {chosen:.1f} us, floor {floor:.1f} us; "
                  f"x{spec['layers']} layers: {cublas * spec['layers'] / 1e3:.3f} -> "
                  f"{chosen * spec['layers'] / 1e3:.3f} ms per decode step")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64, 512], help="rows per product (default 8 64 512)")
    ap.add_argument("--model", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--head", action="store_true", help="the output heads too (large N)")
    ap.add_argument("--json", type=Path, default=None, help="write the records here")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, Triton's interpreter, tiny shapes, float16 (its bfloat16 tl.dot is broken): seconds")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    from rlx.plugins.rollout import hf_linear

    if hf_linear._kernels() is None:
        print("linear_probe.py: triton is not importable (pip install triton, or PYTHONPATH=/tmp/triton_site "
              "for --smoke)", file=sys.stderr)
        return 2
    if args.smoke:
        models, batches, dtype, device = SMOKE_MODELS, [3, 16], torch.float16, "cpu"
        args.head = True
    else:
        if not torch.cuda.is_available():
            print("linear_probe.py: no GPU here (use --smoke for the CPU interpreter run)", file=sys.stderr)
            return 2
        models = {name: MODELS[name] for name in args.model}
        batches, dtype, device = args.batch, getattr(torch, args.dtype), "cuda"
        props = torch.cuda.get_device_properties(0)
        print(f"{props.name}: {props.multi_processor_count} SMs, L2 {props.L2_cache_size / 2**20:.0f} MiB; "
              f"torch {torch.__version__}, triton {__import__('triton').__version__}; "
              f"floor at {bandwidth() / 1e12} TB/s")
    records: list[dict[str, Any]] = []
    broken: list[str] = []
    for model, spec in models.items():
        products = dict(spec["shapes"], **({"head": spec["head"]} if args.head else {}))
        for rows in batches:
            for product, (n, k, with_bias) in products.items():
                try:
                    record = probe(model, product, rows, n, k, with_bias, dtype, device, args.smoke)
                except Exception as error:  # one shape's failure (e.g. out of memory) is reported, not fatal
                    print(f"{model} {product} b={rows}: FAILED {type(error).__name__}: {error}")
                    broken.append(f"{model} {product} b={rows}")
                    continue
                report(record)
                records.append(record)
                broken += [f"{model} {product} b={rows}: {name}" for name in record["failed"]] if args.smoke else []
    summary(records, models)
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
        print(f"wrote {args.json}")
    if args.smoke and broken:
        print("smoke run failed (every candidate must run and match under the interpreter):\n  "
              + "\n  ".join(broken), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
