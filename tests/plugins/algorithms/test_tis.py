"""Truncated importance sampling (``algorithm.tis_cap``) and the rollout/training log-prob mismatch metric,
worked by hand on small ragged batches with garbage at padding."""

from __future__ import annotations

import math

import pytest
import torch

from rlx.batch import Batch
from rlx.context import BuildContext
from rlx.errors import UserError
from rlx.plugins.algorithms import functional as F
from rlx.plugins.algorithms.base import ActorLoss, AlgorithmOptions
from rlx.protocols import RunInfo
from rlx.records import LossContext
from rlx.registry import PluginManager

G = 1e6  # garbage in padded positions


def t(data) -> torch.Tensor:
    return torch.tensor(data, dtype=torch.float32)


MASK = t([[1, 1, 0], [1, 0, 0]])
OLD = t([[-1.0, -2.0, G], [-0.5, G, G]])
ROLLOUT = t([[-1.5, -1.0, -G], [-0.5, G, G]])  # ratios exp(0.5) = 1.649, exp(-1) = 0.368, exp(0) = 1
ADV = t([[1.0, 2.0, G], [-3.0, G, G]])


def test_tis_weights_are_the_capped_ratio_of_trainer_to_rollout_probabilities():
    w, m = F.tis_weights(OLD, ROLLOUT, MASK, cap=1.5)
    want = t([[1.5, math.exp(-1.0), 0.0], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(w, want)
    assert m["tis_weight_mean"] == pytest.approx((1.5 + math.exp(-1.0) + 1.0) / 3, rel=1e-6)
    assert m["tis_clipfrac"] == pytest.approx(1 / 3)
    uncapped, m = F.tis_weights(OLD, ROLLOUT, MASK, cap=10.0)
    assert float(uncapped[0, 0]) == pytest.approx(math.exp(0.5), rel=1e-6)
    assert m["tis_clipfrac"] == 0.0
    with pytest.raises(ValueError, match="positive"):
        F.tis_weights(OLD, ROLLOUT, MASK, cap=0.0)


def test_tis_weights_carry_no_gradient():
    old = OLD.clone().requires_grad_(True)
    w, _ = F.tis_weights(old, ROLLOUT, MASK, cap=2.0)
    assert not w.requires_grad


@pytest.mark.parametrize("loss_name", ["vanilla", "gspo"])
def test_token_weights_scale_each_tokens_loss_and_gradient(loss_name):
    """At ratio 1 (log_probs = old) every token's loss is -A_t, so with token-mean over 3 tokens the loss
    is -sum(w A) / 3 and its gradient per token -w_t A_t / 3 (gspo too: its ratio's gradient per token is
    s_i d logp_it, with s_i = 1 here)."""
    w = t([[0.5, 2.0, G], [1.5, G, G]])
    lp = OLD.clone().requires_grad_(True)
    loss, _ = F.POLICY_LOSSES[loss_name](lp, OLD, ADV, MASK, agg_mode="token-mean", token_weights=w,
                                         num_tokens=3.0, num_seqs=2.0)
    assert float(loss.detach()) == pytest.approx(-(0.5 * 1 + 2.0 * 2 + 1.5 * -3) / 3, rel=1e-6)
    loss.backward()
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, t([[-0.5 / 3, -4.0 / 3, 0], [4.5 / 3, 0, 0]]))


def minibatch(**extra) -> Batch:
    tensors = {"response_mask": MASK, "old_log_probs": OLD, "advantages": ADV, "rollout_log_probs": ROLLOUT}
    tensors.update(extra)
    return Batch(tensors)


CTX = LossContext(3.0, 2.0)  # the mini-batch's 3 response tokens in 2 sequences


def test_actor_loss_with_tis_cap_multiplies_each_tokens_policy_loss():
    opts = dict(use_kl_loss=False)
    lp = OLD.clone()
    outputs = {"log_probs": lp, "entropy": torch.zeros_like(lp)}
    plain, m0 = ActorLoss(AlgorithmOptions(**opts))(outputs, minibatch(), CTX)
    assert float(plain) == pytest.approx(-(1 + 2 - 3) / 3, abs=1e-7)  # off by default: weights 1
    assert "actor/tis_weight_mean" not in m0
    loss, m = ActorLoss(AlgorithmOptions(tis_cap=1.5, **opts))(outputs, minibatch(), CTX)
    want = -(1.5 * 1 + math.exp(-1.0) * 2 + 1.0 * -3) / 3
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert m["actor/pg_loss"] == pytest.approx(want, rel=1e-6)
    assert m["actor/tis_clipfrac"] == pytest.approx(1 / 3)
    assert m["actor/tis_weight_mean"] == pytest.approx((1.5 + math.exp(-1.0) + 1.0) / 3, rel=1e-6)


def test_tis_cap_is_validated():
    with pytest.raises(ValueError):
        AlgorithmOptions(tis_cap=0)
    with pytest.raises(ValueError):
        AlgorithmOptions(tis_cap=math.inf)
    assert AlgorithmOptions().tis_cap is None


@pytest.fixture(scope="module")
def pm() -> PluginManager:
    manager = PluginManager()
    manager.load_entry_points(strict=True, disabled=[])
    return manager


def grpo(pm: PluginManager, **options):
    from rlx.config import RLXConfig

    cfg = RLXConfig()
    cfg.rollout.n = 2
    comp = pm.get("algorithm", "grpo")
    opts = comp.load_config_model().model_validate({"overlong_buffer_len": 0, **options})
    return comp.load_factory()(opts, BuildContext(cfg, RunInfo("", "p", "e", {}), pm))


def scored(**extra) -> Batch:
    b = Batch({"scores": t([1.0, 0.0]), "group_index": torch.tensor([0, 0]), "response_mask": MASK.long(),
               "old_log_probs": OLD})
    b.tensors.update(extra)
    return b


def test_metrics_log_the_mismatch_between_rollout_and_trainer_log_probs(pm):
    alg = grpo(pm)
    batch = alg.compute_advantages(scored(rollout_log_probs=ROLLOUT))
    m = alg.metrics(batch)
    assert m["rollout/logprob_diff_mean"] == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    assert m["rollout/logprob_diff_max"] == pytest.approx(1.0)
    without = alg.metrics(alg.compute_advantages(scored()))  # an engine that returns no log-probs
    assert "rollout/logprob_diff_mean" not in without


def test_tis_with_an_engine_that_returns_no_log_probs_is_a_user_error(pm):
    alg = grpo(pm, tis_cap=2.0)
    with pytest.raises(UserError, match="tis_cap"):
        alg.compute_advantages(scored())
    alg.compute_advantages(scored(rollout_log_probs=ROLLOUT))
