"""Where asynchronous RL's time goes on one GPU (issue 27): the ``hf`` engine's generation of the GRPO benchmark's
work (64 x 256 tokens, Qwen2.5-0.5B shape, ``grpo_vs_trl.py``'s model) alone, in a thread on a side stream, and
in that thread while the main thread keeps the GPU busy with training-sized bf16 matrix products (the load of
an actor update: forward and backward GEMMs of the same model's width), optionally with the two partitioned
into green contexts (SMs split between them).

    python benchmarks/overlap_probe.py OUT_DIR [--green]   # OUT_DIR: where the benchmark's model is (or goes)
    python benchmarks/overlap_probe.py OUT_DIR --smoke     # CI: the CPU part, with grpo_vs_trl.py's tiny sizes

Prints each variant's generation seconds and the matrix products done meanwhile (TFLOP/s).

Side streams and green contexts exist only on a GPU: ``--smoke`` (grpo_vs_trl.py's tiny model, on the CPU)
runs the variants without them (generation in the main thread; in a thread alone; in a thread beside float32
matrix products of width 64) and prints the others as skipped.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--green", action="store_true", help="also green contexts (SMs split between the two)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, the variants it can run (CI)")
    args = ap.parse_args()
    import torch
    from transformers import AutoTokenizer

    sys.path.insert(0, str(Path(__file__).parent))
    import grpo_vs_trl as bench

    from rlx.plugins.rollout.hf import HFRollout, HFRolloutOptions
    from rlx.protocols import SamplingParams

    out, prefix = args.out, "smoke_" if args.smoke else ""
    if args.smoke:
        vars(bench).update(bench.SMOKE_SIZES)  # the tiny model, prompts and device of its own smoke run
    elif not torch.cuda.is_available():
        print("overlap_probe.py: no GPU here (--smoke runs its CPU part)", file=sys.stderr)
        sys.exit(2)
    device = bench.DEVICE
    model_dir, tok_dir = out / f"{prefix}model", out / f"{prefix}tokenizer"  # as grpo_vs_trl.py's
    if not (model_dir / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        bench.build_model(model_dir, tok_dir)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    engine = HFRollout(str(model_dir), HFRolloutOptions(micro_batch_size=512, decoder="static"), device,
                       [tok.eos_token_id], tok.pad_token_id)
    prompts = bench.prompt_batch(tok, bench.prompt_texts(bench.PROMPTS))
    params = SamplingParams(n=bench.SAMPLES, temperature=1.0, max_tokens=bench.RESPONSE_TOKENS)
    engine.generate(prompts, params)  # compile and record
    bench.sync()

    width, inner, dtype = ((64, 128, torch.float32) if args.smoke else (896, 4864, torch.bfloat16))
    a = torch.randn(16384, width, device=device, dtype=dtype)
    w = torch.randn(width, inner, device=device, dtype=dtype)

    def gen_seconds(stream: Any = None) -> float:
        start = time.perf_counter()
        if stream is None:
            engine.generate(prompts, params)
        else:
            with torch.cuda.stream(stream):
                engine.generate(prompts, params)
            stream.synchronize()
        return time.perf_counter() - start

    def variant(name: str, stream: Any, load: bool) -> None:
        result: dict[str, float] = {}
        thread = threading.Thread(target=lambda: result.update(gen=gen_seconds(stream)))
        thread.start()
        tflops = products_beside(thread, a, w) if load else 0.0
        thread.join()
        print(f"{name}: generation {result['gen']:.3f} s, matrix products {tflops:.0f} TFLOP/s", flush=True)

    print(f"main thread alone: generation {gen_seconds():.3f} s", flush=True)
    variant("thread, default stream, alone", None, False)
    if args.smoke:
        variant("thread, beside matrix products (the CPU: no streams)", None, True)
        print("smoke: side streams, high-priority streams and green contexts skipped (a GPU only)", flush=True)
        return
    variant("thread, side stream, alone", torch.cuda.Stream(), False)
    variant("thread, side stream, beside matrix products", torch.cuda.Stream(), True)
    variant("thread, high-priority stream, beside matrix products", torch.cuda.Stream(priority=-1), True)
    if not args.green:
        return
    # Green contexts (SMs split between the two threads): cuDNN's attention refused to run in one here, so
    # attention goes through the flash / memory-efficient kernels.
    torch.backends.cuda.enable_cudnn_sdp(False)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    from torch.cuda.green_contexts import GreenContext

    for share in (0.25, 0.5):
        gen_sms = int(sms * share) // 8 * 8
        try:
            green_variant(GreenContext, gen_sms, sms, model_dir, tok, prompts, params, a, w)
        except Exception as exc:  # an old driver or torch build
            print(f"green contexts ({gen_sms} SMs): failed ({type(exc).__name__}: {str(exc)[:200]})", flush=True)
            return


def green_variant(green: Any, gen_sms: int, sms: int, model_dir: Path, tok: Any, prompts: Any, params: Any,
                  a: Any, w: Any) -> None:
    """A second engine built, recorded and run entirely inside a green context of ``gen_sms`` SMs (a graph
    recorded in one context is not replayed in another), beside matrix products in a context of the rest."""
    import torch

    from rlx.plugins.rollout.hf import HFRollout, HFRolloutOptions

    gen_ctx = green.create(num_sms=gen_sms, device_id=0)
    train_ctx = green.create(num_sms=sms - gen_sms, device_id=0)
    ready, result = threading.Event(), {}

    def run() -> None:
        try:
            gen_ctx.set_context()
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                engine = HFRollout(str(model_dir), HFRolloutOptions(micro_batch_size=512), "cuda",
                                   [tok.eos_token_id], tok.pad_token_id)
                engine.generate(prompts, params)
                stream.synchronize()
                start = time.perf_counter()
                engine.generate(prompts, params)
                stream.synchronize()
                result["alone"] = time.perf_counter() - start
                ready.set()
                start = time.perf_counter()
                engine.generate(prompts, params)
                stream.synchronize()
                result["beside"] = time.perf_counter() - start
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            ready.set()

    thread = threading.Thread(target=run)
    thread.start()
    ready.wait()
    train_ctx.set_context()
    tflops = products_beside(thread, a, w)
    thread.join()
    if "error" in result:
        print(f"green contexts ({gen_sms} SMs): failed ({result['error']})", flush=True)
        return
    print(f"green contexts, {gen_sms} of {sms} SMs for generation: alone {result['alone']:.3f} s, beside matrix "
          f"products {result['beside']:.3f} s ({tflops:.0f} TFLOP/s on the other {sms - gen_sms} SMs)", flush=True)


def products_beside(thread: threading.Thread, a: Any, w: Any) -> float:
    """bf16 matrix products ``a @ w`` in this thread while ``thread`` runs; their rate in TFLOP/s."""
    import torch

    products, start = 0, time.perf_counter()
    while thread.is_alive():
        for _ in range(20):
            (a @ w).sum()
        products += 20
        if a.is_cuda:
            torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return products * 2 * a.shape[0] * a.shape[1] * w.shape[1] / max(seconds, 1e-9) / 1e12


if __name__ == "__main__":
    main()
