"""Seconds per actor -> rollout weight sync of a Qwen2.5-0.5B-shaped model, by transport
(``rlx.plugins.launchers.weight_sync``).

The actor's tensors are the state dict of Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 heads, 2 KV heads,
vocabulary 151,936, tied embeddings listed under both names as ``state_dict()`` lists them) with random values,
in ``--dtype`` (float32: the training backends' master weights). The engine holds its own copy in bfloat16 on a
GPU (float32 on the CPU) and loads each tensor as it arrives (``copy_``, as the ``hf`` engine does), so a sync is
measured from the moment both sides start to the moment the engine holds every tensor:

- ``in_process``: actor and engine in one process (the colocated pool);
- ``cuda_ipc``: a rollout process on the same GPU maps rank 0's two alternating buffers (on the CPU, the same
  code over shared memory);
- ``broadcast``: a rollout process on the second GPU, NCCL (needs two GPUs; gloo on the CPU).

After the last sync the engine's weights are compared with the actor's (cast to the engine's dtype): a wrong
transfer fails the run instead of printing a time.

    python benchmarks/weight_sync.py [--transport in_process cuda_ipc broadcast] [--bucket-mb 256] [--syncs 5]
                                     [--dtype float32] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from datetime import timedelta
from typing import Any

SHAPE = {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
         "num_attention_heads": 14, "num_key_value_heads": 2}
TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def shapes(cfg: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.q_proj.bias", (h,)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.v_proj.bias", (kv,)),
                (p + "self_attn.o_proj.weight", (h, h)), (p + "mlp.gate_proj.weight", (i, h)),
                (p + "mlp.up_proj.weight", (i, h)), (p + "mlp.down_proj.weight", (h, i)),
                (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    return [*out, ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


class Actor:
    def __init__(self, cfg: dict[str, int], dtype: Any, device: str) -> None:
        import torch

        gen = torch.Generator(device=device).manual_seed(0)
        self.weights = {n: torch.randn(s, generator=gen, device=device).to(dtype) for n, s in shapes(cfg)
                        if n != "lm_head.weight"}
        self.weights["lm_head.weight"] = self.weights["model.embed_tokens.weight"]  # tied

    def named_weights(self) -> Any:
        return iter(self.weights.items())


class Engine:
    def __init__(self, cfg: dict[str, int], dtype: Any, device: str) -> None:
        import torch

        self.weights = {n: torch.zeros(s, dtype=dtype, device=device) for n, s in shapes(cfg)}

    def update_weights(self, named: Any) -> None:
        for name, tensor in named:
            self.weights[name].copy_(tensor)


def fingerprint(weights: dict[str, Any], dtype: Any) -> float:
    return float(sum(t.to(dtype).double().sum() for t in weights.values()))


def sync_device() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _process(rank: int, port: int, args: Any, transport: str, results: Any) -> None:
    import torch
    import torch.distributed as dist

    from rlx.plugins.launchers import weight_sync

    cuda = torch.cuda.is_available() and not args.tiny
    device = "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank if transport == "broadcast" else 0)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=300))
    timeout = timedelta(seconds=300)
    clock = dist.ProcessGroupGloo(dist.PrefixStore("clock", store), rank, 2, timeout)
    if transport == "broadcast" and cuda:
        group: Any = dist.ProcessGroupNCCL(dist.PrefixStore("weights", store), rank, 2)
    else:
        group = dist.ProcessGroupGloo(dist.PrefixStore("weights", store), rank, 2, timeout)
    cfg = TINY if args.tiny else SHAPE
    engine_dtype = torch.bfloat16 if cuda else torch.float32
    limit = weight_sync.bucket_bytes(args.bucket_mb)
    side: Any = Actor(cfg, getattr(torch, args.dtype), device) if rank == 0 else Engine(cfg, engine_dtype, device)
    seconds: list[float] = []
    stats: Any = None
    for _ in range(args.syncs + 1):  # the first one warms up (CUDA contexts, IPC mappings, allocator)
        sync_device()
        clock.barrier().wait()
        start = time.perf_counter()
        if rank == 0:
            send = weight_sync.ipc_send if transport == "cuda_ipc" else weight_sync.broadcast_send
            stats = send(side.named_weights(), group, limit, device)
        elif transport == "cuda_ipc":
            weight_sync.ipc_receive_into(side, group)
        else:
            weight_sync.receive_into(side, group, device)
        sync_device()
        clock.barrier().wait()
        seconds.append(time.perf_counter() - start)
    results.put((rank, seconds[1:], stats.bytes if stats else 0, stats.buckets if stats else 0,
                 fingerprint(side.weights, engine_dtype)))


def two_processes(args: Any, transport: str) -> dict[str, Any]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_process, args=(r, store.port, args, transport, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = {rank: rest for rank, *rest in (results.get(timeout=1800) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
    seconds, nbytes, nbuckets, actor_print = got[0]
    if got[1][3] != actor_print:
        raise SystemExit(f"{transport}: the engine's weights differ from the actor's ({got[1][3]} != {actor_print})")
    return {"seconds": seconds, "bytes": nbytes, "buckets": nbuckets}


def in_process(args: Any) -> dict[str, Any]:
    import torch

    from rlx.plugins.launchers import weight_sync

    cuda = torch.cuda.is_available() and not args.tiny
    device = "cuda" if cuda else "cpu"
    engine_dtype = torch.bfloat16 if cuda else torch.float32
    cfg = TINY if args.tiny else SHAPE
    actor, engine = Actor(cfg, getattr(torch, args.dtype), device), Engine(cfg, engine_dtype, device)
    seconds = []
    for _ in range(args.syncs + 1):
        sync_device()
        start = time.perf_counter()
        stats = weight_sync.sync_in_process(actor, engine, weight_sync.bucket_bytes(args.bucket_mb))
        sync_device()
        seconds.append(time.perf_counter() - start)
    if fingerprint(engine.weights, engine_dtype) != fingerprint(actor.weights, engine_dtype):
        raise SystemExit("in_process: the engine's weights differ from the actor's")
    return {"seconds": seconds[1:], "bytes": stats.bytes, "buckets": stats.buckets}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transport", nargs="+", default=["in_process", "cuda_ipc", "broadcast"],
                        choices=["in_process", "cuda_ipc", "broadcast"])
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU (a smoke run)")
    args = parser.parse_args()
    import torch

    gpus = torch.cuda.device_count() if not args.tiny else 0
    for transport in args.transport:
        if transport == "broadcast" and gpus == 1:
            print(json.dumps({"transport": transport, "skipped": "needs two GPUs (NCCL refuses one GPU twice)"}))
            continue
        result = in_process(args) if transport == "in_process" else two_processes(args, transport)
        median = statistics.median(result["seconds"])
        print(json.dumps({"transport": transport, "device": torch.cuda.get_device_name() if gpus else "cpu",
                          "dtype": args.dtype, "bucket_mb": args.bucket_mb, "bytes": result["bytes"],
                          "buckets": result["buckets"], "seconds_median": round(median, 4),
                          "seconds": [round(s, 4) for s in result["seconds"]],
                          "GB_per_s": round(result["bytes"] / median / 1e9, 2)}), flush=True)


if __name__ == "__main__":
    main()
