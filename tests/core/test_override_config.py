"""``model.override_config``: attributes set on the model's Hugging Face config wherever the model is loaded
(the policy, the reference, the critic, the hf rollout engine; vLLM and SGLang get them as their own
arguments), and an attribute the config lacks is a config error naming it, before any model loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_trainer_surface import make_trainer

from rlx.config import validate
from rlx.errors import ConfigError
from rlx.run.models import apply_config_overrides, config_override_problems


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """The tiny model runs on one thread."""


def qwen2_config(**kw):
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=64, **kw)


def test_overrides_set_attributes_and_sub_configs():
    from transformers import Qwen2VLConfig

    config = apply_config_overrides(qwen2_config(), {"max_position_embeddings": 32768, "rms_norm_eps": 1e-5})
    assert (config.max_position_embeddings, config.rms_norm_eps) == (32768, 1e-5)
    # a mapping for an attribute holding a mapping replaces it whole
    config = apply_config_overrides(config, {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}})
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 5000.0}
    # a mapping for a sub-config sets that sub-config's attributes, leaving the others
    vl = Qwen2VLConfig()
    layers = vl.vision_config.depth
    apply_config_overrides(vl, {"text_config": {"max_position_embeddings": 4096}})
    assert vl.text_config.max_position_embeddings == 4096 and vl.vision_config.depth == layers


def test_an_attribute_the_config_lacks_is_named():
    with pytest.raises(ConfigError) as info:
        apply_config_overrides(qwen2_config(), {"max_position_embedding": 1, "vocab_size": 64})
    text = str(info.value)
    assert "model.override_config.max_position_embedding: the model's config (Qwen2Config) has no attribute" in text
    assert "Did you mean 'max_position_embeddings'?" in text and "vocab_size" not in text.split("\n")[1]
    from transformers import Qwen2VLConfig

    assert config_override_problems(Qwen2VLConfig(), {"text_config": {"nope": 1}}) == [
        "model.override_config.text_config.nope: the model's config (Qwen2VLTextConfig) has no attribute 'nope'."]


def test_keys_must_be_attribute_names():
    with pytest.raises(ConfigError, match=r"model\.override_config: the key a-b is not an attribute name"):
        validate({"model": {"override_config": {"a-b": 1}}})
    with pytest.raises(ConfigError, match=r"the key text_config\.1x is not an attribute name"):
        validate({"model": {"override_config": {"text_config": {"1x": 1}}}})
    assert validate({"model": {"override_config": {"max_position_embeddings": 8}}}).model.override_config == {
        "max_position_embeddings": 8}


def test_the_trainer_loads_every_model_with_the_overrides(tmp_path, monkeypatch):
    """The actor, the reference, the critic and the hf rollout engine all build their model from the overridden
    config (a config attribute the tiny model does not read, so the run is the same)."""
    trainer = make_trainer(tmp_path / "run", "algorithm.name=ppo", "algorithm.use_kl_loss=true",
                           "model.override_config.max_position_embeddings=1234",
                           "model.override_config.initializer_range=0.5")
    roles = {"actor": trainer.actor, "ref": trainer.ref, "critic": trainer.critic, "rollout": trainer.rollout}
    for role, group in roles.items():
        worker = group.workers[0]
        config = worker.model.config
        assert (config.max_position_embeddings, config.initializer_range) == (1234, 0.5), role
    assert trainer.actor.workers[0].spec.config_overrides == {"max_position_embeddings": 1234,
                                                              "initializer_range": 0.5}


def test_an_unknown_attribute_stops_the_run_before_it_starts(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rlx", "train", "--preset", "tiny",
                           f"trainer.output_dir={out}", "model.override_config.max_position_embedding=32768"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "model.override_config.max_position_embedding: the model's config (Qwen2Config) has no attribute" \
        in proc.stderr and "Did you mean 'max_position_embeddings'?" in proc.stderr
    assert "Traceback" not in proc.stderr and not Path(out).exists()


def test_vllm_and_sglang_get_the_overrides_as_their_own_arguments(tmp_path):
    from rlx.plugins.rollout import sglang, vllm
    from rlx.plugins.rollout.sglang import SGLangRolloutOptions
    from rlx.plugins.rollout.vllm import VLLMRolloutOptions

    trainer_cfg = validate({"model": {"override_config": {"max_position_embeddings": 99}}})

    class Tok:
        eos_token_id, pad_token_id = 1, 0

    from rlx.context import BuildContext
    from rlx.protocols import RunInfo

    ctx = BuildContext(trainer_cfg, RunInfo(str(tmp_path), "p", "e", {}), None, Tok())
    assert vllm.engine_arguments(VLLMRolloutOptions(), ctx)["config_overrides"] == {"max_position_embeddings": 99}
    assert sglang.engine_arguments(SGLangRolloutOptions(), ctx)["config_overrides"] == {"max_position_embeddings": 99}
