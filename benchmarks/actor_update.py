"""Actor-update throughput, MFU and peak memory of the torch backend: padded vs packed sequences, with and
without the chunked log-prob head, on Qwen2.5-0.5B- and 1.5B-shaped models (vocabulary 151,936, random
weights, nothing downloaded).

Each variant builds the actor as a run does (float32 master weights, bf16 autocast on a GPU, AdamW), then
times ``--steps`` GRPO updates (one optimizer step over all rows, in micro-batches) after one warm-up update,
and one log-prob pass (the old/ref log-probs of a GRPO step). Rows have ragged lengths: prompts of
``--prompt-len`` tokens (a quarter of them padding on average), responses uniform in
[``--response-len``/4, ``--response-len``], as sampled responses are.

- tokens/s: valid (prompt + response) tokens per second of update.
- MFU: model FLOPs of the valid tokens (6 x matmul parameters per token, plus causal attention
  6 x layers x hidden x sum of squared sequence lengths) per second, over the bf16 matmul rate measured
  in the same run (8192^3 matmuls). Padding costs FLOPs that do not count.
- peak memory: ``torch.cuda.max_memory_allocated`` over the updates (and over the log-prob pass).

    python benchmarks/actor_update.py                       # GPU: both sizes, every variant
    python benchmarks/actor_update.py --sizes 0.5b --attn sdpa,flex_attention --json out.jsonl
    python benchmarks/actor_update.py --tiny                # CPU smoke run of the same code (seconds)
    python benchmarks/actor_update.py --equivalence         # CPU: packed/chunked/dynamic vs the plain path
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, int]] = {
    # Qwen2.5-0.5B and 1.5B transformer shapes
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "vocab_size": 151936},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "vocab_size": 151936},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "vocab_size": 4096},
}


def build_model(shape: dict[str, int], path: Path) -> int:
    """A random model of ``shape`` saved to ``path``; returns its matmul parameter count (lm_head included
    once: it is tied to the embedding, which is a lookup)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape, max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1e6)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    return sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2)


def make_batch(rows: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0) -> Any:
    import torch

    from rlx.batch import Batch

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(10, vocab, (rows, prompt_len), generator=g)
    responses = torch.randint(10, vocab, (rows, response_len), generator=g)
    plen = torch.randint(prompt_len // 2, prompt_len + 1, (rows,), generator=g)
    rlen = torch.randint(max(1, response_len // 4), response_len + 1, (rows,), generator=g)
    prompt_mask = (torch.arange(prompt_len) >= prompt_len - plen[:, None]).long()  # left padding
    response_mask = (torch.arange(response_len) < rlen[:, None]).long()  # right padding
    prompts, responses = prompts * prompt_mask, responses * response_mask
    mask = response_mask.float()
    return Batch({"prompts": prompts, "prompt_mask": prompt_mask, "responses": responses,
                  "response_mask": response_mask, "advantages": torch.randn(rows, 1, generator=g) * mask,
                  "old_log_probs": -torch.rand(rows, response_len, generator=g) * mask})


def matmul_rate(device: str, dtype: Any, n: int) -> float:
    """Measured FLOP/s of an n x n x n matmul in ``dtype`` on ``device``."""
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    reps = 20 if device != "cpu" else 3
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


def sync(device: str) -> None:
    import torch

    if device != "cpu":
        torch.cuda.synchronize()


def model_flops(batch: Any, matmul_params: int, shape: dict[str, int]) -> float:
    """Training FLOPs of the batch's valid tokens: 6 per matmul parameter per token, plus causal attention
    (QK^T and AV, forward and backward) over each sequence's own length."""
    lengths = (batch["prompt_mask"].sum(-1) + batch["response_mask"].sum(-1)).double()
    tokens = float(lengths.sum())
    attention = 6.0 * shape["num_hidden_layers"] * shape["hidden_size"] * float((lengths**2).sum())
    return 6.0 * matmul_params * tokens + attention


def profile_update(worker: Any, batch: Any, loss: Any, device: str, path: str) -> None:
    """One more update under torch.profiler: the top kernels by GPU time, the GPU's busy time against the
    wall time, and the longest stretches the GPU sat idle, each with the CPU operators that ran meanwhile
    (where the host made the GPU wait)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        worker.update([batch], loss)
        sync(device)
    wall = time.perf_counter() - start
    events = prof.key_averages()
    # kernels only: an operator's row repeats the time of the kernels it launched
    busy = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e6
    table = events.table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=90)
    report = f"wall {wall:.3f} s (profiled), GPU busy {busy:.3f} s\n{idle_report(prof.events())}\n{table}"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(report)
    print(f"  profile: wall {wall:.3f} s, GPU busy {busy:.3f} s -> {path}")
    print("\n".join(report.splitlines()[:30]))


def idle_report(events: Any, top: int = 15) -> str:
    """The GPU's idle stretches between its first and last kernel: their total, and the ``top`` longest, each
    with the shortest CPU operators that cover most of it."""
    from torch.autograd import DeviceType

    kernels = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    if not kernels:
        return "no kernels recorded"
    gaps, end = [], kernels[0][1]
    for s, e in kernels[1:]:
        if s > end:
            gaps.append((s - end, end, s))
        end = max(end, e)
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    lines = [f"GPU idle {sum(g[0] for g in gaps) / 1e3:.1f} ms in {len(gaps)} gaps "
             f"({sum(g[0] for g in gaps if g[0] >= 100) / 1e3:.1f} ms in gaps of 0.1 ms or more); longest:"]
    for length, g0, g1 in sorted(gaps, reverse=True)[:top]:
        over = [e for e in cpu if min(e.time_range.end, g1) - max(e.time_range.start, g0) >= 0.3 * length]
        over.sort(key=lambda e: e.time_range.end - e.time_range.start)
        names = " < ".join(e.name for e in over[:3]) or "(no operator: Python)"
        lines.append(f"  {length / 1e3:7.2f} ms at +{(g0 - kernels[0][0]) / 1e3:7.1f} ms: {names}")
    return "\n".join(lines)


def parse_variant(name: str, default_chunk: int, default_budget: int) -> dict[str, Any]:
    """A variant's settings from its name: '+'-joined parts, the first 'padded' or 'packed'.

    - ``chunked`` / ``chunked<N>``: the chunked head (N positions per chunk; default ``--chunk``);
    - ``dynamic`` / ``dyn<N>``: micro-batches cut by a token budget (default ``--max-tokens``);
    - ``bf16``: bf16 weights, gradients and AdamW states (actor.model_dtype=bfloat16) instead of float32
      master weights under bf16 autocast;
    - ``compile``: actor.use_torch_compile: ``torch.compile`` of each decoder layer and of the chunked
      head's element-wise work; ``eagerhead`` with it: the head's element-wise work left eager;
    - ``noflash``: packed attention per sequence through SDPA instead of PyTorch's varlen flash kernel;
    - ``[kernel]`` after packed: the attention implementation (default sdpa).
    """
    parts = name.split("+")
    head, attn = parts[0], "sdpa"
    if "[" in head:
        head, attn = head.rstrip("]").split("[")
    if head not in ("padded", "packed"):
        raise SystemExit(f"variant {name!r}: starts with padded or packed")
    v: dict[str, Any] = {"name": name, "packed": head == "packed", "attn": attn, "chunk": 0, "budget": None,
                         "bf16": False, "compile": False, "varlen": True, "eagerhead": False}
    for part in parts[1:]:
        if part.startswith("chunked"):
            v["chunk"] = int(part[7:] or default_chunk)
        elif part == "dynamic" or part.startswith("dyn"):
            v["budget"] = int(part[3:].replace("k", "000") if part != "dynamic" else default_budget)
        elif part in ("bf16", "compile", "eagerhead"):
            v[part] = True
        elif part == "noflash":
            v["varlen"] = False
        else:
            raise SystemExit(f"variant {name!r}: unknown part {part!r}")
    return v


def run_variant(path: str, device: str, batch: Any, args: argparse.Namespace, v: dict[str, Any]) -> dict[str, Any]:
    import torch

    from rlx.plugins.algorithms.grpo import GRPOLoss, GRPOOptions
    from rlx.plugins.modeling import packing
    from rlx.plugins.modeling.worker import TorchBackendOptions, TorchWorker
    from rlx.protocols import RoleSpec
    from rlx.records import ForwardOptions

    options: dict[str, Any] = {"use_remove_padding": v["packed"], "log_prob_chunk_size": v["chunk"],
                               "log_prob_micro_batch_size": args.log_prob_micro_rows,
                               "use_torch_compile": v["compile"]}
    if v["bf16"]:
        options["model_dtype"] = "bfloat16"
    if v["budget"]:
        options.update(use_dynamic_bsz=True, ppo_max_token_len=v["budget"],
                       ppo_max_token_len_option="--max-tokens", log_prob_max_token_len=v["budget"] * 2,
                       log_prob_max_token_len_option="--max-tokens")
    spec = RoleSpec(role="actor", model_path=path, trainable=True, dtype="auto", lr=1e-6,
                    micro_batch_size=args.micro_rows, gradient_checkpointing=args.gradient_checkpointing,
                    forward=ForwardOptions(**options))
    if device != "cpu":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    packing._VARLEN[:] = [] if v["varlen"] else [None, False]
    worker = TorchWorker(spec, TorchBackendOptions(attn_implementation=v["attn"]), device)
    if v["eagerhead"]:
        worker.compile_head = False
    compile_start = time.perf_counter()
    loss = GRPOLoss(GRPOOptions(use_kl_loss=False, entropy_coeff=0.0))
    worker.update([batch], loss)  # warm-up: allocator, kernels, flex compilation
    sync(device)
    warmup_s = time.perf_counter() - compile_start
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        worker.update([batch], loss)
    sync(device)
    update_s = (time.perf_counter() - start) / args.steps
    if args.profile and args.profile in (v["name"], "all"):
        profile_update(worker, batch, loss, device, f"{args.profile_dir}/{v['name'].replace('+', '_')}.txt")
    update_peak = torch.cuda.max_memory_allocated() / 2**30 if device != "cpu" else None
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    if v["compile"]:  # the no-grad graphs compile on their first call
        worker.compute_log_probs(batch, with_entropy=True)
        sync(device)
    start = time.perf_counter()
    worker.compute_log_probs(batch, with_entropy=True)
    sync(device)
    log_prob_s = time.perf_counter() - start
    log_prob_peak = torch.cuda.max_memory_allocated() / 2**30 if device != "cpu" else None
    del worker
    return {"update_s": update_s, "update_peak_gib": update_peak, "log_prob_s": log_prob_s,
            "log_prob_peak_gib": log_prob_peak, "warmup_s": warmup_s}


def equivalence() -> None:
    """Packed vs padded, chunked vs plain head, dynamic vs fixed micro-batches on the built-in tiny Qwen2 in
    float32 on the CPU: the largest differences (what docs/throughput.md quotes)."""
    import torch

    from rlx.plugins.algorithms.base import CriticLoss
    from rlx.plugins.algorithms.grpo import GRPOLoss, GRPOOptions
    from rlx.plugins.modeling.worker import TorchBackendOptions, TorchWorker
    from rlx.plugins.tasks import builtin
    from rlx.protocols import RoleSpec
    from rlx.records import ForwardOptions, LossContext

    torch.set_num_threads(1)
    path = builtin.resolve("builtin:tiny-qwen2")
    batch = make_batch(16, 12, 20, 64, seed=1)
    batch.tensors["values"] = torch.zeros_like(batch["old_log_probs"])
    batch.tensors["returns"] = torch.rand(16, 1) * batch["response_mask"]
    ctx = LossContext(float(batch["response_mask"].sum()), 16.0)
    mask = batch["response_mask"].bool()

    def worker(role: str = "actor", micro: int = 16, **options: Any) -> Any:
        spec = RoleSpec(role=role, model_path=path, trainable=True, value_head=role == "critic", lr=1e-3,
                        micro_batch_size=micro, forward=ForwardOptions(**options))
        return TorchWorker(spec, TorchBackendOptions(), "cpu")

    def grads(w: Any, loss_fn: Any) -> dict[str, Any]:
        loss, _ = loss_fn(w.forward(batch, grad=True), batch, ctx)
        loss.backward()
        return {n: p.grad for n, p in w.model.named_parameters()}

    def rel(a: dict[str, Any], b: dict[str, Any]) -> float:
        return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-30)) for k in b)

    actor_loss = GRPOLoss(GRPOOptions(use_kl_loss=False, entropy_coeff=0.01))
    base = {"use_remove_padding": False, "log_prob_chunk_size": 0}
    ref = worker(**base)
    want = ref.compute_log_probs(batch, with_entropy=True)
    want_grads = grads(ref, actor_loss)
    for name, options in (("packed", {"log_prob_chunk_size": 0}),
                        ("chunked head (16)", {**base, "log_prob_chunk_size": 16}),
                        ("packed + chunked head", {"log_prob_chunk_size": 16})):
        w = worker(**options)
        got = w.compute_log_probs(batch, with_entropy=True)
        diffs = {k: float((got[k] - want[k])[mask].abs().max()) for k in ("log_probs", "entropy")}
        print(f"{name:24} vs padded plain: log-probs {diffs['log_probs']:.1e}, entropy {diffs['entropy']:.1e}, "
              f"gradients {rel(grads(w, actor_loss), want_grads):.1e} of each tensor's largest entry")
    critics = [worker("critic", use_remove_padding=p) for p in (False, True)]
    values = [c.compute_values(batch)["values"] for c in critics]
    critic_grads = [grads(c, CriticLoss(0.2)) for c in critics]
    print(f"{'critic packed':24} vs padded: values {float((values[1] - values[0])[mask].abs().max()):.1e}, "
          f"gradients {rel(critic_grads[1], critic_grads[0]):.1e}")
    for packed in (False, True):
        fixed = worker(micro=16, use_remove_padding=packed)
        varied = worker(micro=1, use_remove_padding=packed, use_dynamic_bsz=True, ppo_max_token_len=64,
                        ppo_max_token_len_option="-", log_prob_max_token_len=64, log_prob_max_token_len_option="-")
        start = {k: v.clone() for k, v in fixed.model.state_dict().items()}
        m_fixed, m_dyn = fixed.train_step(batch, actor_loss), varied.train_step(batch, actor_loss)
        after = varied.model.state_dict()
        diff = max(float((after[k] - v).abs().max()) for k, v in fixed.model.state_dict().items())
        moved = max(float((v - start[k]).abs().max()) for k, v in fixed.model.state_dict().items())
        print(f"dynamic (64 tokens) vs one micro-batch, {'packed' if packed else 'padded'}: weights after one AdamW "
              f"step {diff:.1e} (the step moved them {moved:.1e}), grad norm "
              f"{abs(m_dyn['grad_norm'] / m_fixed['grad_norm'] - 1):.1e} relative")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: a tiny model and batch.")
    parser.add_argument("--sizes", default="0.5b,1.5b", help="Comma-separated: 0.5b, 1.5b.")
    parser.add_argument("--rows", type=int, default=64, help="Sequences per update (64 completions).")
    parser.add_argument("--prompt-len", type=int, default=256, help="Padded prompt width.")
    parser.add_argument("--response-len", type=int, default=256, help="Padded response width.")
    parser.add_argument("--micro-rows", type=int, default=16, help="Rows per micro-batch (fixed batches).")
    parser.add_argument("--log-prob-micro-rows", type=int, default=32, help="Rows per log-prob micro-batch.")
    parser.add_argument("--max-tokens", type=int, default=8192, help="Token budget of a dynamic micro-batch.")
    parser.add_argument("--steps", type=int, default=3, help="Timed updates per variant (after one warm-up).")
    parser.add_argument("--attn", default="sdpa", help="Comma-separated attention kernels for packed variants "
                        "(sdpa, flex_attention, flash_attention_2); padded variants use sdpa.")
    parser.add_argument("--chunk", type=int, default=1024, help="Positions per chunk of the chunked head.")
    parser.add_argument("--variants", default=None, help="Comma-separated variant names, e.g. "
                        "'packed+chunked+dyn24k+bf16+compile' (see parse_variant); default: padded and packed, "
                        "with and without the chunked head, and packed+chunked+dynamic per --attn kernel.")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--profile", default=None, help="Profile one more update of this variant (or 'all').")
    parser.add_argument("--profile-dir", default="outputs/actor_update_profiles")
    parser.add_argument("--json", default=None, help="Append one JSON line per variant to this file.")
    parser.add_argument("--equivalence", action="store_true", help="Print the CPU equivalences (packed vs "
                        "padded, chunked vs plain, dynamic vs fixed) on the built-in tiny model, and stop.")
    args = parser.parse_args()
    if args.equivalence:
        equivalence()
        return

    import torch

    if args.tiny:
        device, sizes = "cpu", ["tiny"]
        args.rows, args.prompt_len, args.response_len = 8, 16, 24
        args.micro_rows, args.log_prob_micro_rows, args.max_tokens, args.steps, args.chunk = 4, 8, 64, 1, 16
    else:
        if not torch.cuda.is_available():
            parser.error("no GPU: run with --tiny on a CPU")
        device, sizes = "cuda", args.sizes.split(",")
    peak = matmul_rate(device, torch.bfloat16 if device != "cpu" else torch.float32, 8192 if device != "cpu" else 512)
    print(f"device {torch.cuda.get_device_name() if device != 'cpu' else 'cpu'}, "
          f"{'bf16' if device != 'cpu' else 'fp32'} matmul rate {peak / 1e12:.3g} TFLOP/s")
    if args.variants:
        names = args.variants.split(",")
    else:
        names = ["padded", "padded+chunked"]
        for attn in args.attn.split(","):
            names += [f"packed[{attn}]", f"packed[{attn}]+chunked", f"packed[{attn}]+chunked+dynamic"]
    variants = [parse_variant(n, args.chunk, args.max_tokens) for n in names]
    header = f"{'size':5} {'variant':36} {'tok/s':>9} {'MFU':>6} {'update s':>9} {'peak GiB':>9} " \
             f"{'logprob s':>9} {'peak GiB':>9} {'warm-up s':>9}"
    print(header)
    for size in sizes:
        shape = SHAPES[size]
        with tempfile.TemporaryDirectory() as tmp:
            params = build_model(shape, Path(tmp))
            batch = make_batch(args.rows, args.prompt_len, args.response_len, shape["vocab_size"])
            tokens = int(batch["prompt_mask"].sum() + batch["response_mask"].sum())
            flops = model_flops(batch, params, shape)
            for v in variants:
                name = v["name"]
                try:
                    res = run_variant(tmp, device, batch, args, v)
                except torch.cuda.OutOfMemoryError:
                    print(f"{size:5} {name:36} out of memory")
                    continue
                row = {"size": size, "variant": name, "tokens": tokens, "rows": args.rows,
                       "tokens_per_s": tokens / res["update_s"], "mfu": flops / res["update_s"] / peak,
                       "matmul_tflops": peak / 1e12, **res}
                mem = f"{res['update_peak_gib']:9.2f}" if res["update_peak_gib"] is not None else f"{'-':>9}"
                lmem = f"{res['log_prob_peak_gib']:9.2f}" if res["log_prob_peak_gib"] is not None else f"{'-':>9}"
                print(f"{size:5} {name:36} {row['tokens_per_s']:9.0f} {row['mfu']:6.1%} {res['update_s']:9.3f} "
                      f"{mem} {res['log_prob_s']:9.3f} {lmem} {res['warmup_s']:9.1f}")
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
