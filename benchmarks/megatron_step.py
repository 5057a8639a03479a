"""The ``megatron`` backend on GPUs: does it learn, does TP=2 agree with TP=1, and how fast is a step.

    python benchmarks/megatron_step.py learn [--seeds 1 2 3] [--steps 120]
    python benchmarks/megatron_step.py tp-agreement                  # needs 2 GPUs
    python benchmarks/megatron_step.py step [--shape 0.5b 1.5b] [--gpus 1] [--tp 1] [--pp 1] [--head-chunk 0 1024]

``learn``: ``rlx train --preset tiny --backend megatron trainer.device=cuda`` (GRPO on the built-in
arithmetic task) per seed; prints greedy accuracy on builtin:arith-test before and after training and the
mean reward of the first 5 and last 10 steps, and fails if any seed ends below ``--min-accuracy``. The
``torch`` backend takes the same job from 0.02 to 0.95-0.98 in 120 steps (docs/benchmarks.md), so the
default threshold (0.5) leaves a wide margin for bf16 and seed noise while still meaning "learned". Needs
the ``megatron`` entry point (``rlx plugins list`` shows it).

``tp-agreement``: the same actor update (Qwen2.5-0.5B's shape with 4 KV heads so TP=2 splits them, random
weights, float32 with TF32 off, one GRPO mini-batch of 8 rows in micro-batches of 2) with TP=1 on one GPU
and TP=2 on two; prints both runs' losses and gradient norms for 3 steps and fails unless they agree to
1e-4 relative (float32: the TP run adds the row-parallel partial sums and the vocabulary shards in another
order, nothing else differs).

``step``: rlx's ``MegatronWorker`` (log-prob pass + one actor update per step) on random-weight models of
Qwen2.5-0.5B's or 1.5B's shape, bf16 with fp32 master weights, every rank with ``--rows`` sequences of
``--prompt`` + ``--response`` tokens; one markdown row per shape like benchmarks/fsdp_scaling.py's: step
time (log-prob pass and update), tokens per second per GPU, MFU (model FLOPs over the bf16 matmul rate
measured on the same GPU; FLOPs per token as in fsdp_scaling.py) and peak GPU memory.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlx.records import DEFAULT_CHUNK_SIZE

SHAPES = {
    "0.5b": {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2},
    "1.5b": {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2},
}
ACC = "val/rlx/arith/acc"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(path: str, shape: dict[str, int]) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=0,
                         eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)


# -- learn ------------------------------------------------------------------------------------------------
def learn(args: argparse.Namespace) -> None:
    from rlx.plugins.loggers.jsonl import read_metrics

    listed = subprocess.run([sys.executable, "-m", "rlx", "plugins", "list"], capture_output=True, text=True)
    if "megatron" not in listed.stdout:
        raise SystemExit("the megatron backend is not registered (add the entry point backend_megatron to "
                         "pyproject.toml and reinstall)")
    rows = []
    for seed in args.seeds:
        folder = Path(args.out) / f"grpo-megatron-s{seed}"
        cmd = [sys.executable, "-m", "rlx", "train", "--preset", "tiny", "--backend", "megatron",
               "trainer.device=cuda", f"trainer.seed={seed}", f"trainer.total_steps={args.steps}",
               f"trainer.output_dir={folder}", "trainer.val_before_train=true", "trainer.loggers=[jsonl]",
               "trainer.save_freq=0", "trainer.save_hf_model=false", "trainer.log_samples=0", *args.overrides]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"seed {seed} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        metrics = read_metrics(folder)
        rewards = [r["reward/mean"] for r in metrics if "reward/mean" in r]
        val = [r[ACC] for r in metrics if ACC in r]
        rows.append({"seed": seed, "acc_start": val[0], "acc_end": val[-1], "reward_start": sum(rewards[:5]) / 5,
                     "reward_end": sum(rewards[-10:]) / 10, "steps": len(rewards), "seconds": seconds})
    print("| seed | accuracy start -> end | reward first 5 -> last 10 steps | steps | seconds |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['seed']} | {r['acc_start']:.2f} -> {r['acc_end']:.2f} | {r['reward_start']:.2f} -> "
              f"{r['reward_end']:.2f} | {r['steps']} | {r['seconds']:.0f} |")
    worst = min(r["acc_end"] for r in rows)
    if worst < args.min_accuracy:
        raise SystemExit(f"FAIL: a seed ended at accuracy {worst:.2f} < {args.min_accuracy}")
    print(f"OK: every seed ended at accuracy >= {args.min_accuracy} (worst {worst:.2f})")


# -- worker runs in spawned processes ----------------------------------------------------------------------
def make_batch(rows: int, prompt: int, response: int, vocab: int, seed: int) -> Any:
    import torch

    from rlx.batch import Batch

    g = torch.Generator().manual_seed(seed)
    return Batch({"prompts": torch.randint(2, vocab, (rows, prompt), generator=g),
                  "prompt_mask": torch.ones(rows, prompt, dtype=torch.long),
                  "responses": torch.randint(2, vocab, (rows, response), generator=g),
                  "response_mask": torch.ones(rows, response, dtype=torch.long),
                  "advantages": torch.randn(rows, 1, generator=g).expand(rows, response).contiguous()})


def rank_main(rank: int, world: int, port: int, job: dict[str, Any], out: str) -> None:
    import torch
    import torch.distributed as dist

    from rlx.dispatch import shard
    from rlx.plugins.algorithms.grpo import GRPOLoss, GRPOOptions
    from rlx.plugins.backends.megatron import MegatronOptions, MegatronWorker
    from rlx.protocols import RoleSpec
    from rlx.records import ForwardOptions

    os.environ["LOCAL_RANK"] = str(rank)
    torch.cuda.set_device(rank)
    if job["float32"]:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        budget = job.get("budget") or None
        forward = ForwardOptions(log_prob_chunk_size=job.get("head_chunk", DEFAULT_CHUNK_SIZE),
                                 use_dynamic_bsz=budget is not None, ppo_max_token_len=budget,
                                 log_prob_max_token_len=budget and 2 * budget,
                                 use_torch_compile=bool(job.get("compile")))
        spec = RoleSpec(role="actor", model_path=job["path"], trainable=True,
                        dtype="float32" if job["float32"] else "bfloat16", lr=job["lr"], weight_decay=0.0,
                        micro_batch_size=job["micro"], gradient_checkpointing=job["checkpointing"], seed=0,
                        forward=forward)
        options = MegatronOptions(tensor_model_parallel_size=job["tp"], pipeline_model_parallel_size=job["pp"],
                                  sequence_parallel=job["tp"] > 1 and job["sp"])
        import rlx.plugins.backends.megatron as backend

        if job.get("stock"):  # megatron-core's own fallbacks (per-tensor loops, foreach AdamW): the "before"
            backend.use_torch_kernels = lambda optimizer: None
        if job.get("tphead"):  # the vocabulary-parallel head function at one TP rank too: the head's "before"
            backend.WHOLE_VOCABULARY_HEAD = False
        worker = MegatronWorker(spec, options, "cuda")
        info = worker.dispatch_info()
        full = make_batch(job["rows"] * info.dp_size, job["prompt"], job["response"], job["vocab"], seed=1)
        batch = shard(full, info.dp_size)[info.dp_rank]
        loss = GRPOLoss(GRPOOptions(use_kl_loss=False))
        times: dict[str, list[float]] = {"log_prob": [], "update": []}
        metrics: list[dict[str, float]] = []
        torch.cuda.reset_peak_memory_stats()
        profile = job.get("profile") and rank == 0
        for step in range(job["warmup"] + job["steps"] + (1 if profile else 0)):
            if profile and step == job["warmup"] + job["steps"]:
                profiled(lambda: (worker.compute_log_probs(batch), worker.update([batch], loss)))
                break
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            old = worker.compute_log_probs(batch)
            if "log_probs" in old:  # the last pipeline stage, where the loss is computed, has them
                batch.tensors["old_log_probs"] = old["log_probs"]
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            metrics += worker.update([batch], loss)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            if step >= job["warmup"]:
                times["log_prob"].append(t1 - t0)
                times["update"].append(t2 - t1)
        result = {"times": times, "metrics": metrics, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                  "collect": info.collect}
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def profiled(fn: Any) -> None:
    """Run ``fn`` (one step) under torch's profiler and print where the GPU's and the host's time went."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    kernels = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"profiled step: {wall:.3f} s wall (profiler on), GPU kernels {kernels / 1e6:.3f} s")
    print(events.table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))


def run_job(job: dict[str, Any], world: int) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(rank_main, args=(world, free_port(), job, out), nprocs=world, join=True,
                           start_method="spawn")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def tp_agreement(args: argparse.Namespace) -> None:
    shape = dict(SHAPES["0.5b"], num_attention_heads=16, num_key_value_heads=4, hidden_size=1024)
    with tempfile.TemporaryDirectory() as tmp:
        build_model(tmp, shape)
        job = {"path": tmp, "float32": True, "lr": 1e-5, "micro": 2, "checkpointing": False, "tp": 1, "pp": 1,
               "sp": False, "rows": 8, "prompt": 64, "response": 128, "vocab": shape["vocab_size"], "warmup": 0,
               "steps": 3}
        one = run_job(job, 1)[0]["metrics"]
        two = next(r for r in run_job(dict(job, tp=2), 2) if r["collect"])["metrics"]
    print("| step | pg_loss TP=1 | pg_loss TP=2 | grad_norm TP=1 | grad_norm TP=2 |")
    print("| --- | --- | --- | --- | --- |")
    worst = 0.0
    for i, (a, b) in enumerate(zip(one, two)):
        loss = "actor/pg_loss"
        print(f"| {i} | {a[loss]:.7g} | {b[loss]:.7g} | {a['grad_norm']:.7g} | {b['grad_norm']:.7g} |")
        for key in ("actor/pg_loss", "grad_norm"):
            worst = max(worst, abs(a[key] - b[key]) / max(abs(a[key]), 1e-12))
    if worst > 1e-4:
        raise SystemExit(f"FAIL: TP=2 differs from TP=1 by {worst:.2e} relative")
    print(f"OK: TP=2 agrees with TP=1 to {worst:.2e} relative")


def matmul_tflops(n: int = 8192, reps: int = 50, device: str = "cuda") -> float:
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(5):
        a @ b
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2 * n ** 3 * reps / (time.perf_counter() - start) / 1e12


def flops_per_token(shape: dict[str, int], seq: int) -> float:
    h, i, layers, v = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    dense = layers * (h * h * 2 + h * kv * 2 + 3 * h * i) + h * v
    return 6 * dense + 12 * layers * h * seq


def parse_variant(variant: str) -> dict[str, Any]:
    """``micro4`` / ``budget12288`` (rows per micro-batch, or a token budget), ``+stock`` (megatron-core's own
    optimizer fallbacks, the before of use_torch_kernels), ``+compile`` (``actor.use_torch_compile``: each decoder
    layer compiled), ``+tphead`` (the vocabulary-parallel head function at one TP rank, the before of the torch
    backends' chunked head there)."""
    job: dict[str, Any] = {}
    for part in variant.split("+"):
        if part.startswith("micro"):
            job["micro"] = int(part[5:])
        elif part.startswith("budget"):
            job["budget"] = int(part[6:])
        elif part in ("stock", "compile", "tphead"):
            job[part] = True
        elif part != "default":
            raise SystemExit(f"unknown variant part {part!r} (microN, budgetN, stock, compile, tphead, default)")
    return job


def step(args: argparse.Namespace) -> None:
    if args.smoke:
        return smoke(args)
    peak = matmul_tflops()
    print(f"bf16 matmul: {peak:.0f} TFLOP/s measured")
    print("| shape | variant | GPUs | TP | PP | head chunk | rows/GPU | tokens/row | log-prob pass s | update s | "
          "tokens/s/GPU | MFU | update MFU | peak GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    runs = [(name, chunk, variant) for name in args.shape for chunk in args.head_chunk for variant in args.variants]
    for name, chunk, variant in runs:
        shape = SHAPES[name]
        with tempfile.TemporaryDirectory() as tmp:
            build_model(tmp, shape)
            job = {"path": tmp, "float32": False, "lr": 1e-6, "micro": args.micro, "checkpointing": args.checkpointing,
                   "tp": args.tp, "pp": args.pp, "sp": args.sequence_parallel, "rows": args.rows,
                   "prompt": args.prompt, "response": args.response, "vocab": shape["vocab_size"],
                   "warmup": args.warmup, "steps": args.steps, "head_chunk": chunk,
                   "profile": variant in args.profile, **parse_variant(variant)}
            try:
                ranks = run_job(job, args.gpus)
            except Exception as exc:  # one variant failing (e.g. compilation) must not hide the others
                print(f"| {name} | {variant}: failed: {str(exc).splitlines()[-1][:200]} |")
                continue
        report_row(args, name, variant, chunk, ranks, peak)


def report_row(args: argparse.Namespace, name: str, variant: str, chunk: int, ranks: list[dict[str, Any]],
               peak: float) -> None:
    """Print (and with --json append) one row: mean log-prob pass and update seconds of the slowest rank,
    tokens/s per GPU, MFU of both passes (forward 2, update 6 FLOPs per parameter and token) and of the update
    alone, peak memory."""
    shape = SHAPES[name]
    lp = max(sum(r["times"]["log_prob"]) / len(r["times"]["log_prob"]) for r in ranks)
    up = max(sum(r["times"]["update"]) / len(r["times"]["update"]) for r in ranks)
    seq = args.prompt + args.response
    dp = args.gpus // (args.tp * args.pp)
    tokens = args.rows * dp * seq  # every data-parallel rank holds args.rows rows
    flops = tokens * flops_per_token(shape, seq) * (1 + 1 / 3)
    mfu = flops / (lp + up) / args.gpus / (peak * 1e12)
    update_mfu = tokens * flops_per_token(shape, seq) / up / args.gpus / (peak * 1e12)
    peak_gib = max(r["peak_gib"] for r in ranks)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"shape": name, "variant": variant, "gpus": args.gpus, "tp": args.tp, "pp": args.pp,
                                "head_chunk": chunk, "log_prob_s": lp, "update_s": up,
                                "tokens_per_s_per_gpu": tokens / (lp + up) / args.gpus, "mfu": mfu,
                                "update_mfu": update_mfu, "matmul_tflops": peak, "peak_gib": peak_gib}) + "\n")
    print(f"| {name} | {variant} | {args.gpus} | {args.tp} | {args.pp} | {chunk or 'off'} | "
          f"{args.rows * dp // args.gpus} | {seq} | {lp:.3f} | {up:.3f} | {tokens / (lp + up) / args.gpus:.0f} | "
          f"{mfu:.1%} | {update_mfu:.1%} | {peak_gib:.1f} |")


def smoke(args: argparse.Namespace) -> None:
    """The CPU (CI): what ``step`` runs, on a 2-layer model through megatron-core's local layers on one gloo rank
    (megatron-core's CUDA-only placements pointed at the CPU as tests/plugins/backends/test_megatron.py does):
    one forward pass without gradients and one forward and backward pass with the chunked head, each variant's
    layers compiled where it asks, then the row's arithmetic and JSON. megatron's DDP and optimizer need CUDA:
    the update here is the forward and backward pass only."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "plugins" / "backends"))
    from test_megatron import emulate_cuda_placement  # type: ignore[import-not-found]

    import rlx.plugins.backends.megatron as backend
    from rlx.plugins.backends.megatron import (
        MegatronOptions,
        compile_layers,
        config_overrides,
        model_outputs,
        run_model,
    )
    from rlx.plugins.backends.megatron_convert import build_chunks, load_hf, make_bridge, read_hf_config

    SHAPES["smoke"] = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2}
    args.shape, args.rows, args.prompt, args.response, args.gpus, args.tp, args.pp = ["smoke"], 4, 8, 8, 1, 1, 1
    emulate_cuda_placement(setattr)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mpu.initialize_model_parallel(1, 1)
    peak = matmul_tflops(256, 5, device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        build_model(tmp, SHAPES["smoke"])
        config = read_hf_config(tmp)
        for variant in args.variants:
            job = parse_variant(variant)
            bridge = make_bridge(config, torch.float32, config_overrides(MegatronOptions(), torch.float32, True))
            chunks = build_chunks(bridge, config, value_head=False, use_te=False, vpp=None, device="cpu")
            load_hf(chunks, bridge, config, tmp, value_head=False, seed=0)
            if job.get("compile"):
                compile_layers(chunks)
            batch = make_batch(args.rows, args.prompt, args.response, 512, seed=1)
            t0 = time.perf_counter()
            compiled = bool(job.get("compile"))
            backend.WHOLE_VOCABULARY_HEAD = not job.get("tphead")
            with torch.no_grad():
                run_model(chunks[0], batch, 1, 4, compiled_head=compiled)
            t1 = time.perf_counter()
            output, where = run_model(chunks[0], batch, 1, 4, compiled_head=compiled)
            out = model_outputs(output, where, batch, value_head=False, with_entropy=True, head_done=True)
            (out["log_probs"] * batch["advantages"]).sum().backward()
            t2 = time.perf_counter()
            assert all(p.grad is not None for p in chunks[0].parameters() if p.requires_grad)
            report_row(args, "smoke", variant, 4, [{"times": {"log_prob": [t1 - t0], "update": [t2 - t1]},
                                                    "peak_gib": 0.0}], peak)
    mpu.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("learn")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--min-accuracy", type=float, default=0.5)
    p.add_argument("--out", default="outputs/megatron_learn")
    p.add_argument("overrides", nargs="*")
    sub.add_parser("tp-agreement")
    p = sub.add_parser("step")
    p.add_argument("--shape", nargs="+", default=["0.5b", "1.5b"], choices=sorted(SHAPES))
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response", type=int, default=512)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--head-chunk", nargs="+", type=int, default=[DEFAULT_CHUNK_SIZE],
                   help="actor.log_prob_chunk_size values to run (0: the full head); one row each")
    p.add_argument("--variants", nargs="+", default=["default"],
                   help="one row each: default, micro16, budget12288, +stock, +compile, +tphead "
                        "(e.g. budget12288+compile)")
    p.add_argument("--profile", nargs="*", default=[], help="variants to profile one more step of (rank 0)")
    p.add_argument("--json", default=None, help="append one JSON line per row to this file")
    p.add_argument("--smoke", action="store_true", help="the CPU, a tiny model, no GPU (CI): see smoke()")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    {"learn": learn, "tp-agreement": tp_agreement, "step": step}[args.mode](args)


if __name__ == "__main__":
    main()
