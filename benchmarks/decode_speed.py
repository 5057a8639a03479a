"""The ``hf`` engine's decode speed against the memory-bandwidth floor, by batch size (issue 31, item 1).

Models are built from a config with random bf16 weights (no download):

- ``135m``: SmolLM2-135M's shape (Llama: 30 layers, hidden 576, 9 heads / 3 key-value heads, head_dim 64,
  vocabulary 49,152, tied head), prompts of 40-128 tokens, up to 256 response tokens. Random weights rarely
  pick the end token, so a set of stop tokens is chosen to give responses of about 150 tokens on average, as
  the real model's runs had (``--mean-len``; the printed mean is what the run gave).
- ``0.5b``: Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 heads / 2 key-value heads, vocabulary 151,936),
  214-token prompts, every response 256 tokens (no stop): the issue's "64 x 256" figure.

For each shape and batch size (rows = prompts x 8 samples) it prints: the seconds of one ``generate`` (median
of ``--repeats`` after a warm-up call that compiles and records), the decode steps it ran, ms per step (the
whole call over its steps, as earlier reports counted), ms per decode step without the prefill (timed apart
with ``max_tokens=1``), the mean response length, and the floor: the bytes a step must read (the weights
once, plus the key/value cache of the rows still decoding, up to each row's own position) over 4.8 TB/s,
averaged over the steps the call ran. With ``--check`` the sampled tokens' log-probs of 16 rows are compared
with the training forward pass.

    python benchmarks/decode_speed.py --shape 135m 0.5b --batch 8 64 512 1024 --out results.json   # one GPU
    python benchmarks/decode_speed.py --smoke                                                       # CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Datasheet memory bandwidths (bytes/s) of the cards the device tool lends, by a word of torch's device name
# (H200: HBM3e; H100 SXM: HBM3).
BANDWIDTHS = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


def bandwidth() -> float:
    """The memory bandwidth of the GPU this runs on (its datasheet figure), H200's where the card is unknown
    (also linear_probe.py's floor)."""
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for word, value in BANDWIDTHS.items():
            if word in name:
                return value
    return BANDWIDTHS["H200"]


SAMPLES = 8


def shape_config(shape: str) -> tuple[Any, dict[str, Any]]:
    """A transformers config with the shape's dimensions, and the workload (prompt lengths, tokens, stop)."""
    from transformers import LlamaConfig, Qwen2Config

    if shape == "135m":
        config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                             num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                             rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, pad_token_id=2,
                             eos_token_id=0, bos_token_id=1)
        return config, {"prompt_len": (40, 128), "max_tokens": 256, "mean_len": 150}
    if shape == "0.5b":
        config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                             rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                             pad_token_id=151934, eos_token_id=151935, bos_token_id=151935)
        return config, {"prompt_len": (214, 214), "max_tokens": 256, "mean_len": 0}
    if shape == "tiny":  # the smoke test's
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             tie_word_embeddings=True, pad_token_id=2, eos_token_id=0, bos_token_id=1)
        return config, {"prompt_len": (3, 12), "max_tokens": 12, "mean_len": 6}
    raise SystemExit(f"unknown shape {shape!r} (135m, 0.5b, tiny)")


def stop_tokens(vocab: int, eos: int, mean_len: int, max_tokens: int) -> tuple[int, ...]:
    """About enough stop tokens that a near-uniform draw stops after ``mean_len`` tokens on average (capped
    at ``max_tokens``): a per-step stop chance p with (1 - (1 - p)^max) / p = mean_len."""
    if mean_len <= 0:
        return ()
    lo, hi = 1e-6, 1.0
    for _ in range(60):
        p = (lo + hi) / 2
        if (1 - (1 - p) ** max_tokens) / p > mean_len:
            lo = p
        else:
            hi = p
    count = max(1, round(p * vocab))
    return tuple(t for t in range(vocab - count - 1, vocab) if t != eos)[:count]


def kv_bytes_per_token(config: Any, dtype_bytes: int = 2) -> int:
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * dtype_bytes


def weight_bytes_per_step(model: Any) -> int:
    """Every parameter once, except an untied input embedding (a step reads one row of it per sequence)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if embed.data_ptr() != head.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total


def floor_per_step(weights: int, kv_token: int, prompt_lens: list[int], response_lens: list[int],
                   steps: int) -> float:
    """Seconds per step at the card's memory bandwidth: the weights, plus each row's cache up to its position while
    it decodes."""
    kv = 0
    for p, r in zip(prompt_lens, response_lens, strict=True):
        live = min(r, steps)  # the row is decoded at steps 0..live-1 (step 0 is the prefill's draw)
        kv += live * p + live * (live - 1) // 2
    return (weights + kv_token * kv / max(steps, 1)) / bandwidth()


def make_prompts(rows: int, lengths: tuple[int, int], top: int, pad: int, seed: int) -> tuple[Any, int]:
    """Random prompts of tokens 3..top-1 (below the stop tokens), rows // 8 of them (8 samples each)."""
    import random

    from rlx.run.data import PromptExample, collate

    rng = random.Random(seed)
    prompts = max(1, rows // SAMPLES)
    examples = []
    for i in range(prompts):
        n = rng.randint(*lengths)
        ids = [rng.randrange(3, top) for _ in range(n)]
        examples.append(PromptExample(ids, "", "bench", "0", {"index": i}))
    return collate(examples, pad), rows // prompts


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def timed(device: str, fn: Any, *args: Any) -> tuple[float, Any]:
    sync(device)
    start = time.perf_counter()
    out = fn(*args)
    sync(device)
    return time.perf_counter() - start, out


def log_prob_check(engine: Any, out: Any, temperature: float, rows: int = 16) -> float:
    """Mean |rollout log-prob - training forward log-prob| over the first ``rows`` responses' tokens."""
    import torch

    from rlx.plugins.modeling.head import response_log_probs

    part = out.index(slice(0, rows)).to(engine.device)
    with torch.no_grad():
        lp, _ = response_log_probs(engine.model, part, temperature, with_entropy=False)
    mask = part["response_mask"].bool()
    return float((lp - part["rollout_log_probs"]).abs()[mask].mean())


def bench_shape(shape: str, batches: list[int], args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    import torch

    from rlx.plugins.rollout.hf import HFRollout, HFRolloutOptions
    from rlx.protocols import SamplingParams

    config, work = shape_config(shape)
    max_tokens = args.tokens or work["max_tokens"]
    mean_len = work["mean_len"] if args.mean_len is None else args.mean_len
    path = folder / shape
    if not path.exists():
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)
    options: dict[str, Any] = {"compile": args.compile, "decoder": "static"}
    if args.device == "cpu":
        options["dtype"] = "float32"
    stop = stop_tokens(config.vocab_size, config.eos_token_id, mean_len, max_tokens)
    results = []
    for rows in batches:
        row: dict[str, Any] = {"shape": shape, "rows": rows, "compile": args.compile}
        if args.variant:
            row["variant"] = args.variant
        try:
            prompts, n = make_prompts(rows, work["prompt_len"], min(stop or (config.vocab_size - 2,)),
                                      config.pad_token_id, seed=rows)
            engine = HFRollout(str(path), HFRolloutOptions(micro_batch_size=rows, **options), args.device,
                               [config.eos_token_id], config.pad_token_id)
            params = SamplingParams(n=n, max_tokens=max_tokens, temperature=args.temperature, stop_token_ids=stop)
            first, _ = timed(args.device, engine.generate, prompts, params)
            row["first_call_s"] = first
            times, out = [], None
            for i in range(args.repeats):
                torch.manual_seed(i)
                t, out = timed(args.device, engine.generate, prompts, params)
                times.append(t)
            prefill = 0.0
            if args.prefill:  # a shape of its own: compiled and recorded once more
                one = SamplingParams(n=n, max_tokens=1, temperature=args.temperature, stop_token_ids=stop)
                timed(args.device, engine.generate, prompts, one)
                prefill = statistics.median(timed(args.device, engine.generate, prompts, one)[0]
                                            for _ in range(args.repeats))
            assert out is not None
            lengths = out["response_mask"].sum(-1).tolist()
            steps = out["responses"].shape[1]
            gen = statistics.median(times)
            prompt_lens = out["prompt_mask"].sum(-1).tolist()
            floor = floor_per_step(weight_bytes_per_step(engine.model), kv_bytes_per_token(config), prompt_lens,
                                   lengths, steps)
            row.update(generate_s=gen, steps=steps, ms_per_step=1000 * gen / steps, prefill_s=prefill,
                       ms_per_decode_step=1000 * (gen - prefill) / max(steps - 1, 1) if prefill else None,
                       mean_len=sum(lengths) / len(lengths), floor_ms_per_step=1000 * floor,
                       floor_generate_s=floor * steps, tokens_per_s=sum(lengths) / gen)
            if args.check:
                row["log_prob_diff"] = log_prob_check(engine, out, args.temperature)
            if args.device.startswith("cuda"):
                row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
                row["gpu"] = torch.cuda.get_device_name()
            if args.profile and rows == args.profile:
                tag = f".{args.variant}" if args.variant else ""
                profile(engine, prompts, params, Path(args.out).with_suffix(f".{shape}.{rows}{tag}.profile.txt"))
            engine.close()
            del engine
        except Exception as exc:  # one failing size must not lose the others' numbers
            import traceback

            traceback.print_exc()
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        print(json.dumps(row), flush=True)
        results.append(row)
    return results


def profile(engine: Any, prompts: Any, params: Any, path: Path) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90)
    path.write_text(table)


def table(results: list[dict[str, Any]]) -> str:
    head = ("shape", "rows", "variant", "generate_s", "steps", "ms_per_step", "ms_per_decode_step", "floor_ms_per_step",
            "mean_len", "prefill_s", "first_call_s", "log_prob_diff", "peak_gib")
    lines = [" | ".join(head)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['shape']} | {r['rows']} | error: {r['error']}")
            continue
        lines.append(" | ".join(f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in head))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs="+", default=["135m", "0.5b"])
    ap.add_argument("--batch", nargs="+", type=int, default=[8, 64, 512, 1024], help="rows per generate call")
    ap.add_argument("--tokens", type=int, default=0, help="max response tokens (0: the shape's, 256)")
    ap.add_argument("--mean-len", type=int, default=None, help="target mean response length via stop tokens")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--compile", default="default", choices=["off", "default", "max-autotune"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prefill", action="store_true", help="time the prefill apart (a generate of one token)")
    ap.add_argument("--check", action="store_true", help="log-probs of 16 rows against the training forward pass")
    ap.add_argument("--profile", type=int, default=0, help="profile one generate at this batch size")
    ap.add_argument("--l2-prefetch", nargs="*", default=[], metavar="MODE[:SCHEDULE]",
                    help="run every shape and batch once per setting of hf_prefetch (off, line, bulk, load; "
                         "schedule mlp or mlp+next), in this order (an A/B in one process)")
    ap.add_argument("--out", default="decode_speed.json")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, two batch sizes (CI)")
    ap.add_argument("--blas", default=None, choices=["cublas", "cublaslt"],
                    help="torch.backends.cuda.preferred_blas_library for the run (default: torch's choice)")
    ap.add_argument("--with", dest="with_", nargs="*", default=[], choices=["skinny-linear"],
                    help="turn on what is off by default (skinny-linear: per-shape Triton products)")
    ap.add_argument("--without", nargs="*", default=[], choices=["fused-sampling", "split-attention", "rope-attention",
                                                              "own-prefill"],
                    help="turn off one of the decode step's kernels or rlx's own prefill (the before of an A/B)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape, args.batch, args.device, args.compile, args.repeats, args.check, args.prefill = (
            ["tiny"], [2, 8], "cpu", "off", 1, True, True)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("decode_speed.py: no GPU here (use --smoke or --device cpu)", file=sys.stderr)
            return 2
    import torch._dynamo

    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    if "skinny-linear" in args.with_:
        from rlx.plugins.rollout import hf_static as slots

        slots.SKINNY_LINEAR = True
    if "own-prefill" in args.without:  # the model's own forward for the prompts, then a copy into the cache
        from rlx.plugins.rollout import hf_static as slots

        slots.OWN_PREFILL = False
    if "fused-sampling" in args.without:  # torch's sampling operations in the compiled step
        from rlx.plugins.rollout import hf_kernels

        hf_kernels.race_available = lambda device: False
    if "split-attention" in args.without:  # one program per row and key/value head
        from rlx.plugins.rollout import hf_static

        hf_static.attention_splits = lambda *a, **k: 1
    if "rope-attention" in args.without:  # the rotation in the compiled step, before the attention op
        from rlx.plugins.rollout import hf_static as static

        def rotate_then_attend() -> Any:
            attend = static.attention_op()

            def run(q: Any, k: Any, v: Any, cos: Any, sin: Any, *rest: Any) -> Any:
                c, s = cos[:, None], sin[:, None]
                return attend(static._rotate(q, c, s), static._rotate(k, c, s), v, *rest)

            return run

        static.rope_attention_op = rotate_then_attend

    # One process compiles the decode step for every shape: more than dynamo's default 8 recompilations.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    from rlx.plugins.rollout import hf_prefetch

    results: list[dict[str, Any]] = []
    args.variant = ""
    with tempfile.TemporaryDirectory() as tmp:
        for setting in args.l2_prefetch or [""]:
            if setting:
                mode, _, schedule = setting.partition(":")
                hf_prefetch.MODE, hf_prefetch.SCHEDULE = mode, schedule or "mlp"  # type: ignore[assignment]
                args.variant = f"l2-{mode}" + (f"-{schedule}" if schedule else "")
            for shape in args.shape:
                results += bench_shape(shape, args.batch, args, Path(tmp))
                Path(args.out).write_text(json.dumps(results, indent=1))
    print(table(results))
    if args.smoke:
        bad = [r for r in results if "error" in r or not r["steps"] or r["log_prob_diff"] > 1e-3]
        if bad:
            print(f"smoke run failed: {bad}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
