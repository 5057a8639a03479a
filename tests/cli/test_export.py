"""The exported model: after a short run, ``<run>/hf_model`` loads with ``from_pretrained`` (model and
tokenizer) and holds the actor's final, trained weights, not the initial ones."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlx.registry import PluginManager
from rlx.trainer import Trainer
from rlx.validate import load_config


def test_hf_model_holds_the_trained_weights(tmp_path, tiny_model_path, one_thread):
    pm = PluginManager()
    pm.load_entry_points(strict=False, disabled=[])
    resolved = load_config(pm, preset="tiny", overrides=[
        "trainer.test_freq=-1", "trainer.loggers=[]", "trainer.log_samples=0", "trainer.save_freq=0",
        "trainer.save_hf_model=true", "trainer.total_steps=2", "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4", "rollout.n=2", f"trainer.output_dir={tmp_path / 'run'}"])
    t = Trainer(resolved, pm)
    t.fit()
    final = {k: v.detach().clone() for k, v in t.actor.workers[0].named_weights()}

    exported = AutoModelForCausalLM.from_pretrained(t.run_dir / "hf_model", dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).state_dict()
    state = exported.state_dict()
    assert state.keys() == final.keys()
    for name, tensor in final.items():
        assert torch.equal(state[name], tensor.float()), f"{name} is not the actor's final weight"
    assert any(not torch.equal(state[name], initial[name]) for name in state), "the export is the initial model"
    changed = sum(not torch.equal(state[n], initial[n]) for n in state)
    assert changed >= len(state) // 2, f"only {changed} of {len(state)} tensors were trained"

    tok = AutoTokenizer.from_pretrained(t.run_dir / "hf_model")
    assert tok.chat_template == t.tokenizer.chat_template and tok("1+2")["input_ids"]
    # The exported folder is a working policy: it generates from a prompt.
    ids = torch.tensor([tok("What is 1+2?")["input_ids"]])
    out = exported.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 2 or bool((out[0, ids.shape[1]:] == tok.eos_token_id).any())
    assert not (t.run_dir / ".tmp-hf_model").exists()


def test_export_of_a_model_folder_says_it_is_one_already(tmp_path):
    """`rlx export RUN/hf_model` (or a run that kept only hf_model): the folder is named as the model to use."""
    import pytest

    from rlx.cli.export import find_checkpoint
    from rlx.errors import UserError

    run = tmp_path / "run"
    (run / "hf_model").mkdir(parents=True)
    (run / "hf_model" / "config.json").write_text("{}")
    with pytest.raises(UserError, match="It is a Hugging Face model folder already"):
        find_checkpoint(run / "hf_model")
    with pytest.raises(UserError, match=f"Its final model is a Hugging Face folder already: {run / 'hf_model'}"):
        find_checkpoint(run)
    with pytest.raises(UserError) as info:
        find_checkpoint(tmp_path)
    assert str(info.value).startswith(f"{tmp_path} holds no complete checkpoint.\nGive a run folder")
