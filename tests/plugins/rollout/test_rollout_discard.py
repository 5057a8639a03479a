"""``rollout.free_on_sleep=discard`` of the ``hf`` engine: sleep frees the parameters' memory, wake-up gives them
empty memory that the actor's weights fill, and generating before they are all loaded is refused. After the
reload the engine samples exactly as one that never slept (CPU, float32: bit-exact); tied embeddings stay tied;
the trainer reloads the weights whenever it wakes a sleeping engine, critic warm-up and validation included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoTokenizer

from rlx.batch import Batch
from rlx.plugins.rollout.hf import HFRollout, HFRolloutOptions
from rlx.protocols import SamplingParams
from rlx.registry import PluginManager
from rlx.run.data import PromptExample, collate
from rlx.trainer import Trainer
from rlx.validate import load_config

QUIET = ["trainer.loggers=[]", "trainer.save_hf_model=false", "trainer.log_samples=0"]
PARAMS = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=6)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """The tiny model on one thread."""


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def prompts(tok) -> Batch:
    examples = []
    for i, text in enumerate(["What is 3+4?", "hi", "What is 1+2+3?"]):
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False)
        examples.append(PromptExample(tok(chat, add_special_tokens=False)["input_ids"], chat, "s", str(i), {}))
    return collate(examples, tok.pad_token_id)


def engine(path: str, tok, free_on_sleep: bool | str = False) -> HFRollout:
    return HFRollout(path, HFRolloutOptions(free_on_sleep=free_on_sleep), "cpu", [tok.eos_token_id],
                     tok.pad_token_id)


def actor_weights(path: str) -> dict[str, torch.Tensor]:
    """Weights unlike the engine's initial ones (as after an update), every name the actor would send."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    return {k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def sample(e: HFRollout, prompts: Batch) -> Batch:
    torch.manual_seed(123)
    return e.generate(prompts, PARAMS)


def test_options_accept_true_as_offload_and_discard():
    assert HFRolloutOptions(free_on_sleep=True).free_on_sleep == "offload"
    assert HFRolloutOptions(free_on_sleep="discard").free_on_sleep == "discard"
    assert HFRolloutOptions().free_on_sleep is False
    with pytest.raises(ValidationError):
        HFRolloutOptions(free_on_sleep="drop")


def test_discard_frees_then_reloaded_engine_samples_as_one_that_never_slept(tiny_model_path, tok, prompts):
    weights = actor_weights(tiny_model_path)
    kept, slept = engine(tiny_model_path, tok), engine(tiny_model_path, tok, "discard")
    kept.update_weights(weights.items())
    slept.update_weights(weights.items())
    slept.sleep()
    assert all(p.numel() == 0 for p in slept.model.parameters()), "sleep kept parameter memory"
    assert all(b.numel() > 0 for b in slept.model.buffers()), "buffers (rotary tables) must stay"
    slept.wake_up()
    slept.update_weights(weights.items())
    want, got = sample(kept, prompts), sample(slept, prompts)
    assert torch.equal(got["responses"], want["responses"])
    assert torch.equal(got["rollout_log_probs"], want["rollout_log_probs"])
    for name, p in kept.model.state_dict().items():
        assert torch.equal(slept.model.state_dict()[name], p), name


def test_tied_embeddings_stay_tied(tiny_model_path, tok, prompts):
    e = engine(tiny_model_path, tok, "discard")
    assert e.model.config.tie_word_embeddings  # the built-in model ties lm_head to embed_tokens
    weights = actor_weights(tiny_model_path)
    e.sleep()
    e.wake_up()
    emb = e.model.get_input_embeddings().weight
    assert e.model.get_output_embeddings().weight is emb
    e.update_weights([(k, v) for k, v in weights.items() if k != "lm_head.weight"])  # one name loads both
    assert e.model.get_output_embeddings().weight is e.model.get_input_embeddings().weight
    assert torch.equal(e.model.get_output_embeddings().weight, weights["model.embed_tokens.weight"])
    sample(e, prompts)


def test_generate_before_every_parameter_is_loaded_again_names_the_missing_ones(tiny_model_path, tok, prompts):
    e = engine(tiny_model_path, tok, "discard")
    weights = actor_weights(tiny_model_path)
    e.sleep()
    with pytest.raises(RuntimeError, match="wake_up must come first"):
        e.update_weights(weights.items())
    e.wake_up()
    with pytest.raises(RuntimeError, match=r"free_on_sleep=discard\) and 26 parameter.*model\.embed_tokens\.weight"):
        sample(e, prompts)
    with pytest.raises(RuntimeError, match="did not receive"):
        e.update_weights([(k, v) for k, v in weights.items() if k != "model.norm.weight"])
    with pytest.raises(RuntimeError, match=r"1 parameter\(s\) were not loaded again.*model\.norm\.weight"):
        sample(e, prompts)
    e.update_weights(weights.items())
    sample(e, prompts)


def trainer(tmp_path: Path, *overrides: str) -> Trainer:
    pm = PluginManager()
    pm.load_entry_points(strict=True, disabled=[])
    resolved = load_config(pm, preset="tiny", overrides=[*QUIET, f"trainer.output_dir={tmp_path}", *overrides])
    return Trainer(resolved, pm)


def test_training_with_discard_matches_training_without(tmp_path):
    """Same seeds on the CPU: discarding and reloading the same weights changes nothing, step for step."""
    common = ["trainer.total_steps=3", "trainer.test_freq=-1", "trainer.save_freq=0"]
    a: list[dict[str, float]] = []
    b: list[dict[str, float]] = []
    for name, extra, out in (("off", [], a), ("on", ["rollout.free_on_sleep=discard"], b)):
        t = trainer(tmp_path / name, *common, *extra)  # seeds the global generator the sampler draws from
        t._log = lambda metrics, step, out=out: out.append(metrics)  # type: ignore[method-assign]
        t.fit()  # the whole loop, as `rlx train` runs it
    assert len(a) == len(b) == 3
    assert "timing/sleep" in b[0] and "timing/wake_up" in b[0]
    for x, y in zip(a, b):
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "response_length/mean"):
            assert x[key] == y[key], key


def test_a_woken_engine_is_reloaded_after_a_step_without_an_actor_update(tmp_path):
    """ppo with critic warm-up: step 1 trains the critic only, so no update reloads the engine before the
    validation and step 2 wake it up; both must find the actor's weights loaded."""
    t = trainer(tmp_path, "algorithm.name=ppo", "critic.warmup_steps=1", "trainer.total_steps=2",
                "trainer.test_freq=1", "trainer.save_freq=0", "trainer.val_before_train=false",
                "data.val_batch_size=8", "rollout.free_on_sleep=discard")
    t.val_set.examples = t.val_set.examples[:8]
    t.fit()
    assert t.step == 2
