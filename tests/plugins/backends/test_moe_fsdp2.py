"""Mixture-of-experts models on the ``fsdp2`` backend: real GRPO runs of ``rlx train`` (CPU, float32).

verl's megatron MoE scripts translate onto rlx's fsdp2 backend (cli/from_verl.py), which trains the Hugging Face
model itself. Two tiny models are built from a config: Qwen3-MoE (4 experts, top-2, softmax router) and
DeepSeek-V3 (multi-head latent attention, a dense first layer, then 4 routed experts with sigmoid group routing
and a shared expert). Each trains 3 steps with the built-in ``hf`` engine sampling from it (Qwen3-MoE through
the engine's static-cache decoder, which steps transformers' own model code for a model outside its
Llama-family fast path; DeepSeek-V3 through the dynamic one), and the test checks that every loss is finite,
that every MoE layer's experts and router were trained, and that the engine sampled from the trained weights
(its log-probs equal the actor's to 1e-4: the weight sync reached every expert).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_trainer import rlx

pytestmark = pytest.mark.slow

STEPS = 3
# The engine and the actor compute the same float32 forward in other kernels (cached decode against one full
# pass): measured differences are about 1e-6; a sync that missed a weight after an update at lr 1e-2 shows
# differences of order 1e-2.
SYNC_ATOL = 1e-4


def _tiny(kind: str, path: Path) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rlx.plugins.tasks.builtin import build_tokenizer

    tok = build_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=256, num_experts_per_tok=2,
                  tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                  bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, num_key_value_heads=1, head_dim=32, num_experts=4,
                                                   decoder_sparse_step=1, norm_topk_prob=True))
    else:
        model = DeepseekV3ForCausalLM(DeepseekV3Config(
            **common, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1, n_group=2, topk_group=1,
            first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=16,
            v_head_dim=32))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    """The model's parameters as transformers loads them (its files keep one tensor per expert)."""
    from transformers import AutoModelForCausalLM

    return {k: v.detach() for k, v in AutoModelForCausalLM.from_pretrained(folder).state_dict().items()}


@pytest.mark.parametrize(("kind", "decoder", "moe_layers"), [("qwen3_moe", "static", (0, 1)),
                                                              ("deepseek_v3", "dynamic", (1,))])
def test_grpo_trains_the_experts_and_the_router_of_a_moe_model(tmp_path, kind, decoder, moe_layers):
    from transformers import AutoModelForCausalLM

    from rlx.plugins.loggers.jsonl import read_metrics
    from rlx.plugins.rollout.hf_static import supports_slots

    model = _tiny(kind, tmp_path / kind)
    assert supports_slots(AutoModelForCausalLM.from_pretrained(model)) is not None  # the engine's fallback
    run = tmp_path / "run"
    result = rlx("train", "--preset", "tiny", f"model.path={model}", "backend.name=fsdp2",
                 f"trainer.total_steps={STEPS}", "trainer.test_freq=-1", "trainer.val_before_train=false",
                 "trainer.loggers=[jsonl]", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4",
                 f"rollout.decoder={decoder}", "actor.optim.lr=0.01", "algorithm.entropy_coeff=0.01",
                 f"trainer.output_dir={run}", cwd=tmp_path, threads=1)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        for name in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert math.isfinite(row[name]), (name, row)
        assert row["actor/grad_norm"] > 0 and row["response_length/mean"] > 0
        assert row["rollout/logprob_diff_max"] < SYNC_ATOL, row["rollout/logprob_diff_max"]
    assert rows[-1]["actor/kl_loss"] > 0  # the policy left the reference
    assert (run / "samples.jsonl").stat().st_size > 0
    before, after = _weights(model), _weights(run / "hf_model")
    assert before.keys() == after.keys()
    for layer in moe_layers:
        mlp = f"model.layers.{layer}.mlp."
        for name in ("experts.gate_up_proj", "experts.down_proj", "gate.weight"):
            moved = (after[mlp + name] - before[mlp + name]).abs().amax(dim=-1)
            assert moved.amax() > 1e-4, (mlp + name, moved)
            if name.startswith("experts."):  # every expert was chosen by some token and trained
                assert bool((moved.amax(dim=-1) > 0).all()), (mlp + name, moved)
    if kind == "deepseek_v3":  # the shared expert and the latent attention train too
        for name in ("model.layers.1.mlp.shared_experts.down_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight"):
            assert (after[name] - before[name]).abs().max() > 1e-4, name
    assert json.loads((run / "hf_model" / "config.json").read_text())["model_type"] == kind
