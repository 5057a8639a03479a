"""LoRA from a saved peft adapter (``model.lora_adapter_path``, verl's ``actor_rollout_ref.model.lora_adapter_path``):
the adapter's settings fill the unset ``model.lora_*`` options when training starts, its weights start the actor's
adapters (the first forward pass is the adapted model's), the reference stays the base, a run trains, checkpoints
and exports as any LoRA run, and conflicting settings, unsupported adapters and broken folders are user errors.

The adapter is written by peft itself from the built-in tiny model, with random A and B (a fresh adapter's B is
zero, which would not tell the start from a new one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_backend_torch import make_batch

from rlx.errors import ConfigError, UserError
from rlx.plugins.modeling.worker import TorchBackendOptions, TorchWorker
from rlx.protocols import RoleSpec
from rlx.records import ForwardOptions, LoraSpec

pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj", "down_proj"]
RUN = ["trainer.test_freq=-1", "trainer.loggers=[]", "trainer.save_hf_model=false", "trainer.log_samples=0",
       "data.train_batch_size=16", "actor.ppo_mini_batch_size=16", "actor.ppo_epochs=1"]


@pytest.fixture
def model_path(tiny_model_path, one_thread):
    return tiny_model_path


@pytest.fixture
def adapter(model_path, tmp_path) -> Path:
    """A peft adapter of the tiny model: rank 4, alpha 8, on TARGETS, random weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False, task_type="CAUSAL_LM")
    folder = tmp_path / "adapter"
    get_peft_model(model, config).save_pretrained(str(folder))
    return folder


def make(path: str, lora: LoraSpec | None) -> TorchWorker:
    spec = RoleSpec(role="actor", model_path=path, trainable=True, lr=1e-2, micro_batch_size=8, seed=0,
                    forward=ForwardOptions(use_remove_padding=False), lora=lora)
    return TorchWorker(spec, TorchBackendOptions(), "cpu")


def spec(adapter_path: str | None = None) -> LoraSpec:
    return LoraSpec(rank=4, alpha=8.0, target_modules=tuple(TARGETS), adapter_path=adapter_path)


def edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_first_forward_is_the_adapted_model(model_path, adapter):
    """The actor's first log-probs are those of the base with the saved adapter (peft's own loader into a fresh
    worker gives the same, exactly), not the base's; the reference is the base alone."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    batch = make_batch(5)
    started = make(model_path, spec(str(adapter)))
    got = started.compute_log_probs(batch)["log_probs"]
    by_peft = make(model_path, spec())
    set_peft_model_state_dict(by_peft.model, load_file(str(adapter / "adapter_model.safetensors")))
    torch.testing.assert_close(got, by_peft.compute_log_probs(batch)["log_probs"], atol=0, rtol=0)
    base = make(model_path, None).compute_log_probs(batch)["log_probs"]
    assert float((got - base).abs().max()) > 1e-3
    torch.testing.assert_close(started.compute_ref_log_probs(batch)["log_probs"], base, atol=0, rtol=0)


def test_weights_that_do_not_fit_are_user_errors(model_path, adapter):
    with pytest.raises(UserError, match="do not fit this model's adapters: no tensor for"):  # fewer targets
        make(model_path, LoraSpec(rank=4, alpha=8.0, target_modules=(*TARGETS, "k_proj"), adapter_path=str(adapter)))
    with pytest.raises(UserError, match="other shapes"):
        make(model_path, LoraSpec(rank=2, alpha=8.0, target_modules=tuple(TARGETS), adapter_path=str(adapter)))
    (adapter / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="cannot be read"):
        make(model_path, spec(str(adapter)))


def _resolved(*overrides: str) -> Any:
    from rlx.registry import PluginManager
    from rlx.validate import load_config

    pm = PluginManager()
    pm.load_entry_points(strict=True, disabled=[])
    return load_config(pm, preset="tiny", overrides=list(overrides))


def test_settings_come_from_the_adapter(adapter):
    from rlx.run.lora_adapter import with_adapter_settings

    resolved, folder = with_adapter_settings(_resolved(f"model.lora_adapter_path={adapter}"), None)
    m = resolved.config.model
    assert (m.lora_rank, m.lora_alpha, sorted(m.target_modules), m.lora_dropout) == (4, 8.0, sorted(TARGETS), 0.0)
    assert folder == str(adapter.resolve())
    # the same values given, and a dropout of the run's own, are no conflict
    resolved, _ = with_adapter_settings(_resolved(f"model.lora_adapter_path={adapter}", "model.lora_rank=4",
                                                  "model.lora_alpha=8", "model.lora_dropout=0.1",
                                                  "model.target_modules=[v_proj,q_proj,down_proj]"), None)
    assert resolved.config.model.lora_dropout == 0.1
    # a resumed run takes its record's settings and reads no folder
    resolved, folder = with_adapter_settings(_resolved("model.lora_adapter_path=/nowhere"),
                                             {"lora_rank": 4, "lora_alpha": 8.0, "target_modules": TARGETS})
    assert folder is None and resolved.config.model.lora_rank == 4
    assert with_adapter_settings(_resolved("model.lora_adapter_path="), None)[1] is None  # empty: no adapter


@pytest.mark.parametrize(("overrides", "change", "message"), [
    (["model.lora_rank=8"], {}, "model.lora_rank=8 differs from the adapter's r=4"),
    (["model.lora_alpha=32"], {}, "model.lora_alpha=32.0 differs from the adapter's lora_alpha=8.0"),
    (["model.target_modules=[q_proj]"], {}, "model.target_modules=\\['q_proj'\\] differs from the adapter's"),
    ([], {"use_dora": True}, "use_dora=True \\(DoRA"),
    ([], {"use_rslora": True}, "use_rslora=True \\(rsLoRA"),
    ([], {"bias": "all"}, "bias='all'"),
    ([], {"modules_to_save": ["lm_head"]}, "modules_to_save=\\['lm_head'\\]"),
    ([], {"r": 0}, "r=0 is not a rank"),
    ([], {"target_modules": ".*proj"}, "is a regular expression"),
])
def test_conflicts_and_unsupported_adapters(adapter, overrides, change, message):
    from rlx.run.lora_adapter import with_adapter_settings

    edit_config(adapter, **change)
    with pytest.raises(UserError, match=message) as err:
        with_adapter_settings(_resolved(f"model.lora_adapter_path={adapter}", *overrides), None)
    assert isinstance(err.value, ConfigError) == bool(overrides)


def test_broken_folders_are_user_errors(adapter, tmp_path):
    from rlx.run.lora_adapter import with_adapter_settings

    def refused(ref: Path | str, message: str) -> None:
        with pytest.raises(UserError, match=message):
            with_adapter_settings(_resolved(f"model.lora_adapter_path={ref}"), None)

    refused(tmp_path / "missing", "no such folder")
    refused(tmp_path, "holds no adapter_config.json")
    (adapter / "adapter_config.json").write_text("{r: 4")
    refused(adapter, "cannot be read as JSON")
    (adapter / "adapter_config.json").write_text("[4]")
    refused(adapter, "is not a JSON object")
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": TARGETS}))
    (adapter / "adapter_model.safetensors").unlink()
    refused(adapter, "holds no adapter_model.safetensors")


def test_another_base_model_is_a_warning(adapter):
    from rlx.run.lora_adapter import with_adapter_settings

    edit_config(adapter, base_model_name_or_path="Qwen/Qwen2.5-3B-Instruct")
    with pytest.warns(UserWarning, match="was trained on Qwen/Qwen2.5-3B-Instruct"):
        with_adapter_settings(_resolved(f"model.lora_adapter_path={adapter}"), None)


def _rlx(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "rlx", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=600)


def test_training_from_the_adapter(adapter, tmp_path, monkeypatch):
    """Two steps from the adapter: the KL to the reference is not zero on the first step (the reference is the
    base, the policy starts as base + adapter), the run's record holds the adapter's settings, and the exported
    merged model is neither the base nor base + the starting adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlx.plugins.backends import torch_local
    from rlx.plugins.tasks import builtin
    from rlx.registry import PluginManager
    from rlx.trainer import Trainer
    from rlx.validate import load_config

    roles: list[tuple[str, str | None]] = []
    original = torch_local.TorchBackend.worker

    def worker(self, spec, rank=0, world_size=1):
        roles.append((spec.role, spec.lora.adapter_path if spec.lora else None))
        return original(self, spec, rank, world_size)

    monkeypatch.setattr(torch_local.TorchBackend, "worker", worker)
    torch.set_num_threads(1)
    run = tmp_path / "run"
    pm = PluginManager()
    pm.load_entry_points(strict=True, disabled=[])
    resolved = load_config(pm, preset="tiny", overrides=[
        *RUN, f"model.lora_adapter_path={adapter}", "actor.optim.lr=0.01", "trainer.total_steps=2",
        "trainer.save_freq=2", f"trainer.output_dir={run}", "algorithm.use_kl_loss=true"])
    trainer = Trainer(resolved, pm)
    assert trainer.ref is None and roles == [("actor", str(adapter.resolve()))]
    first = trainer.train_step(trainer._next_examples())
    assert first["actor/kl_loss"] > 1e-4  # against the base, not against the starting adapter
    trainer.fit()
    import yaml

    record = yaml.safe_load(next(run.rglob("config.yaml")).read_text())["model"]
    assert (record["lora_rank"], record["lora_alpha"], record["lora_adapter_path"]) == (4, 8.0, str(adapter))

    merged = tmp_path / "merged"
    proc = _rlx("export", str(next(run.rglob("checkpoints")).parent), "--out", str(merged), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    base_path = builtin.resolve("builtin:tiny-qwen2")
    ids = torch.randint(3, 60, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(merged).eval()(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(base_path).eval()(input_ids=ids).logits
        start = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), adapter).eval()(
            input_ids=ids).logits
    assert float((exported - base).abs().max()) > 1e-3
    assert float((exported - start).abs().max()) > 1e-4  # it trained on from the adapter


def test_cli_conflict_is_exit_2(adapter, tmp_path):
    proc = _rlx("train", "--preset", "tiny", f"model.lora_adapter_path={adapter}", "model.lora_rank=8",
                "trainer.total_steps=1", f"trainer.output_dir={tmp_path / 'run'}", *RUN, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "model.lora_rank=8 differs from the adapter's r=4" in proc.stderr
