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
