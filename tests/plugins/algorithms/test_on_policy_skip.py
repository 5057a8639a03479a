"""``actor.recompute_old_log_prob``: with one epoch of one mini-batch the old-log-prob pass is skipped and the
loss takes the update forward's log-probs, detached, as the old ones. On the CPU in float32, with the log-prob
pass cut into the same micro-batches as the update, the two paths are bit-exact: same losses, gradient norms,
TIS weights and updated weights, step after step. Every case that is not provably on-policy keeps the pass, and
``false`` there is a config error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlx.errors import ConfigError
from rlx.registry import PluginManager
from rlx.trainer import Trainer
from rlx.validate import load_config

QUIET = ["trainer.test_freq=-1", "trainer.loggers=[]", "trainer.save_hf_model=false", "trainer.log_samples=0",
         "trainer.save_freq=0"]
# One epoch of one mini-batch; the log-prob pass in the update's micro-batches, so that on the CPU both
# forward passes sum in the same order.
ON_POLICY = ["actor.ppo_epochs=1", "actor.ppo_mini_batch_size=16", "data.train_batch_size=16",
             "actor.micro_batch_size_per_device=64", "actor.log_prob_micro_batch_size_per_device=64"]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """The tiny model on one thread."""


def trainer(tmp_path: Path, *overrides: str) -> Trainer:
    pm = PluginManager()
    pm.load_entry_points(strict=True, disabled=[])
    resolved = load_config(pm, preset="tiny", overrides=[*QUIET, f"trainer.output_dir={tmp_path}", *overrides])
    return Trainer(resolved, pm)


def run_steps(t: Trainer, steps: int) -> list[dict[str, float]]:
    t.launcher.transfer_weights(t.actor, t.rollout)
    out = []
    for _ in range(steps):
        t.step += 1
        out.append(t.train_step(t._next_examples()))
    return out


def test_skipped_and_computed_old_log_probs_train_the_same(tmp_path):
    runs = {}
    for setting in ("true", "auto"):
        # Built right before its steps: the constructor seeds the generator the sampler draws from.
        t = trainer(tmp_path / setting, *ON_POLICY, "algorithm.tis_cap=2.0", f"actor.recompute_old_log_prob={setting}")
        runs[setting] = (run_steps(t, 3), {k: v.clone() for k, v in t.actor.workers[0].model.state_dict().items()})
    (computed, w_computed), (skipped, w_skipped) = runs["true"], runs["auto"]
    for a, b in zip(computed, skipped):
        assert "timing/old_log_prob" in a and "timing/old_log_prob" not in b
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy",
                    "actor/tis_weight_mean", "actor/tis_clipfrac", "actor/pg_clipfrac", "actor/ppo_kl"):
            assert a[key] == b[key], (key, a[key], b[key])
        # The update averages the skipped path's mean over micro-batches' tokens: equal up to rounding.
        assert b["rollout/logprob_diff_mean"] == pytest.approx(a["rollout/logprob_diff_mean"], rel=1e-5, abs=1e-9)
        assert "rollout/logprob_diff_max" in a and "rollout/logprob_diff_max" not in b
    assert computed[-1]["actor/grad_norm"] > 0
    for name, w in w_computed.items():
        assert torch.equal(w, w_skipped[name]), name


@pytest.mark.parametrize("extra", [
    ["actor.ppo_epochs=2"],  # a second epoch runs the updated policy
    ["actor.ppo_mini_batch_size=8"],  # two optimizer steps per rollout batch
    ["algorithm.use_kl_in_reward=true"],  # the reward penalty reads them before the advantages
    ["actor.recompute_old_log_prob=true"],
])
def test_the_pass_runs_unless_the_update_is_on_policy(tmp_path, extra):
    t = trainer(tmp_path, *ON_POLICY, *extra)
    (m,) = run_steps(t, 1)
    assert m["timing/old_log_prob"] > 0
    assert "rollout/logprob_diff_max" in m


@pytest.mark.parametrize("extra", [
    [],
    ["algorithm.name=dapo"],  # dynamic sampling: every kept group comes from the same weights
    ["algorithm.name=ppo"],  # the critic reads no old log-probs
])
def test_the_pass_is_skipped_when_on_policy(tmp_path, extra):
    t = trainer(tmp_path, *ON_POLICY, *extra)
    (m,) = run_steps(t, 1)
    assert "timing/old_log_prob" not in m and m["actor/grad_norm"] > 0


@pytest.mark.parametrize("extra, why", [
    (["actor.ppo_epochs=2"], "actor.ppo_epochs=2"),
    (["actor.ppo_mini_batch_size=8"], "actor.ppo_mini_batch_size=8 cuts"),
    (["algorithm.use_kl_in_reward=true"], "use_kl_in_reward"),
])
def test_false_where_the_update_is_off_policy_is_a_config_error(tmp_path, extra, why):
    with pytest.raises(ConfigError, match=why) as info:
        trainer(tmp_path, *ON_POLICY, *extra, "actor.recompute_old_log_prob=false")
    assert "recompute_old_log_prob=false" in str(info.value)
