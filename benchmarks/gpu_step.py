"""Throughput of GRPO steps on one GPU with the built-in engines (hf rollout, torch backend).

The model has Qwen2.5-0.5B's transformer shape (24 layers, hidden 896, 14 heads, 2 KV heads) with random
weights and the built-in 64-token tokenizer (no download): its responses rarely stop early, so every
response runs to the full length, which is what a throughput measurement wants.

    python benchmarks/gpu_step.py OUT_DIR [dotted overrides...]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def build_model(path: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlx.plugins.tasks.builtin import build_tokenizer

    tok = build_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)


def main() -> None:
    from rlx.registry import get_plugin_manager
    from rlx.trainer import Trainer
    from rlx.validate import load_config

    out = Path(sys.argv[1])
    model = out / "model"
    build_model(model)
    overrides = [
        f"model.path={model}", "model.dtype=bfloat16", "trainer.device=cuda", "backend.num_threads=4",
        "data.max_response_length=256", "data.train_batch_size=64", "rollout.n=8",
        "rollout.micro_batch_size=512", "actor.ppo_mini_batch_size=32", "actor.micro_batch_size_per_device=32",
        "actor.log_prob_micro_batch_size_per_device=128", "actor.optim.lr=1e-6", "trainer.total_steps=4",
        "trainer.test_freq=-1", "trainer.save_freq=0", "trainer.save_hf_model=false", "trainer.loggers=[jsonl]",
        f"trainer.output_dir={out / 'run'}", *sys.argv[2:],
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


if __name__ == "__main__":
    main()
