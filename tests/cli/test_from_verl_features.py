"""`--from-verl` for the keys of four rlx features verl's scripts use: the model's config overrides, the chat
template's keyword arguments, LoRA from an existing adapter and PF-PPO. Each maps onto its rlx option and the
translation validates."""

from __future__ import annotations

import pytest

from rlx.cli.from_verl import translate
from rlx.errors import UserError
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


def test_pf_ppo_keys_with_gae_and_without():
    pf = {"algorithm.use_pf_ppo": True, "algorithm.pf_ppo.reweight_method": "max_random",
          "algorithm.pf_ppo.weight_pow": 3.0}
    t = translate({"algorithm.adv_estimator": "gae", **pf}, get_plugin_manager())
    assert (t.settings["algorithm.use_pf_ppo"], t.settings["algorithm.pf_ppo.reweight_method"],
            t.settings["algorithm.pf_ppo.weight_pow"]) == (True, "max_random", 3.0) and t.unmapped == []
    opts = validated(t).algorithm.options()
    assert opts["use_pf_ppo"] is True and opts["pf_ppo"] == {"reweight_method": "max_random", "weight_pow": 3.0}
    # verl resamples in its gae branch only: with grpo its use_pf_ppo changes nothing, and is left out
    grpo = translate({"algorithm.adv_estimator": "grpo", **pf}, get_plugin_manager())
    assert not any(k.startswith("algorithm.pf_ppo") or k == "algorithm.use_pf_ppo" for k in grpo.settings)
    assert "verl applies PF-PPO with adv_estimator=gae only" in dict(grpo.ignored)["algorithm.use_pf_ppo"]
    off = translate({"algorithm.adv_estimator": "gae", "algorithm.use_pf_ppo": False,
                     "algorithm.pf_ppo.weight_pow": 3.0})
    assert "algorithm.pf_ppo.weight_pow" not in off.settings and off.unmapped == []


def test_a_comment_after_a_continuation_backslash_is_named():
    script = ("python3 -m verl.trainer.main_ppo \\\n    algorithm.adv_estimator=gae \\\n"
              "    algorithm.use_pf_ppo=True \\  # on\n    actor_rollout_ref.model.path=m \\\n")
    with pytest.raises(UserError, match=r"argument that is only a space \(after algorithm\.use_pf_ppo\)"):
        translate(script)


def test_chat_template_kwargs():
    t = translate({"algorithm.adv_estimator": "grpo", "data.apply_chat_template_kwargs.reasoning_effort": "medium",
                   "data.apply_chat_template_kwargs.enable_thinking": False}, get_plugin_manager())
    assert t.unmapped == [] and t.settings["data.apply_chat_template_kwargs.reasoning_effort"] == "medium"
    assert validated(t).data.apply_chat_template_kwargs == {"reasoning_effort": "medium", "enable_thinking": False}
    empty = translate({"algorithm.adv_estimator": "grpo", "data.apply_chat_template_kwargs": {}})
    assert empty.unmapped == [] and "data.apply_chat_template_kwargs" in dict(empty.ignored)
    # an argument rlx sets itself passes the translation and is the config's error, naming it
    bad = translate({"algorithm.adv_estimator": "grpo", "data.apply_chat_template_kwargs.tokenize": True})
    with pytest.raises(UserError, match="tokenize is set by rlx"):
        validated(bad)
