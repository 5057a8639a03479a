"""`--from-verl` for the keys of four rlx features verl's scripts use: the model's config overrides, the chat
template's keyword arguments, LoRA from an existing adapter and PF-PPO. Each maps onto its rlx option and the
translation validates."""

from __future__ import annotations

from rlx.cli.from_verl import translate
from rlx.registry import get_plugin_manager
from rlx.validate import load_config

MODEL = "actor_rollout_ref.model."


def validated(t):
    pm = get_plugin_manager()
    return load_config(pm, overrides=["model.path=Qwen/Qwen2.5-0.5B-Instruct", *t.overrides()],
                       check_files=False).config


def test_override_config_both_forms():
    t = translate({"algorithm.adv_estimator": "grpo", MODEL + "override_config.max_position_embeddings": 32768,
                   MODEL + "override_config.model_config.rope_theta": 1e6,
                   MODEL + "override_config.attn_implementation": "flash_attention_2"}, get_plugin_manager())
    assert t.settings["model.override_config.max_position_embeddings"] == 32768
    assert t.settings["model.override_config.rope_theta"] == 1e6
    assert t.unmapped == [] and MODEL + "override_config.attn_implementation" in dict(t.ignored)
    assert validated(t).model.override_config == {"max_position_embeddings": 32768, "rope_theta": 1e6}
    empty = translate({"algorithm.adv_estimator": "grpo", MODEL + "override_config": {}})
    assert empty.unmapped == [] and MODEL + "override_config" in dict(empty.ignored)
