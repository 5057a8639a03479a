"""The algorithm plugins: presets and what they ask of the trainer, the estimator registry (built-in and
third-party), reward shaping (overlong, KL in the reward with fixed and adaptive coefficients), dynamic
sampling's row filter, the actor and critic losses, and metrics. Expected values are worked by hand on
small ragged batches; garbage in padded positions must never change a result."""

from __future__ import annotations

import math
import types

import pytest
import torch

from rlx import Component, hookimpl
from rlx.batch import Batch
from rlx.context import BuildContext
from rlx.errors import UserError
from rlx.plugins.algorithms.base import ActorLoss, AlgorithmOptions, CriticLoss, PolicyGradient
from rlx.protocols import EstimatorInputs, RunInfo, advantage_estimator, estimator_requires
from rlx.registry import PluginManager

G = 1e6  # garbage written into padded positions
ALGORITHMS = ["dapo", "grpo", "ppo", "reinforce_plus_plus", "remax", "rloo"]


@pytest.fixture(scope="module")
def pm() -> PluginManager:
    manager = PluginManager()
    manager.load_entry_points(strict=True, disabled=[])
    return manager


def build(pm: PluginManager, name: str, config=None, **options) -> PolicyGradient:
    comp = pm.get("algorithm", name)
    opts = comp.load_config_model().model_validate(options)
    return comp.load_factory()(opts, BuildContext(config, RunInfo("", "p", "e", {}), pm))


def t(data) -> torch.Tensor:
    return torch.tensor(data, dtype=torch.float32)


def config(max_response_length: int = 4):
    from rlx.config import RLXConfig

    cfg = RLXConfig()
    cfg.data.max_response_length = max_response_length
    return cfg


# Two prompts x two samples, ragged responses (3, 1, 4, 2 tokens), garbage at padding.
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
GROUPS = torch.tensor([0, 0, 1, 1])


def scored_batch(scores, **tensors) -> Batch:
    b = Batch({"scores": t(scores), "group_index": GROUPS.clone(), "response_mask": MASK.clone()})
    for k, v in tensors.items():
        b.tensors[k] = v
    return b


# ---------------------------------------------------------------------------------------------
# Presets and what they need
def test_every_algorithm_is_registered_with_its_needs(pm):
    assert set(ALGORITHMS) <= set(pm.names("algorithm"))
    assert {"grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "gae"} <= set(
        pm.names("advantage"))
    needs = {name: (a.needs_ref, a.needs_critic, a.needs_greedy_baseline, a.filter_groups)
             for name in ALGORITHMS for a in [build(pm, name, config())]}
    assert needs == {
        "grpo": (True, False, False, False),  # KL loss to the reference
        "rloo": (True, False, False, False),  # KL in the reward
        "reinforce_plus_plus": (True, False, False, False),
        "remax": (True, False, True, False),  # greedy baseline
        "dapo": (False, False, False, True),  # no KL; dynamic sampling
        "ppo": (False, True, False, False),  # critic; no KL by default
    }
    assert build(pm, "grpo", use_kl_loss=False).needs_ref is False
    # An estimator override brings what it needs: gae asks for a critic whatever the preset.
    assert build(pm, "grpo", adv_estimator="gae").needs_critic is True
    assert build(pm, "ppo", adv_estimator="grpo").needs_critic is False
    assert build(pm, "ppo", use_kl_in_reward=True).needs_ref is True


def test_preset_defaults(pm):
    dapo = pm.get("algorithm", "dapo").load_config_model()()
    assert (dapo.clip_ratio_low, dapo.clip_ratio_high, dapo.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert build(pm, "dapo", config(max_response_length=8)).overlong_buffer_len == 2  # a quarter
    assert pm.get("algorithm", "ppo").load_config_model()().adv_estimator == "gae"
    for name in ALGORITHMS:  # every option is described, for `rlx plugins show`
        model = pm.get("algorithm", name).load_config_model()
        assert all(f.description for f in model.model_fields.values()), name
        assert model.model_config["extra"] == "forbid"


def test_unknown_estimator_is_a_user_error_with_a_suggestion(pm):
    with pytest.raises(UserError, match=r"algorithm\.adv_estimator: no advantage estimator named 'rlo'\. "
                                        r"Did you mean 'rloo'\? Valid estimators: gae, grpo"):
        build(pm, "grpo", adv_estimator="rlo")
    # config validation reports it with every other problem, before anything is built
    from rlx.config import build_raw
    from rlx.errors import ConfigError
    from rlx.validate import resolve

    raw = build_raw(preset="tiny", shortcuts={"algorithm": "ppo"},
                    overrides=["algorithm.adv_estimator=rlo", "trainer.sed=1"])
    with pytest.raises(ConfigError) as err:
        resolve(raw, pm, check_files=False)
    problems = err.value.problems
    assert any(p.startswith("algorithm.adv_estimator: no advantage estimator named 'rlo'") for p in problems)
    assert any(p.startswith("trainer.sed: unknown key") for p in problems)


def test_overlong_buffer_longer_than_responses_is_a_user_error(pm):
    with pytest.raises(UserError, match=r"overlong_buffer_len=8 is larger than data\.max_response_length=4"):
        build(pm, "grpo", config(4), overlong_buffer_len=8)


def test_estimator_requirements_are_declared():
    @advantage_estimator(requires=["values"])
    def needs_values(inputs):
        return inputs.response_mask, inputs.response_mask

    assert estimator_requires(needs_values) == {"values"}
    assert estimator_requires(lambda inputs: None) == frozenset()
    with pytest.raises(ValueError, match="unknown estimator requirements"):
        advantage_estimator(requires=["critic"])


# ---------------------------------------------------------------------------------------------
# Advantages through the algorithm: each built-in estimator by name, on a ragged batch
def test_builtin_estimators_through_the_algorithm(pm):
    scores = [1.0, 0.0, 0.5, 0.5]
    expected_per_seq = {
        # group 0: mean 0.5, std sqrt(0.5) -> +-0.5/(0.70711+1e-6); group 1: all equal -> 0
        "grpo": [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6), 0.0, 0.0],
        "rloo": [1.0, -1.0, 0.0, 0.0],
    }
    for name, want in expected_per_seq.items():
        alg = build(pm, "grpo", adv_estimator=name, use_kl_loss=False)
        b = alg.compute_advantages(scored_batch(scores))
        want_tok = t(want)[:, None] * MASK
        torch.testing.assert_close(b["advantages"], want_tok)
    # Dr. GRPO: no std division.
    b = build(pm, "grpo", norm_adv_by_std=False).compute_advantages(scored_batch(scores))
    torch.testing.assert_close(b["advantages"], t([0.5, -0.5, 0.0, 0.0])[:, None] * MASK)
    # GRPO advantages sum to zero within each group.
    b = build(pm, "grpo").compute_advantages(scored_batch([0.3, 0.9, 0.1, 0.2]))
    per_seq = b["advantages"][:, 0]
    assert abs(float(per_seq[:2].sum())) < 1e-6 and abs(float(per_seq[2:].sum())) < 1e-6


def test_gae_through_the_algorithm_equals_returns_minus_values(pm):
    """With gamma = lam = 1 the un-whitened GAE advantages are returns - values; returns are the score on
    every token. Values at padding are garbage and must not matter."""
    values = t([[0.1, 0.2, 0.3, G], [0.4, G, G, G], [0.0, 0.5, -0.5, 1.0], [0.2, 0.2, G, G]])
    alg = build(pm, "ppo")
    b = alg.compute_advantages(scored_batch([1.0, 0.0, 0.5, 0.25], values=values))
    returns = t([1.0, 0.0, 0.5, 0.25])[:, None] * MASK
    torch.testing.assert_close(b["returns"], returns)
    raw = torch.where(MASK.bool(), returns - values, torch.zeros(()))
    # advantages are the raw ones whitened over the 10 valid tokens
    valid = raw[MASK.bool()]
    whitened = (raw - valid.mean()) / torch.sqrt(valid.var() + 1e-8) * MASK
    torch.testing.assert_close(b["advantages"], whitened)
    m = alg.metrics(b)
    assert m["critic/returns/max"] == 1.0 and m["critic/returns/min"] == 0.0
    assert m["critic/values/max"] == 1.0 and m["critic/values/min"] == -0.5  # garbage G never shows
    assert m["critic/values/mean"] == pytest.approx(float(values[MASK.bool()].mean()))
    ev = 1 - float((returns - values)[MASK.bool()].var(unbiased=False)) / float(returns[MASK.bool()].var(
        unbiased=False))
    assert m["critic/vf_explained_var"] == pytest.approx(ev, rel=1e-5)


def test_remax_uses_the_greedy_baseline(pm):
    alg = build(pm, "remax", use_kl_in_reward=False)
    b = scored_batch([1.0, 0.0, 0.5, 0.25], baseline_scores=t([0.5, 0.5, 1.0, 1.0]),
                     baseline_response_length=torch.tensor([1, 1, 2, 2]))
    alg.compute_advantages(b)
    torch.testing.assert_close(b["advantages"], t([0.5, -0.5, -0.5, -0.75])[:, None] * MASK)


# ---------------------------------------------------------------------------------------------
# Reward shaping
def test_overlong_shaping(pm):
    """max_len 4, buffer 2: lengths 3 and 4 lose (3-2)/2 and (4-2)/2 of the factor 0.5; 1 and 2 lose nothing."""
    alg = build(pm, "grpo", config(4), overlong_buffer_len=2, overlong_penalty_factor=0.5, use_kl_loss=False)
    b = alg.compute_advantages(scored_batch([1.0, 1.0, 1.0, 1.0]))
    torch.testing.assert_close(b["shaped_scores"], t([0.75, 1.0, 0.5, 1.0]))
    # the shaped score sits on each response's last real token
    torch.testing.assert_close(b["token_level_scores"], t([[0, 0, 0.75, 0], [1, 0, 0, 0], [0, 0, 0, 0.5],
                                                            [0, 1, 0, 0]]))
    m = alg.metrics(b)
    assert m["reward/overlong_penalty/mean"] == pytest.approx(-0.75 / 4)
    assert m["reward/overlong_penalty/ratio"] == 0.5
    # shaping is what the estimator sees: group 0 had equal raw scores, now the longer response is worse
    assert float(b["advantages"][0, 0]) < 0 < float(b["advantages"][1, 0])


def kl_batch() -> Batch:
    old = t([[-1.0, -2.0, -1.0, G], [-1.0, G, G, G], [-0.5, -0.5, -0.5, -0.5], [-2.0, -1.0, G, G]])
    ref = t([[-1.5, -2.0, -0.5, -G], [-1.2, -G, G, 0], [-0.5, -0.7, -0.5, -0.3], [-2.0, -2.0, G, -G]])
    return scored_batch([1.0, 0.0, 1.0, 0.0], old_log_probs=old, ref_log_probs=ref)


def test_kl_in_reward_fixed(pm):
    """k1 penalty beta * (old - ref) on each real token, the score on the last one."""
    alg = build(pm, "grpo", use_kl_loss=False, use_kl_in_reward=True, kl_ctrl={"kl_coef": 0.1},
                adv_estimator="reinforce_plus_plus")
    assert alg.needs_ref
    b = alg.compute_advantages(kl_batch())
    kl = t([[0.5, 0.0, -0.5, 0], [0.2, 0, 0, 0], [0.0, 0.2, 0.0, -0.2], [0.0, 1.0, 0, 0]])
    scores_tok = t([[0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 0]])
    torch.testing.assert_close(b["token_level_rewards"], scores_tok - 0.1 * kl)
    m = alg.metrics(b)
    # mean over sequences of each sequence's token-mean KL: (0 + 0.2 + 0 + 0.5) / 4
    assert m["actor/reward_kl_penalty"] == pytest.approx(0.175)
    assert m["actor/reward_kl_coef"] == pytest.approx(0.1)
    # sequence rewards: 1 - 0.1 * 0, 0 - 0.1 * 0.2, 1 - 0.1 * 0, 0 - 0.1 * 1
    assert m["critic/rewards/mean"] == pytest.approx((1.0 - 0.02 + 1.0 - 0.1) / 4)
    # outcome estimators see the sequence reward score - beta * sum KL
    rloo = build(pm, "rloo", kl_ctrl={"kl_coef": 0.1})
    b = rloo.compute_advantages(kl_batch())
    # group 0: rewards 1 - 0 = 1, 0 - 0.02 = -0.02 -> +-1.02; group 1: 1 - 0 = 1, 0 - 0.1 -> +-1.1
    torch.testing.assert_close(b["advantages"], t([1.02, -1.02, 1.1, -1.1])[:, None] * MASK)
    assert alg.kl_ctrl.value == 0.1  # fixed


def test_kl_in_reward_adaptive_controller_and_its_state(pm):
    """beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * B / horizon after each step."""
    alg = build(pm, "rloo", kl_ctrl={"type": "adaptive", "kl_coef": 0.1, "target_kl": 0.1, "horizon": 40})
    alg.compute_advantages(kl_batch())  # measured KL 0.175: error clipped to +0.2
    assert alg.kl_ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 4 / 40))
    first = alg.metrics(alg.compute_advantages(kl_batch()))
    assert first["actor/reward_kl_coef"] == pytest.approx(0.102)  # the coefficient this step used
    assert alg.kl_ctrl.value == pytest.approx(0.102 * 1.02)
    state = alg.state_dict()
    fresh = build(pm, "rloo", kl_ctrl={"type": "adaptive", "kl_coef": 0.1, "target_kl": 0.1, "horizon": 40})
    fresh.load_state_dict(state)
    assert fresh.kl_ctrl.value == alg.kl_ctrl.value
    # KL below target: error (0.05/0.1 - 1) = -0.5 clipped to -0.2
    low = build(pm, "rloo", kl_ctrl={"type": "adaptive", "kl_coef": 0.1, "target_kl": 0.35, "horizon": 40})
    low.compute_advantages(kl_batch())  # 0.175 / 0.35 - 1 = -0.5 -> -0.2
    assert low.kl_ctrl.value == pytest.approx(0.1 * (1 - 0.2 * 4 / 40))


# ---------------------------------------------------------------------------------------------
# Dynamic sampling
def test_keep_rows_drops_groups_whose_rewards_are_all_equal(pm):
    alg = build(pm, "dapo", config(4))
    b = Batch({"scores": t([1, 1, 0, 1, 0.5, 0.5]), "group_index": torch.tensor([0, 0, 1, 1, 2, 2]),
               "response_mask": torch.ones(6, 2, dtype=torch.long)})
    assert alg.keep_rows(b).tolist() == [False, False, True, True, False, False]


# ---------------------------------------------------------------------------------------------
# Losses
def test_dr_grpo_normaliser_is_the_response_budget_not_the_padded_width():
    """seq-mean-token-sum-norm divides by data.max_response_length, so padding never rescales the loss.

    Rows of 2 and 1 tokens, A = 1, ratio 1: per-sequence token sums -2 and -1, / max_len 8, mean over
    2 sequences = -(3 / 8) / 2, whatever the padded width.
    """
    opts = AlgorithmOptions(loss_agg_mode="seq-mean-token-sum-norm", use_kl_loss=False)
    losses = []
    for width in (3, 6):
        mask = torch.zeros(2, width)
        mask[0, :2] = 1
        mask[1, :1] = 1
        lp = torch.full((2, width), -1.0)
        mb = Batch({"response_mask": mask, "old_log_probs": lp.clone(), "advantages": torch.ones(2, width)},
                   meta={"minibatch_tokens": 3.0, "minibatch_seqs": 2.0, "max_response_length": 8})
        loss, _ = ActorLoss(opts)({"log_probs": lp, "entropy": torch.zeros(2, width)}, mb)
        losses.append(float(loss))
    assert losses[0] == pytest.approx(-(3 / 8) / 2, rel=1e-6)
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


def test_actor_loss_kl_and_entropy_terms():
    """token-mean over the mini-batch: pg + kl_coef * mean(k3) - entropy_coeff * mean(H)."""
    mask = t([[1, 1, 0], [1, 0, 0]])
    lp = t([[-1.0, -2.0, G], [-0.5, G, G]])
    mb = Batch({"response_mask": mask, "old_log_probs": lp.clone(), "advantages": t([[1.0, 1.0, 0], [-2.0, 0, 0]]),
                "ref_log_probs": t([[-1.0, -1.0, G], [-1.5, -G, G]])},
               meta={"minibatch_tokens": 3.0, "minibatch_seqs": 2.0})
    entropy = t([[2.0, 1.0, G], [3.0, G, G]])
    opts = AlgorithmOptions(kl_loss_coef=0.1, entropy_coeff=0.01, kl_loss_type="k3")
    loss, m = ActorLoss(opts)({"log_probs": lp, "entropy": entropy}, mb)
    # ratio 1: pg = -(1 + 1 - 2) / 3 = 0; k3 with d = logp - ref: x = -d -> e^x - x - 1
    k3 = [math.exp(0) - 0 - 1, math.exp(1) - 1 - 1, math.exp(-1) + 1 - 1]
    want = 0.1 * sum(k3) / 3 - 0.01 * (2 + 1 + 3) / 3
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert m["actor/kl_loss"] == pytest.approx(sum(k3) / 3, rel=1e-6)
    assert m["actor/entropy"] == pytest.approx(2.0)
    assert m["actor/pg_loss"] == pytest.approx(0.0, abs=1e-7)
    assert {"actor/pg_clipfrac", "actor/pg_clipfrac_low", "actor/pg_clipfrac_high", "actor/ppo_kl"} <= set(m)


def test_critic_loss_clipping_and_metrics():
    """0.5 * max((v - R)^2, (clip(v, old +- 0.5) - R)^2), token-mean over the mini-batch's 3 tokens."""
    mask = t([[1, 1, 0], [1, 0, 0]])
    mb = Batch({"response_mask": mask, "values": t([[0.0, 0.0, G], [1.0, G, G]]),
                "returns": t([[1.0, -1.0, G], [1.0, G, G]])}, meta={"minibatch_tokens": 3.0, "minibatch_seqs": 2.0})
    v = t([[2.0, -0.25, G], [1.0, G, G]])
    loss, m = CriticLoss(0.5)({"values": v}, mb)
    # token 1: v 2 -> clipped 0.5; (2-1)^2 = 1 vs (0.5-1)^2 = .25 -> 1 ; token 2: v -.25 within clip -> .5625
    # token 3: 0 -> total 0.5 * (1 + 0.5625 + 0) / 3
    assert float(loss) == pytest.approx(0.5 * 1.5625 / 3)
    assert m["critic/vf_loss"] == pytest.approx(0.5 * 1.5625 / 3)
    assert m["critic/vf_clipfrac"] == 0.0  # the clipped term was never the larger one
    assert m["critic/vpred_mean"] == pytest.approx((2 - 0.25 + 1) / 3)
    # a step that moves a value away from the return beyond the clip range: the clipped loss counts
    loss2, m2 = CriticLoss(0.5)({"values": t([[-1.0, -1.0, G], [1.0, G, G]])}, mb)
    # token 1: (-1-1)^2 = 4 vs clip(-1, -.5, .5) = -.5 -> 2.25 -> 4 ; token 2: 0 vs (-.5+1)^2 = .25 -> .25 clipped
    assert float(loss2) == pytest.approx(0.5 * (4 + 0.25) / 3)
    assert m2["critic/vf_clipfrac"] == pytest.approx(1 / 3)
    loss3, _ = CriticLoss(None)({"values": t([[-1.0, -1.0, G], [1.0, G, G]])}, mb)  # no clipping
    assert float(loss3) == pytest.approx(0.5 * 4 / 3)


# ---------------------------------------------------------------------------------------------
# A third-party estimator
def test_third_party_estimator_is_selectable_by_name(pm):
    seen: list[EstimatorInputs] = []

    @advantage_estimator()
    def sign(inputs: EstimatorInputs):
        seen.append(inputs)
        adv = (inputs.scores - 0.5).sign()[:, None] * inputs.response_mask
        return adv, adv

    plugin = types.ModuleType("third_party_sign")
    plugin.rlx_advantage_estimators = hookimpl(
        lambda: [Component(kind="advantage", name="sign", factory=sign, summary="test")])
    local = PluginManager()
    local.load_entry_points(strict=True, disabled=[])
    local.register(plugin, name="third_party_sign", distribution="rlx-test-sign", version="0.1")
    assert local.get("advantage", "sign").distribution == "rlx-test-sign"
    alg = build(local, "grpo", adv_estimator="sign", use_kl_loss=False, estimator_options={"k": 3})
    b = alg.compute_advantages(scored_batch([1.0, 0.0, 0.75, 0.5]))
    torch.testing.assert_close(b["advantages"], t([1.0, -1.0, 1.0, 0.0])[:, None] * MASK)
    assert seen[0].options == {"k": 3} and seen[0].batch is b
    assert not alg.needs_critic and not alg.needs_ref


def test_estimator_returning_a_wrong_shape_is_named(pm):
    plugin = types.ModuleType("bad_shape")
    plugin.rlx_advantage_estimators = hookimpl(lambda: [Component(
        kind="advantage", name="flat", factory=lambda inputs: (inputs.scores, inputs.scores))])
    local = PluginManager()
    local.load_entry_points(strict=True, disabled=[])
    local.register(plugin, name="bad_shape")
    alg = build(local, "grpo", adv_estimator="flat", use_kl_loss=False)
    with pytest.raises(RuntimeError, match=r"estimator 'flat' returned advantages of shape \(4,\)"):
        alg.compute_advantages(scored_batch([1.0, 0.0, 0.5, 0.5]))
