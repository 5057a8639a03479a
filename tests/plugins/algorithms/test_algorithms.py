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
from rlx.records import LossContext
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
    cfg.rollout.n = 2  # the test batches hold two responses per prompt
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
                                        r"Did you mean 'rloo'\? Valid estimators: gae, gpg, grpo"):
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
    alg = build(pm, "remax", use_kl_in_reward=False, norm_adv_by_std=False)
    b = scored_batch([1.0, 0.0, 0.5, 0.25], baseline_scores=t([0.5, 0.5, 1.0, 1.0]),
                     baseline_response_length=torch.tensor([1, 1, 2, 2]))
    alg.compute_advantages(b)
    torch.testing.assert_close(b["advantages"], t([0.5, -0.5, -0.5, -0.75])[:, None] * MASK)


def test_remax_default_is_verls_unscaled_advantage(pm):
    b = scored_batch([1.0, 0.0, 0.5, 0.25], baseline_scores=t([0.5, 0.5, 1.0, 1.0]),
                     baseline_response_length=torch.tensor([1, 1, 2, 2]))
    build(pm, "remax", use_kl_in_reward=False).compute_advantages(b)
    torch.testing.assert_close(b["advantages"], t([0.5, -0.5, -0.5, -0.75])[:, None] * MASK)


def test_remax_can_scale_its_advantages(pm):
    """norm_adv_by_std=true: r - r_greedy divided by its root mean square over the real tokens."""
    alg = build(pm, "remax", use_kl_in_reward=False, norm_adv_by_std=True)
    b = scored_batch([1.0, 0.0, 0.5, 0.25], baseline_scores=t([0.5, 0.5, 1.0, 1.0]),
                     baseline_response_length=torch.tensor([1, 1, 2, 2]))
    alg.compute_advantages(b)
    unscaled = t([0.5, -0.5, -0.5, -0.75])[:, None] * MASK
    torch.testing.assert_close(b["advantages"], unscaled / unscaled[MASK.bool()].pow(2).mean().sqrt())


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
        mb = Batch({"response_mask": mask, "old_log_probs": lp.clone(), "advantages": torch.ones(2, width)})
        ctx = LossContext(3.0, 2.0, 8)
        loss, _ = ActorLoss(opts)({"log_probs": lp, "entropy": torch.zeros(2, width)}, mb, ctx)
        losses.append(float(loss))
    assert losses[0] == pytest.approx(-(3 / 8) / 2, rel=1e-6)
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


def test_actor_loss_kl_and_entropy_terms():
    """token-mean over the mini-batch: pg + kl_coef * mean(k3) - entropy_coeff * mean(H)."""
    mask = t([[1, 1, 0], [1, 0, 0]])
    lp = t([[-1.0, -2.0, G], [-0.5, G, G]])
    mb = Batch({"response_mask": mask, "old_log_probs": lp.clone(), "advantages": t([[1.0, 1.0, 0], [-2.0, 0, 0]]),
                "ref_log_probs": t([[-1.0, -1.0, G], [-1.5, -G, G]])})
    ctx = LossContext(3.0, 2.0)
    entropy = t([[2.0, 1.0, G], [3.0, G, G]])
    opts = AlgorithmOptions(kl_loss_coef=0.1, entropy_coeff=0.01, kl_loss_type="k3")
    loss, m = ActorLoss(opts)({"log_probs": lp, "entropy": entropy}, mb, ctx)
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
                "returns": t([[1.0, -1.0, G], [1.0, G, G]])})
    ctx = LossContext(3.0, 2.0)
    v = t([[2.0, -0.25, G], [1.0, G, G]])
    loss, m = CriticLoss(0.5)({"values": v}, mb, ctx)
    # token 1: v 2 -> clipped 0.5; (2-1)^2 = 1 vs (0.5-1)^2 = .25 -> 1 ; token 2: v -.25 within clip -> .5625
    # token 3: 0 -> total 0.5 * (1 + 0.5625 + 0) / 3
    assert float(loss) == pytest.approx(0.5 * 1.5625 / 3)
    assert m["critic/vf_loss"] == pytest.approx(0.5 * 1.5625 / 3)
    assert m["critic/vf_clipfrac"] == 0.0  # the clipped term was never the larger one
    assert m["critic/vpred_mean"] == pytest.approx((2 - 0.25 + 1) / 3)
    # a step that moves a value away from the return beyond the clip range: the clipped loss counts
    loss2, m2 = CriticLoss(0.5)({"values": t([[-1.0, -1.0, G], [1.0, G, G]])}, mb, ctx)
    # token 1: (-1-1)^2 = 4 vs clip(-1, -.5, .5) = -.5 -> 2.25 -> 4 ; token 2: 0 vs (-.5+1)^2 = .25 -> .25 clipped
    assert float(loss2) == pytest.approx(0.5 * (4 + 0.25) / 3)
    assert m2["critic/vf_clipfrac"] == pytest.approx(1 / 3)
    loss3, _ = CriticLoss(None)({"values": t([[-1.0, -1.0, G], [1.0, G, G]])}, mb, ctx)  # no clipping
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


# ---------------------------------------------------------------------------------------------
# verl's defaults: dual clip c = 3 always on, GSPO aggregated per sequence
def test_dual_clip_is_on_by_default_as_in_verl(pm):
    for name in ALGORITHMS:
        assert pm.get("algorithm", name).load_config_model()().clip_ratio_c == 3.0, name
    # one token, A = -1, ratio e^2 = 7.39: clip -> max(7.39, 0.8) = 7.39, dual clip -> min(7.39, 3) = 3
    mask = t([[1.0]])
    mb = Batch({"response_mask": mask, "old_log_probs": t([[-3.0]]), "advantages": t([[-1.0]])})
    ctx = LossContext(1.0, 1.0)
    out = {"log_probs": t([[-1.0]]), "entropy": t([[0.0]])}
    loss, m = ActorLoss(AlgorithmOptions(use_kl_loss=False))(out, mb, ctx)
    assert float(loss) == pytest.approx(3.0)
    assert m["actor/pg_clipfrac_dual"] == 1.0
    loss_off, _ = ActorLoss(AlgorithmOptions(use_kl_loss=False, clip_ratio_c=None))(out, mb, ctx)
    assert float(loss_off) == pytest.approx(math.exp(2.0), rel=1e-6)


def test_gspo_aggregates_per_sequence_unless_told_otherwise():
    assert AlgorithmOptions().loss_agg_mode == "token-mean"
    assert AlgorithmOptions(policy_loss="gspo").loss_agg_mode == "seq-mean-token-mean"
    assert AlgorithmOptions(policy_loss="gspo", loss_agg_mode="token-mean").loss_agg_mode == "token-mean"
    # the resolved value survives a round trip through a dumped config
    dumped = AlgorithmOptions(policy_loss="gspo").model_dump()
    assert AlgorithmOptions.model_validate(dumped).loss_agg_mode == "seq-mean-token-mean"
    # rows of 1 and 3 tokens, A = 1, ratio 1: per-token loss -1; seq-mean-token-mean = -1 whatever the
    # lengths, but rows weigh by tokens in token-mean: with A = 2 on the short row, (-2 - 3) / 4 vs (-2 - 1) / 2
    mask = t([[1, 0, 0], [1, 1, 1]])
    lp = torch.full((2, 3), -1.0)
    mb = Batch({"response_mask": mask, "old_log_probs": lp.clone(), "advantages": t([[2, 2, 2], [1, 1, 1]])})
    ctx = LossContext(4.0, 2.0)
    out = {"log_probs": lp, "entropy": torch.zeros(2, 3)}
    loss, _ = ActorLoss(AlgorithmOptions(policy_loss="gspo", use_kl_loss=False))(out, mb, ctx)
    assert float(loss) == pytest.approx(-3 / 2)
    loss_tok, _ = ActorLoss(AlgorithmOptions(policy_loss="gspo", use_kl_loss=False, loss_agg_mode="token-mean"))(
        out, mb, ctx)
    assert float(loss_tok) == pytest.approx(-5 / 4)


# ---------------------------------------------------------------------------------------------
# Group estimators need groups: rollout.n=1 is refused; steps whose groups all scored the same are counted
@pytest.mark.parametrize(("name", "options"), [("grpo", {}), ("grpo", {"adv_estimator": "rloo"}), ("rloo", {}),
                                               ("dapo", {}), ("grpo", {"adv_estimator":
                                                                       "reinforce_plus_plus_baseline"})])
def test_group_estimator_with_one_response_per_prompt_is_refused(pm, name, options):
    cfg = config()
    cfg.rollout.n = 1
    with pytest.raises(UserError, match=r"rollout\.n=1 samples one response per prompt: every advantage would "
                                        r"be exactly 0") as err:
        build(pm, name, cfg, **options)
    assert "Set rollout.n to 2 or more" in str(err.value)


def test_one_response_per_prompt_is_fine_without_groups(pm):
    cfg = config()
    cfg.rollout.n = 1
    for name in ("reinforce_plus_plus", "remax", "ppo"):
        build(pm, name, cfg)
    with pytest.raises(UserError, match=r"filter_groups=true \(dynamic sampling\) drops prompts") as err:
        build(pm, "remax", cfg, filter_groups=True)
    assert "algorithm.filter_groups=false" in str(err.value)


def test_train_with_one_response_per_prompt_exits_2_with_the_reason(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "rlx", "train", "--preset", "tiny", "rollout.n=1",
                           f"trainer.output_dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.count("Error:") == 1, proc.stderr
    assert "algorithm.adv_estimator=grpo compares each response with the other responses" in proc.stderr
    assert "rollout.n=1" in proc.stderr and "Set rollout.n to 2 or more" in proc.stderr


def test_steps_whose_groups_all_scored_the_same_are_counted(pm):
    alg = build(pm, "grpo", config())
    b = alg.compute_advantages(scored_batch([0.7, 0.7, 0.0, 1.0]))  # group 0 all equal, group 1 mixed
    assert torch.equal(b["advantages"][:2], torch.zeros(2, 4))  # exactly, at float32
    m = alg.metrics(b)
    assert (m["batch/equal_score_groups"], m["batch/equal_score_group_ratio"], m["batch/equal_score_steps"]) == (
        1.0, 0.5, 0.0)
    b = alg.compute_advantages(scored_batch([0.7, 0.7, 123.456, 123.456]))
    assert torch.equal(b["advantages"], torch.zeros(4, 4))
    with pytest.warns(UserWarning, match="every grpo advantage is 0"):
        m = alg.metrics(b)
    assert (m["batch/equal_score_groups"], m["batch/equal_score_group_ratio"], m["batch/equal_score_steps"]) == (
        2.0, 1.0, 1.0)
    # the count is part of the algorithm's checkpointed state
    assert alg.state_dict()["equal_score_steps"] == 1
    fresh = build(pm, "grpo", config())
    fresh.load_state_dict(alg.state_dict())
    assert fresh.equal_score_steps == 1
    fresh.load_state_dict({"kl_coef": 0.001})  # a checkpoint from before the count
    assert fresh.equal_score_steps == 0


# ---------------------------------------------------------------------------------------------
# Gradients of every term of the actor and critic losses, against independently written formulas,
# with log_probs different from both the old and the reference log-probs
GMASK = t([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
GLP = t([[-1.0, -0.3, -2.0, G], [-0.7, -1.2, G, G], [-0.5, -0.1, -3.0, -1.1]])
GOLD = t([[-1.2, -0.2, -2.5, -G], [-0.1, -1.3, G, -G], [-0.5, -0.6, -2.0, -1.0]])
GREF = t([[-0.4, -0.9, -1.0, G], [-1.5, -0.2, -G, G], [-0.2, -0.3, -2.2, -1.8]])
GADV = t([[1.0, -1.0, 2.0, G], [-2.0, 0.5, -G, G], [1.5, -0.5, -1.0, 0.3]])
GENT = t([[2.0, 1.5, 0.5, G], [1.0, 2.5, G, -G], [0.1, 0.2, 3.0, 1.0]])


def _reference_terms(lp: torch.Tensor, ent: torch.Tensor, kl_type: str, agg: str) -> dict[str, torch.Tensor]:
    """Each loss term written from its definition, on clean (zero) padding, masks as multipliers."""
    m = GMASK
    clean = {k: torch.where(m.bool(), x, torch.zeros_like(x)) for k, x in
             {"old": GOLD, "ref": GREF, "adv": GADV}.items()}
    lpc = torch.where(m.bool(), lp, torch.zeros_like(lp))
    entc = torch.where(m.bool(), ent, torch.zeros_like(ent))

    def agg_fn(x: torch.Tensor) -> torch.Tensor:
        if agg == "token-mean":
            return (x * m).sum() / m.sum()
        return ((x * m).sum(-1) / m.sum(-1)).mean()  # seq-mean-token-mean

    r = torch.exp(lpc - clean["old"])
    a = clean["adv"]
    obj = torch.min(r * a, torch.clamp(r, 0.8, 1.2) * a)
    obj = torch.where(a < 0, torch.max(obj, 3.0 * a), obj)  # dual clip, c = 3
    log_ratio_ref = clean["ref"] - lpc  # log(pi_ref / pi)
    kl = {"k1": -log_ratio_ref, "abs": log_ratio_ref.abs(), "k2": log_ratio_ref ** 2 / 2,
          "k3": torch.exp(log_ratio_ref) - 1 - log_ratio_ref}[kl_type]
    return {"pg": agg_fn(-obj), "kl": agg_fn(kl), "entropy": agg_fn(entc)}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3", "abs"])
def test_actor_loss_gradient_of_each_term(kl_type, agg):
    """The whole loss and the gradient of each term (policy, KL loss, entropy bonus), each isolated by
    switching it on and off, match the reference; a term with the right value but no gradient fails."""
    mb = Batch({"response_mask": GMASK, "old_log_probs": GOLD, "ref_log_probs": GREF, "advantages": GADV})
    ctx = LossContext(float(GMASK.sum()), 3.0)
    kl_coef, ent_coef = 0.3, 0.05

    def grads(**options):
        lp = GLP.clone().requires_grad_(True)
        ent = GENT.clone().requires_grad_(True)
        opts = AlgorithmOptions(loss_agg_mode=agg, kl_loss_type=kl_type, kl_loss_coef=kl_coef, **options)
        loss, _ = ActorLoss(opts)({"log_probs": lp, "entropy": ent}, mb, ctx)
        g_lp, g_ent = torch.autograd.grad(loss, (lp, ent), allow_unused=True)
        return loss.detach(), g_lp, (torch.zeros_like(ent) if g_ent is None else g_ent)

    lp_r = GLP.clone().requires_grad_(True)
    ent_r = GENT.clone().requires_grad_(True)
    ref = _reference_terms(lp_r, ent_r, kl_type, agg)
    want = {name: torch.autograd.grad(term, (lp_r, ent_r), allow_unused=True, retain_graph=True)
            for name, term in ref.items()}

    loss_pg, g_pg, _ = grads(use_kl_loss=False, entropy_coeff=0.0)
    loss_all, g_all, g_ent_all = grads(use_kl_loss=True, entropy_coeff=ent_coef)
    _, g_no_kl, _ = grads(use_kl_loss=False, entropy_coeff=ent_coef)
    torch.testing.assert_close(loss_pg, ref["pg"].detach())
    torch.testing.assert_close(loss_all, (ref["pg"] + kl_coef * ref["kl"] - ent_coef * ref["entropy"]).detach())
    torch.testing.assert_close(g_pg, want["pg"][0])  # policy loss
    kl_grad = g_all - g_no_kl  # the KL term alone
    torch.testing.assert_close(kl_grad, kl_coef * want["kl"][0], atol=1e-6, rtol=1e-5)
    assert float(kl_grad.abs().sum()) > 1e-3  # log_probs != ref, so the KL term does pull
    torch.testing.assert_close(g_ent_all, -ent_coef * want["entropy"][1])  # entropy bonus, w.r.t. the entropy
    for g in (g_pg, g_all, g_ent_all):  # and nothing reaches the garbage at padding
        assert torch.isfinite(g).all() and torch.all(g[~GMASK.bool()] == 0)


def test_actor_loss_gradient_is_finite_and_zero_at_nan_padding():
    nan = float("nan")
    pad = ~GMASK.bool()

    def junk(x, v):
        return torch.where(pad, torch.full_like(x, v), x)

    mb = Batch({"response_mask": GMASK, "old_log_probs": junk(GOLD, -math.inf), "ref_log_probs": junk(GREF, nan),
                "advantages": junk(GADV, math.inf)})
    ctx = LossContext(9.0, 3.0)
    for kl_type in ("k1", "k2", "k3", "abs"):
        lp = junk(GLP, 0.5).requires_grad_(True)
        ent = junk(GENT, nan).requires_grad_(True)
        opts = AlgorithmOptions(kl_loss_type=kl_type, kl_loss_coef=0.3, entropy_coeff=0.05)
        loss, _ = ActorLoss(opts)({"log_probs": lp, "entropy": ent}, mb, ctx)
        assert math.isfinite(float(loss.detach()))
        for g in torch.autograd.grad(loss, (lp, ent)):
            assert torch.isfinite(g).all() and torch.all(g[pad] == 0), (kl_type, g)


def test_critic_loss_gradient_matches_reference():
    mask = t([[1, 1, 0], [1, 0, 0]])
    old, ret = t([[0.0, 0.0, G], [1.0, G, G]]), t([[1.0, -1.0, G], [0.2, -G, G]])
    mb = Batch({"response_mask": mask, "values": old, "returns": ret})
    ctx = LossContext(3.0, 2.0)
    v = t([[2.0, -0.25, math.nan], [0.9, G, G]]).requires_grad_(True)
    (g,) = torch.autograd.grad(CriticLoss(0.5)({"values": v}, mb, ctx)[0], v)
    # d/dv of 0.5 max((v - R)^2, (clip(v, old +- .5) - R)^2) / 3 tokens:
    #   token 1: v = 2 beyond the clip, (v - R)^2 = 1 > (0.5 - 1)^2: (2 - 1) / 3 ; token 2: (-0.25 + 1) / 3 ;
    #   token 3: v = 0.9 inside the clip: (0.9 - 0.2) / 3 ; padding 0
    torch.testing.assert_close(g, t([[1 / 3, 0.75 / 3, 0.0], [0.7 / 3, 0.0, 0.0]]))
