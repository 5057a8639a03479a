"""What the trainer hands to the pieces around the training step, in-process on the built-in tiny model:
validation's sampling parameters and data, the critic's own optimizer settings, the logged rows, the
written config and the lifecycle hooks' arguments. (Gaps found by scripts/mutation.py in trainer.py.)"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import yaml

from rlx import hookimpl
from rlx.plugins.loggers.jsonl import read_metrics
from rlx.registry import PluginManager
from rlx.trainer import Trainer
from rlx.validate import load_config

BASE = ["trainer.loggers=[jsonl]", "trainer.save_hf_model=false", "trainer.log_samples=0",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2"]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """The tiny model runs on one thread."""


def make_trainer(out: Path, *overrides: str, plugin: types.ModuleType | None = None) -> Trainer:
    pm = PluginManager()
    pm.load_entry_points(strict=False, disabled=[])
    if plugin is not None:
        pm.register(plugin, name=plugin.__name__)
    return Trainer(load_config(pm, preset="tiny", overrides=[*BASE, f"trainer.output_dir={out}", *overrides]), pm)


@pytest.mark.parametrize(("temperature", "greedy"), [(0.0, True), (0.7, False)])
def test_validation_samples_every_val_prompt_with_the_val_settings(tmp_path, temperature, greedy):
    t = make_trainer(tmp_path / "run", "rollout.val_n=3", f"rollout.val_temperature={temperature}",
                     "rollout.top_p=0.9", "rollout.top_k=7", "data.max_response_length=3", "data.val_batch_size=16")
    calls = []
    engine = t.rollout.workers[0]
    generate = engine.generate

    def recording(prompts, params):
        calls.append((len(prompts), params))
        return generate(prompts, params)

    engine.generate = recording
    metrics = t.validate()
    assert sum(n for n, _ in calls) == len(t.val_set.examples)
    assert max(n for n, _ in calls) == 16
    for _, p in calls:
        assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.greedy) == (3, temperature, 0.9, 7, 3, greedy)
    assert metrics and all(k.startswith("val/") for k in metrics)
    assert 0.0 <= metrics["val/reward/mean"] <= 1.0


def test_critic_gets_its_own_optimizer_settings(tmp_path, monkeypatch):
    from rlx.plugins.backends import torch_local

    specs = {}
    original = torch_local.TorchBackend.worker

    def worker(self, spec, rank=0, world_size=1):
        specs[spec.role] = spec
        return original(self, spec, rank, world_size)

    monkeypatch.setattr(torch_local.TorchBackend, "worker", worker)
    t = make_trainer(tmp_path / "run", "algorithm.name=ppo", "data.train_batch_size=8", "actor.ppo_mini_batch_size=2",
                 "critic.optim.lr=0.005", "critic.optim.weight_decay=0.25", "critic.optim.warmup_steps=3",
                 "critic.optim.lr_schedule=cosine", "critic.optim.grad_clip=0.5", "critic.optim.min_lr_ratio=0.1",
                 "critic.micro_batch_size_per_device=5", "critic.forward_micro_batch_size_per_device=6",
                 "critic.ppo_epochs=3", "trainer.total_steps=7")
    c, a = specs["critic"], specs["actor"]
    assert c.value_head and not a.value_head
    assert (c.lr, c.weight_decay, c.warmup_steps, c.lr_schedule, c.grad_clip) == (0.005, 0.25, 3, "cosine", 0.5)
    assert (c.micro_batch_size, c.forward.log_prob_micro_batch_size, c.min_lr_ratio) == (5, 6, 0.1)
    assert c.total_steps == 7 * 3 * (8 // 2) and a.total_steps == 7 * t.cfg.actor.ppo_epochs * (8 // 2)
    assert a.lr != c.lr and a.model_path == c.model_path


def test_role_spec_has_typed_fields_only():
    """What a backend gets for a role is typed (issue 26): no string-keyed ``extra`` dict comes back."""
    import dataclasses

    from rlx.protocols import RoleSpec
    from rlx.records import ForwardOptions, LoraSpec

    fields = {f.name: f.type for f in dataclasses.fields(RoleSpec)}
    # model.override_config's attributes are the Hugging Face config's own (config.json keys, set on it as they
    # are): the one mapping a spec carries, data for the model and no backend option
    free_form = {name for name, t in fields.items() if "dict" in str(t)}
    assert "extra" not in fields and free_form <= {"config_overrides"}, free_form
    spec = RoleSpec(role="actor", model_path="unused", trainable=True)
    assert spec.forward == ForwardOptions() and spec.lora is None and spec.min_lr_ratio == 0.0
    assert dataclasses.is_dataclass(LoraSpec) and LoraSpec.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert ForwardOptions.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_role_specs_carry_the_configs_forward_options(tmp_path, monkeypatch):
    """The trainer hands each backend a RoleSpec whose typed ``forward`` holds the role's section of the config
    (the reference the actor's)."""
    from rlx.plugins.backends import torch_local

    specs = {}
    original = torch_local.TorchBackend.worker

    def worker(self, spec, rank=0, world_size=1):
        specs[spec.role] = spec
        return original(self, spec, rank, world_size)

    monkeypatch.setattr(torch_local.TorchBackend, "worker", worker)
    make_trainer(tmp_path / "run", "algorithm.name=ppo", "algorithm.use_kl_loss=true", "data.max_prompt_length=64",
                 "data.max_response_length=59", "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=123",
                 "actor.log_prob_max_token_len_per_gpu=124", "actor.log_prob_chunk_size=7",
                 "actor.use_remove_padding=false", "actor.log_prob_micro_batch_size_per_device=3",
                 "actor.optim.min_lr_ratio=0.2", "critic.forward_max_token_len_per_gpu=456")
    a, r, c = specs["actor"].forward, specs["ref"].forward, specs["critic"].forward
    assert (a.use_dynamic_bsz, a.update_budget, a.forward_budget) == (
        True, (123, "actor.ppo_max_token_len_per_gpu"), (124, "actor.log_prob_max_token_len_per_gpu"))
    assert (a.log_prob_chunk_size, a.use_remove_padding, a.log_prob_micro_batch_size) == (7, False, 3)
    assert r == a and specs["actor"].min_lr_ratio == 0.2 and specs["actor"].lora is None
    assert (c.use_dynamic_bsz, c.use_remove_padding, c.log_prob_max_token_len) == (False, True, 456)
    assert c.log_prob_max_token_len_option == "critic.forward_max_token_len_per_gpu"


def test_logged_rows_config_file_and_hook_arguments(tmp_path):
    events = []

    def rlx_on_train_start(config, output_dir):
        events.append(("start", config["trainer"]["total_steps"], output_dir))

    def rlx_on_checkpoint(step, path):
        events.append(("checkpoint", step, Path(path).name))

    def rlx_on_step_end(step, metrics):
        events.append(("step", step, "reward/mean" in metrics))

    plugin = types.ModuleType("rlx_test_surface_hooks")
    for fn in (rlx_on_train_start, rlx_on_checkpoint, rlx_on_step_end):
        setattr(plugin, fn.__name__, hookimpl(fn))
    t = make_trainer(tmp_path / "run", "trainer.total_steps=2", "trainer.save_freq=1", "trainer.test_freq=2",
                     "trainer.val_before_train=true", "data.val_batch_size=64", plugin=plugin)
    t.fit()
    assert events == [("start", 2, str(t.run_dir)), ("step", 1, True), ("checkpoint", 1, "global_step_1"),
                      ("step", 2, True), ("checkpoint", 2, "global_step_2")]
    assert t.saved_step == 2
    rows = read_metrics(t.run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]  # validation before training, then each step
    assert "val/reward/mean" in rows[0] and "reward/mean" not in rows[0]
    assert "val/reward/mean" in rows[2] and "val/reward/mean" not in rows[1]
    written = yaml.safe_load((t.run_dir / "config.yaml").read_text())
    assert written == t.config_dict
    assert list(written) == list(t.config_dict), "config.yaml keeps the config's order"
