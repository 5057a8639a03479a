"""Actor-update throughput of the ``fsdp2`` backend on 1 and 2 GPUs (data parallel), with MFU.

The model has Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 heads, 2 KV heads, vocabulary 151,936, tied
embeddings) with random weights, so nothing is downloaded. Every rank holds ``--rows`` sequences of
``--prompt`` + ``--response`` tokens (no padding) and runs rlx's own worker (``FSDPWorker.update``: the
micro-batch loop, the GRPO loss, gradient clipping across shards, AdamW) on them: one optimizer step per
measured step, as a GRPO update with one mini-batch. The old log-probs come from a real log-prob pass,
which is timed too.

MFU is model FLOPs per second over the bf16 matmul rate measured in the same run on the same GPU
(an 8192-cube matmul), not the datasheet: model FLOPs per token are 6 x the parameters the tokens pass
through (attention and MLP projections, and the output layer; not the embedding lookup) plus
12 x layers x hidden x sequence length for attention scores and values (the causal half is counted in
full, as most frameworks do); the log-prob pass counts a third of that (forward only).

    python benchmarks/fsdp_scaling.py [--gpus 1 2] [--rows 16] [--prompt 256] [--response 512] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from typing import Any

SHAPE = {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
         "num_attention_heads": 14, "num_key_value_heads": 2}


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def matmul_tflops(n: int = 8192, reps: int = 50) -> float:
    import torch

    if not torch.cuda.is_available():  # the CPU smoke run (--tiny)
        n, reps = 512, 5
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2 * n ** 3 * reps / (time.perf_counter() - start) / 1e12


def flops_per_token(seq: int) -> float:
    """Training FLOPs of one token of a ``seq``-token sequence (forward + backward)."""
    h, i, layers, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_hidden_layers"], SHAPE["vocab_size"]
    kv = h // SHAPE["num_attention_heads"] * SHAPE["num_key_value_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i  # q, o; k, v; gate, up, down
    dense = layers * per_layer + h * v
    return 6 * dense + 12 * layers * h * seq


def build_model(path: str) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPE, max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=0,
                         eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, path: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from rlx.batch import Batch
    from rlx.plugins.algorithms.grpo import GRPOLoss, GRPOOptions
    from rlx.plugins.backends.fsdp import FSDP2Options, FSDPWorker
    from rlx.protocols import RoleSpec

    os.environ["LOCAL_RANK"] = str(rank)
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        spec = RoleSpec(role="actor", model_path=path, trainable=True, dtype="bfloat16" if gpu else "float32",
                        lr=1e-6,
                        micro_batch_size=args.micro, gradient_checkpointing=args.checkpointing, seed=0)
        worker = FSDPWorker(spec, FSDP2Options(reshard_after_forward=not args.no_reshard),
                             "cuda" if gpu else "cpu", "fsdp2")
        g = torch.Generator().manual_seed(rank)
        rows, P, R = args.rows, args.prompt, args.response
        vocab = args.vocab  # spawned processes import this module afresh: SHAPE is the default there
        batch = Batch({"prompts": torch.randint(2, vocab, (rows, P), generator=g),
                       "prompt_mask": torch.ones(rows, P, dtype=torch.long),
                       "responses": torch.randint(2, vocab, (rows, R), generator=g),
                       "response_mask": torch.ones(rows, R, dtype=torch.long),
                       "advantages": torch.randn(rows, 1, generator=g).expand(rows, R).contiguous()})
        loss = GRPOLoss(GRPOOptions(use_kl_loss=False))
        times: dict[str, list[float]] = {"log_prob": [], "update": []}
        for step in range(args.warmup + args.steps):
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            batch.tensors["old_log_probs"] = worker.compute_log_probs(batch)["log_probs"]
            sync()
            t1 = time.perf_counter()
            metrics = worker.update([batch], loss)
            sync()
            t2 = time.perf_counter()
            if step >= args.warmup:
                times["log_prob"].append(t1 - t0)
                times["update"].append(t2 - t1)
        if args.profile and rank == 0:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                batch.tensors["old_log_probs"] = worker.compute_log_probs(batch)["log_probs"]
                worker.update([batch], loss)
                sync()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.profile))
        elif args.profile:
            batch.tensors["old_log_probs"] = worker.compute_log_probs(batch)["log_probs"]
            worker.update([batch], loss)
        peak = torch.cuda.max_memory_allocated() / 2**30 if gpu else 0.0
        result = {"rank": rank, "times": times, "peak_mem_gib": peak, "grad_norm": metrics[-1]["grad_norm"],
                  "tflops_matmul": matmul_tflops()}
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def measure(world: int, args: argparse.Namespace, path: str) -> dict[str, Any]:
    import torch.multiprocessing as mp

    out = tempfile.mkdtemp()
    mp.start_processes(rank_main, args=(world, free_port(), args, path, out), nprocs=world, join=True,
                       start_method="spawn")
    ranks = []
    for r in range(world):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    seq = args.prompt + args.response
    tokens = args.rows * seq  # per GPU per step
    update_s = max(sum(r["times"]["update"]) / len(r["times"]["update"]) for r in ranks)
    logprob_s = max(sum(r["times"]["log_prob"]) / len(r["times"]["log_prob"]) for r in ranks)
    rate = min(r["tflops_matmul"] for r in ranks)
    fpt = flops_per_token(seq)
    return {"gpus": world, "update_s": update_s, "log_prob_s": logprob_s,
            "update_tokens_per_s_per_gpu": tokens / update_s, "log_prob_tokens_per_s_per_gpu": tokens / logprob_s,
            "update_mfu": fpt * tokens / update_s / (rate * 1e12),
            "log_prob_mfu": fpt / 3 * tokens / logprob_s / (rate * 1e12),
            "matmul_tflops": rate, "peak_mem_gib": max(r["peak_mem_gib"] for r in ranks),
            "grad_norm": ranks[0]["grad_norm"]}


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, default=16, help="sequences per GPU per step")
    p.add_argument("--micro", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing")
    p.add_argument("--no-reshard", action="store_true", help="reshard_after_forward=false")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the measured steps, profile one more and print the N ops with most GPU time")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model of width 64 (a CPU smoke run)")
    args = p.parse_args()
    if args.tiny:
        SHAPE.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    args.vocab = SHAPE["vocab_size"]
    path = tempfile.mkdtemp()
    build_model(path)
    available = torch.cuda.device_count() or (2 if args.tiny else 0)
    results = []
    for world in args.gpus:
        if world > available:
            print(f"skipped {world} GPUs: {available} visible")
            continue
        r = measure(world, args, path)
        results.append(r)
        print(json.dumps(r))
    print(f"\nfsdp2, Qwen2.5-0.5B shape, {args.rows} x ({args.prompt}+{args.response}) tokens per GPU, "
          f"micro-batch {args.micro}, checkpointing={args.checkpointing}, reshard_after_forward={not args.no_reshard}")
    print("| GPUs | update s | tokens/s/GPU | MFU | log-prob s | tokens/s/GPU | MFU | peak GiB | scaling |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base = results[0]["update_tokens_per_s_per_gpu"] if results else 1.0
    for r in results:
        print(f"| {r['gpus']} | {r['update_s']:.3f} | {r['update_tokens_per_s_per_gpu']:,.0f} | "
              f"{r['update_mfu']:.1%} | "
              f"{r['log_prob_s']:.3f} | {r['log_prob_tokens_per_s_per_gpu']:,.0f} | {r['log_prob_mfu']:.1%} | "
              f"{r['peak_mem_gib']:.1f} | {r['update_tokens_per_s_per_gpu'] / base:.0%} |")
    if results:
        print(f"bf16 matmul measured: {results[0]['matmul_tflops']:.0f} TFLOP/s; torch {torch.__version__}")


if __name__ == "__main__":
    main()
