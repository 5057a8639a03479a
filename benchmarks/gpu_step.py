"""Throughput of GRPO steps on one GPU with the built-in engines (hf rollout, torch backend).

The model has Qwen2.5-0.5B's transformer shape (24 layers, hidden 896, 14 heads, 2 KV heads) with random
weights and the built-in 64-token tokenizer (no download): its responses rarely stop early, so every
response runs to the full length, which is what a throughput measurement wants.

    python benchmarks/gpu_step.py OUT_DIR [dotted overrides...]
    python benchmarks/gpu_step.py OUT_DIR --smoke   # CI: a 2-layer model of width 64 on the CPU, 2 small steps

``--smoke`` runs the same trainer with a tiny model (in OUT_DIR/smoke), 4 prompts x 2 samples of 8 tokens, in
float32 on the CPU; its times say nothing about the GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SHAPE = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
         "num_key_value_heads": 2}
SMOKE_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2}


def build_model(path: Path, shape: dict[str, int] = SHAPE) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlx.plugins.tasks.builtin import build_tokenizer

    tok = build_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), **shape, max_position_embeddings=4096,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, two small steps (CI)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides for the run")
    args = ap.parse_intermixed_args()
    from rlx.registry import get_plugin_manager
    from rlx.trainer import Trainer
    from rlx.validate import load_config

    out = args.out / "smoke" if args.smoke else args.out
    model = out / "model"
    build_model(model, SMOKE_SHAPE if args.smoke else SHAPE)
    if args.smoke:
        sizes = ["model.dtype=float32", "trainer.device=cpu", "backend.num_threads=2", "data.max_response_length=8",
                 "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=2",
                 "actor.micro_batch_size_per_device=2", "actor.log_prob_micro_batch_size_per_device=4",
                 "trainer.total_steps=2"]
    else:
        sizes = ["model.dtype=bfloat16", "trainer.device=cuda", "backend.num_threads=4", "data.max_response_length=256",
                 "data.train_batch_size=64", "rollout.n=8", "actor.ppo_mini_batch_size=32",
                 "actor.micro_batch_size_per_device=32", "actor.log_prob_micro_batch_size_per_device=128",
                 "trainer.total_steps=4"]
    overrides = [
        f"model.path={model}", *sizes, "rollout.micro_batch_size=512", "actor.optim.lr=1e-6",
        "trainer.test_freq=-1", "trainer.save_freq=0", "trainer.save_hf_model=false", "trainer.loggers=[jsonl]",
        f"trainer.output_dir={out / 'run'}", *args.overrides,
    ]
    pm = get_plugin_manager()
    start = time.perf_counter()
    Trainer(load_config(pm, preset="tiny", overrides=overrides), pm).fit()
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    keys = ["timing/step", "timing/gen", "timing/old_log_prob", "timing/ref", "timing/update_actor",
            "timing/weight_sync", "weight_sync/bytes", "timing/sleep", "timing/wake_up", "perf/tokens_per_second",
            "response_length/mean"]
    for r in rows:
        print(f"step {r['step']}: " + ", ".join(f"{k.split('/')[-1]} {r[k]:.3g}" for k in keys if k in r))
    steady = rows[1:] or rows
    mean = {k: sum(r[k] for r in steady) / len(steady) for k in keys if k in steady[0]}
    print("steady-state mean (steps 2+): " + json.dumps(mean))
    print(f"wall {time.perf_counter() - start:.1f} s")
    if args.smoke and [r["step"] for r in rows] != [1, 2]:
        sys.exit(f"smoke run failed: logged steps {[r['step'] for r in rows]}, not [1, 2]")


if __name__ == "__main__":
    main()
