"""How the trainer serves the algorithms, in-process on the built-in tiny model: which roles are built
(no reference model without a KL term, a critic only for values), critic warm-up, dynamic sampling,
the ReMax greedy baseline, a third-party estimator end to end, and checkpoints of the critic and of
an adaptive KL coefficient."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from rlx import Component, hookimpl
from rlx.protocols import (
    EstimatorInputs,
    RewardBatch,
    RewardOutput,
    RewardScorer,
    RolloutEngine,
    advantage_estimator,
)
from rlx.registry import PluginManager
from rlx.trainer import Timer, Trainer
from rlx.validate import load_config

QUIET = ["trainer.test_freq=-1", "trainer.loggers=[]", "trainer.save_hf_model=false", "trainer.log_samples=0"]


def plugin_manager(*plugins: types.ModuleType) -> PluginManager:
    pm = PluginManager()
    pm.load_entry_points(strict=True, disabled=[])
    for p in plugins:
        pm.register(p, name=p.__name__)
    return pm


def trainer(tmp_path: Path, *overrides: str, pm: PluginManager | None = None) -> Trainer:
    pm = pm or plugin_manager()
    resolved = load_config(pm, preset="tiny", overrides=[*QUIET, f"trainer.output_dir={tmp_path / 'run'}",
                                                         *overrides])
    return Trainer(resolved, pm)


def weights(group) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in group.workers[0].model.state_dict().items()}


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(before[k], after[k]) for k in before)


@pytest.fixture
def built_roles(monkeypatch) -> list[str]:
    """The roles the torch backend is asked to build."""
    from rlx.plugins.backends import torch_local

    roles: list[str] = []
    original = torch_local.TorchBackend.worker

    def worker(self, spec, rank=0, world_size=1):
        roles.append(spec.role + ("+value_head" if spec.value_head else ""))
        return original(self, spec, rank, world_size)

    monkeypatch.setattr(torch_local.TorchBackend, "worker", worker)
    return roles


@pytest.mark.parametrize(("args", "roles"), [
    (["--algorithm=grpo"], ["actor", "ref"]),
    (["algorithm.use_kl_loss=false"], ["actor"]),
    (["algorithm.name=dapo", "algorithm.use_kl_loss=false"], ["actor"]),  # the tiny preset turns the KL loss on
    (["algorithm.name=ppo", "algorithm.use_kl_loss=false"], ["actor", "critic+value_head"]),
    (["algorithm.name=ppo", "algorithm.use_kl_in_reward=true"], ["actor", "ref", "critic+value_head"]),
])
def test_only_the_roles_the_algorithm_needs_are_built(tmp_path, built_roles, args, roles):
    overrides = [a.replace("--algorithm=", "algorithm.name=") for a in args]
    t = trainer(tmp_path, *overrides)
    assert built_roles == roles
    assert (t.ref is None) == ("ref" not in roles)
    assert (t.critic is None) == ("critic+value_head" not in roles)


def test_ppo_critic_warmup_and_metrics(tmp_path):
    """During critic.warmup_steps only the critic trains; then both do. Every PPO metric is reported."""
    t = trainer(tmp_path, "algorithm.name=ppo", "critic.warmup_steps=1", "data.train_batch_size=4",
                "actor.ppo_mini_batch_size=2", "rollout.n=4")
    actor0, critic0 = weights(t.actor), weights(t.critic)
    t.step = 1
    m1 = t.train_step(t._next_examples())
    actor1, critic1 = weights(t.actor), weights(t.critic)
    assert not changed(actor0, actor1) and changed(critic0, critic1)
    assert "actor/pg_loss" not in m1 and "critic/vf_loss" in m1
    t.step = 2
    m2 = t.train_step(t._next_examples())
    assert changed(actor1, weights(t.actor)) and changed(critic1, weights(t.critic))
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr",
                "critic/values/mean", "critic/values/max", "critic/values/min", "critic/returns/mean",
                "critic/advantages/mean", "critic/vf_explained_var", "actor/pg_loss", "actor/pg_clipfrac_low",
                "actor/pg_clipfrac_high", "actor/ppo_kl", "actor/entropy", "timing/values", "timing/update_critic"):
        assert key in m2, key
    assert m2["critic/lr"] == pytest.approx(0.003)  # the critic's own optimizer (tiny preset)
    assert m2["actor/lr"] == pytest.approx(0.001)


# ---------------------------------------------------------------------------------------------
# Dynamic sampling, with a reward that makes some prompts' groups all-equal and others mixed
def _parity_reward(options, ctx):
    def fn(batch: RewardBatch) -> RewardOutput:
        # prompts whose first addend is even: every sample 0.5; odd: alternating 0 / 1 (mixed)
        return RewardOutput([0.5 if e["a"] % 2 == 0 else float(i % 2) for i, e in enumerate(batch.extra_infos)])

    return fn


def _constant_reward(options, ctx):
    return lambda batch: [1.0] * len(batch)


REWARDS = types.ModuleType("test_rewards")
REWARDS.rlx_rewards = hookimpl(lambda: [Component(kind="reward", name="parity", factory=_parity_reward),
                                        Component(kind="reward", name="constant", factory=_constant_reward)])


def test_dynamic_sampling_keeps_only_mixed_groups_and_counts_generations(tmp_path):
    t = trainer(tmp_path, "algorithm.name=dapo", "reward.name=parity", "data.train_batch_size=8",
                "actor.ppo_mini_batch_size=8", "rollout.n=2", "algorithm.max_num_gen_batches=0",
                "algorithm.overlong_buffer_len=0",  # filtering looks at shaped scores; keep them raw here
                pm=plugin_manager(REWARDS))
    order = t.loader._order(0)
    batch, metrics = t._rollout(t._next_examples(), Timer())
    gen_batches = int(metrics["rollout/num_gen_batches"])
    assert t.loader.index == gen_batches >= 2  # more prompt batches were drawn from the loader
    drawn = [t.train_set.examples[i] for i in order[:8 * gen_batches]]
    odd = [e for e in drawn if e.extra_info["a"] % 2]
    assert metrics["rollout/filtered_group_ratio"] == pytest.approx(1 - len(odd) / len(drawn))
    assert metrics["rollout/kept_groups"] == 8
    assert len(batch) == 8 * 2  # exactly train_batch_size prompts' groups
    assert all(e["a"] % 2 for e in batch["extra_info"])
    assert [e["index"] for e in batch["extra_info"][::2]] == [e.extra_info["index"] for e in odd[:8]]
    assert batch["group_index"].unique().numel() == 8
    assert batch["responses"].shape[1] == batch["response_mask"].shape[1]


def test_dynamic_sampling_limit(tmp_path):
    """Nothing to keep within max_num_gen_batches: the step says so and skips the update."""
    t = trainer(tmp_path, "algorithm.name=dapo", "reward.name=constant", "algorithm.max_num_gen_batches=2",
                "algorithm.overlong_buffer_len=0",
                pm=plugin_manager(REWARDS))
    before = weights(t.actor)
    t.step = 1
    with pytest.warns(RuntimeWarning, match=r"dynamic sampling kept 0 of 64 .* in 2 generation batches"):
        m = t.train_step(t._next_examples())
    assert m["rollout/num_gen_batches"] == 2 and m["rollout/filtered_group_ratio"] == 1.0
    assert not changed(before, weights(t.actor))


def test_remax_greedy_baseline(tmp_path):
    """remax: one greedy response per prompt, scored; its score is every sample's baseline. (The tiny preset
    turns the reward's KL penalty off; remax's own default, on, is what this run checks.)"""
    t = trainer(tmp_path, "algorithm.name=remax", "algorithm.use_kl_in_reward=true", "data.train_batch_size=4",
                "actor.ppo_mini_batch_size=4")
    assert t.greedy_sampling.greedy and t.greedy_sampling.n == 1
    examples = t._next_examples()
    batch = t._generate_scored(examples, Timer())
    from rlx.run.data import collate

    greedy = t.rollout.call(RolloutEngine.generate, collate(examples, t.tokenizer.pad_token_id), t.greedy_sampling)
    want = t.reward.call(RewardScorer.score, greedy)["scores"]
    assert torch.equal(batch["baseline_scores"], want.repeat_interleave(t.sampling.n))
    assert len(batch) == 4 * t.sampling.n
    t.step = 1
    metrics = t.train_step(examples)
    assert "timing/gen_baseline" in metrics and "actor/reward_kl_coef" in metrics


# ---------------------------------------------------------------------------------------------
def test_third_party_estimator_end_to_end(tmp_path):
    """An estimator registered by a plugin is picked with algorithm.adv_estimator=NAME and trains."""
    calls: list[EstimatorInputs] = []

    @advantage_estimator()
    def above_mean(inputs: EstimatorInputs):
        calls.append(inputs)
        adv = (inputs.scores - inputs.scores.mean())[:, None] * inputs.response_mask
        return adv, adv

    plugin = types.ModuleType("rlx_test_estimator")
    plugin.rlx_advantage_estimators = hookimpl(lambda: [Component(kind="advantage", name="above_mean",
                                                                  factory=above_mean)])
    t = trainer(tmp_path, "algorithm.adv_estimator=above_mean", "trainer.total_steps=2", "trainer.save_freq=0",
                pm=plugin_manager(plugin))
    before = weights(t.actor)
    metrics = t.fit()
    assert len(calls) == 2 and calls[0].group_index.numel() == 64 * 8
    assert changed(before, weights(t.actor))
    assert metrics["critic/advantages/max"] > 0


def test_checkpoint_restores_critic_and_adaptive_kl(tmp_path):
    args = ["algorithm.name=ppo", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
            "algorithm.kl_ctrl.horizon=100", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
            "rollout.n=2", "trainer.total_steps=2"]
    t = trainer(tmp_path, *args)
    start = t.algorithm.kl_ctrl.value
    t.fit()
    coef = t.algorithm.kl_ctrl.value
    assert coef != pytest.approx(start)  # the controller moved it
    critic = weights(t.critic)
    saved = t.ckpt_root / "global_step_2"
    assert (saved / "critic" / "model.safetensors").is_file()
    again = trainer(tmp_path, *args)
    assert changed(critic, weights(again.critic))  # a fresh value head
    again._load(saved)
    assert not changed(critic, weights(again.critic))
    assert again.algorithm.kl_ctrl.value == coef and again.step == 2


@pytest.mark.slow
def test_ppo_with_adaptive_kl_resumes_exactly(tmp_path):
    """Stopping a PPO run (critic, adaptive KL in the reward) after 2 steps and resuming to 4 gives the
    same steps 3-4 as one run of 4 steps: the critic, its optimizer and the KL coefficient come back."""
    import json
    import os
    import subprocess
    import sys

    args = ["--preset", "tiny", "--algorithm", "ppo", "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=50", "algorithm.kl_ctrl.target_kl=0.001",
            "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4", *QUIET]
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def train(out: Path, *extra: str) -> list[dict]:
        res = subprocess.run([sys.executable, "-m", "rlx", "train", *args, f"trainer.output_dir={out}", *extra],
                             cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
        assert res.returncode == 0, res.stderr[-2000:]
        return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] if (
            out / "metrics.jsonl").exists() else []

    args[args.index("trainer.loggers=[]")] = "trainer.loggers=[jsonl]"
    straight = train(tmp_path / "a", "trainer.total_steps=4")
    train(tmp_path / "b", "trainer.total_steps=2")
    resumed = train(tmp_path / "b", "trainer.total_steps=4")
    a, b = {r["step"]: r for r in straight}, {r["step"]: r for r in resumed}
    assert sorted(b) == [1, 2, 3, 4]
    assert a[3]["actor/reward_kl_coef"] != a[1]["actor/reward_kl_coef"]  # the controller moved beta
    for step in (3, 4):
        for key in ("reward/mean", "actor/reward_kl_coef", "critic/vf_loss", "critic/values/mean", "actor/pg_loss",
                    "critic/grad_norm"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-7), (step, key)
