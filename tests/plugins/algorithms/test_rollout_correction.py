"""verl's rollout correction beyond token TIS (issue 29): geometric-mean weights, weight and mismatch statistics,
rejection that leaves the trained mask, bypass mode (PPO clip and REINFORCE against pi_rollout), and the
optimal-token-baseline estimators with the ``sum_pi_squared`` they need from the old-log-prob pass.

Expected values are written from verl's formulas (``rollout_corr_helper.py``, ``core_algos.py``) as plain Python
loops or hand arithmetic, in float64, independent of rlx's vectorised code.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from rlx.batch import Batch
from rlx.plugins.algorithms import functional as F
from rlx.plugins.algorithms.base import ActorLoss, AlgorithmOptions
from rlx.records import LossContext

D = torch.float64


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=D)


# d = old - rollout: row 0: [0.5, -1.0, pad], row 1: [0.2, 0.1, 0.3], row 2: [-0.05, pad, pad]
MASK = t([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
OLD = t([[-1.0, -2.0, 9.0], [-0.5, -0.4, -0.3], [-0.2, 9.0, 9.0]])
ROLLOUT = t([[-1.5, -1.0, -9.0], [-0.7, -0.5, -0.6], [-0.15, -9.0, 9.0]])
D_ROWS = [[0.5, -1.0], [0.2, 0.1, 0.3], [-0.05]]


def test_geometric_weights_are_the_geometric_mean_of_the_token_ratios():
    w, keep, m = F.rollout_correction_weights(OLD, ROLLOUT, MASK, rollout_is="geometric", threshold=1.5)
    # exp(mean d) per response: exp(-0.25), exp(0.2), exp(-0.05): none above 1.5
    want = t([[math.exp(-0.25)] * 2 + [0], [math.exp(0.2)] * 3, [math.exp(-0.05), 0, 0]])
    torch.testing.assert_close(w, want, atol=1e-12, rtol=0)
    assert keep.tolist() == MASK.bool().tolist()
    assert m["is_clipfrac"] == 0.0
    w, _, m = F.rollout_correction_weights(OLD, ROLLOUT, MASK, rollout_is="geometric", threshold=1.1)
    assert float(w[1, 0]) == pytest.approx(1.1) and m["is_clipfrac"] == pytest.approx(3 / 6)
    # batch-normalised: one weight per response, divided by their mean
    w, _, m = F.rollout_correction_weights(OLD, ROLLOUT, MASK, rollout_is="geometric", threshold=1.5,
                                           batch_normalize=True)
    mean = (math.exp(-0.25) + math.exp(0.2) + math.exp(-0.05)) / 3
    assert m["is_batch_norm_factor"] == pytest.approx(mean)
    assert float(w[0, 0]) == pytest.approx(math.exp(-0.25) / mean)


def test_weight_and_mismatch_statistics():
    _, _, m = F.rollout_correction_weights(OLD, ROLLOUT, MASK, rollout_is="token", threshold=1.5)
    ws = [min(math.exp(d), 1.5) for row in D_ROWS for d in row]
    mean = sum(ws) / 6
    assert m["is_weight_mean"] == pytest.approx(mean)
    assert m["is_weight_std"] == pytest.approx(math.sqrt(sum((w - mean) ** 2 for w in ws) / 5))
    assert (m["is_weight_min"], m["is_weight_max"]) == (pytest.approx(math.exp(-1.0)), pytest.approx(1.5))
    assert m["is_eff_sample_size"] == pytest.approx(sum(ws) ** 2 / (6 * sum(w * w for w in ws)))
    ds = [d for row in D_ROWS for d in row]
    assert m["kl"] == pytest.approx(sum(-d for d in ds) / 6)  # KL(pi_rollout || pi_old) by k1
    assert m["k3_kl"] == pytest.approx(sum(math.exp(d) - 1 - d for d in ds) / 6)
    assert m["chi2_token"] == pytest.approx(sum(math.exp(2 * d) for d in ds) / 6 - 1)
    assert m["chi2_seq"] == pytest.approx(sum(math.exp(2 * sum(row)) for row in D_ROWS) / 3 - 1)
    assert m["training_ppl"] == pytest.approx((math.exp(1.5) + math.exp(0.4) + math.exp(0.2)) / 3)
    assert m["rollout_ppl"] == pytest.approx((math.exp(1.25) + math.exp(0.6) + math.exp(0.15)) / 3)
    # sequence weights: the statistics are per response (one weight each)
    _, _, m = F.rollout_correction_weights(OLD, ROLLOUT, MASK, rollout_is="sequence", threshold=1.5)
    seq = [math.exp(-0.5), 1.5, math.exp(-0.05)]
    assert m["is_weight_mean"] == pytest.approx(sum(seq) / 3)
    assert m["is_eff_sample_size"] == pytest.approx(sum(seq) ** 2 / (3 * sum(w * w for w in seq)))


def test_rejection_leaves_the_trained_mask_and_the_denominators():
    """As verl: a rejected token has no advantage and no loss, KL or entropy term, and is not counted."""
    from rlx.batch import trained_mask
    from rlx.context import BuildContext
    from rlx.plugins.algorithms.base import PolicyGradient
    from rlx.protocols import RunInfo
    from rlx.registry import PluginManager

    pm = PluginManager()
    pm.load_entry_points(strict=False, disabled=[])
    from rlx.config import RLXConfig

    cfg = RLXConfig()
    cfg.rollout.n = 3
    opts = AlgorithmOptions(overlong_buffer_len=0, use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="k1",
                            rollout_correction={"rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_2.0"})
    alg = PolicyGradient(opts, BuildContext(cfg, RunInfo("", "p", "e", {}), pm))
    batch = Batch({"scores": t([1.0, 0.0, 0.5]), "group_index": torch.tensor([0, 0, 0]),
                   "response_mask": MASK.long(), "old_log_probs": OLD, "rollout_log_probs": ROLLOUT})
    alg.compute_advantages(batch)
    assert "rollout_is_weights" not in batch  # rejection only: no weights
    keep = [[1, 0, 0], [1, 1, 1], [1, 0, 0]]  # k1 = 1.0 > log 2 at row 0, token 1
    assert batch["rejection_mask"].tolist() == keep
    assert trained_mask(batch).tolist() == keep
    assert float(batch["advantages"][0, 1]) == 0.0
    # the loss: token-mean over the 5 kept tokens (on-policy, ratio 1: -A per token) plus the KL term over them
    mb = Batch({k: batch[k] for k in ("response_mask", "old_log_probs", "advantages", "rejection_mask")})
    ref = OLD - 0.25  # k1 = logp - ref = 0.25 on every token
    mb.tensors["ref_log_probs"] = ref
    lp = OLD.clone().requires_grad_(True)
    loss, out = ActorLoss(opts)({"log_probs": lp, "entropy": torch.zeros_like(lp)}, mb, LossContext(5, 3))
    adv = batch["advantages"][:, 0].double()
    want = -(adv[0] + 3 * adv[1] + adv[2]) / 5 + 0.25
    assert float(loss.detach()) == pytest.approx(float(want), rel=1e-9)
    assert out["actor/kl_loss"] == pytest.approx(0.25)
    loss.backward()
    assert float(lp.grad[0, 1]) == 0.0  # the rejected token has no gradient at all


def test_bypass_mode_options():
    a = AlgorithmOptions(rollout_correction={"bypass_mode": True})
    assert a.policy_loss == "bypass_mode" and not a.rollout_correction.active
    b = AlgorithmOptions(policy_loss="bypass_mode")
    assert b.rollout_correction.bypass_mode is True
    knobs = AlgorithmOptions(policy_loss="bypass_mode", rollout_correction={
        "loss_type": "reinforce", "rollout_is": "sequence", "rollout_is_threshold": 3.0, "rollout_rs": "seq_max_k2",
        "rollout_rs_threshold": 0.5}).policy_loss_knobs()
    assert knobs == {"loss_type": "reinforce", "rollout_is": "sequence", "rollout_is_threshold": 3.0,
                     "rollout_is_batch_normalize": False, "rejection": [("seq_max_k2", None, 0.5)]}
    with pytest.raises(ValidationError, match="policy_loss=gspo would not be used"):
        AlgorithmOptions(policy_loss="gspo", rollout_correction={"bypass_mode": True})
    with pytest.raises(ValidationError, match="tis_cap and rollout_correction"):
        AlgorithmOptions(tis_cap=2.0, policy_loss="bypass_mode")
    with pytest.raises(ValidationError, match="loss_type"):
        AlgorithmOptions(rollout_correction={"loss_type": "reinforcee"})


# current policy lp, rollout policy ro, advantages A (one per response), a hole in row 1
B_MASK = t([[1, 1, 1, 0], [1, 0, 1, 1]])
B_LP = t([[-0.5, -1.0, -0.2, 7.0], [-1.5, 7.0, -0.3, -2.0]])
B_RO = t([[-0.6, -0.2, -0.25, -7.0], [-1.0, -7.0, -0.3, -2.2]])
B_ADV = t([[1.0] * 4, [-2.0] * 4])


def kept_tokens(lo: float, hi: float) -> list[tuple[int, int]]:
    """Tokens whose pi_rollout / pi ratio lies in [lo, hi] (token_k1 band against the current policy)."""
    out = []
    for i in range(2):
        for j in range(4):
            if B_MASK[i, j] and lo <= math.exp(float(B_RO[i, j] - B_LP[i, j])) <= hi:
                out.append((i, j))
    return out


def test_bypass_ppo_clip_is_ppo_against_the_rollout_policy_with_rejection():
    lp = B_LP.clone().requires_grad_(True)
    loss, m = F.bypass_policy_loss(lp, B_RO, B_ADV, B_MASK, loss_type="ppo_clip", rollout_is="token",
                                   rejection=[("token_k1", 0.5, 2.0)], num_tokens=6)
    kept = kept_tokens(0.5, 2.0)
    assert kept == [(0, 0), (0, 2), (1, 0), (1, 2), (1, 3)]  # row 0 token 1: pi_rollout / pi = e^0.8 > 2
    total, grads = 0.0, {}
    for i, j in kept:
        a, r = float(B_ADV[i, j]), math.exp(float(B_LP[i, j] - B_RO[i, j]))
        clipped = min(max(r, 0.8), 1.2)
        value = max(-a * r, -a * clipped)
        if a < 0:
            value = min(value, -a * 3.0)  # dual clip
        total += value
        grads[(i, j)] = -a * r / 6 if value == -a * r and (a > 0 or value != -a * 3.0) else 0.0
    assert float(loss.detach()) == pytest.approx(total / 6, rel=1e-12)
    loss.backward()
    for i in range(2):
        for j in range(4):
            assert float(lp.grad[i, j]) == pytest.approx(grads.get((i, j), 0.0), abs=1e-12), (i, j)
    assert m["rollout_corr/rs_masked_fraction"] == pytest.approx(1 / 6)
    assert m["ppo_kl"] == pytest.approx(sum(float(B_RO[i, j] - B_LP[i, j]) for i, j in kept) / 5)
    # the IS weights are reported, not applied (the ratio already is the correction)
    assert "rollout_corr/is_weight_mean" in m


@pytest.mark.parametrize("level", ["token", "sequence", None])
def test_bypass_reinforce_weights_the_score_function(level):
    lp = B_LP.clone().requires_grad_(True)
    loss, m = F.bypass_policy_loss(lp, B_RO, B_ADV, B_MASK, loss_type="reinforce", rollout_is=level,
                                   rollout_is_threshold=1.5, agg_mode="seq-mean-token-sum", num_seqs=2)
    want, grad = 0.0, torch.zeros_like(B_LP)
    for i in range(2):
        seq_d = sum(float(B_LP[i, j] - B_RO[i, j]) for j in range(4) if B_MASK[i, j])
        for j in range(4):
            if not B_MASK[i, j]:
                continue
            if level == "token":
                w = min(math.exp(float(B_LP[i, j] - B_RO[i, j])), 1.5)
            elif level == "sequence":
                w = min(math.exp(seq_d), 1.5)
            else:
                w = 1.0
            want += -float(B_ADV[i, j]) * float(B_LP[i, j]) * w / 2
            grad[i, j] = -float(B_ADV[i, j]) * w / 2
    assert float(loss.detach()) == pytest.approx(want, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(lp.grad, grad, atol=1e-12, rtol=0)
    assert m["ppo_kl"] == pytest.approx(float(((B_RO - B_LP) * B_MASK).sum() / 6))


def test_bypass_mode_through_the_actor_loss_names_its_metrics():
    opts = AlgorithmOptions(policy_loss="bypass_mode", use_kl_loss=False,
                            rollout_correction={"rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_2.0"})
    mb = Batch({"response_mask": B_MASK.long(), "old_log_probs": B_RO, "advantages": B_ADV})
    _, out = ActorLoss(opts)({"log_probs": B_LP.clone(), "entropy": torch.zeros_like(B_LP)}, mb,
                             LossContext(6, 2))
    assert out["rollout_corr/rs_masked_fraction"] == pytest.approx(1 / 6)
    assert "actor/ppo_kl" in out and "actor/rollout_corr/rs_masked_fraction" not in out


# --------------------------------------------------------------------------------------------------
# The optimal token baseline, against loops written from verl's formula
# --------------------------------------------------------------------------------------------------

def otb_reference(rewards, mask, groups, old, sps, rho=None, zero_tail=False, trained_order=False):
    """B_t = sum_i G_it W_it / (sum_i W_it + 1e-8) per group, W the running sum of 1 - 2 pi + sum pi^2 (times rho^2),
    at the same position t, or (trained_order) at the same index among each response's trained tokens."""
    rows, width = len(mask), len(mask[0])
    g = [[sum(rewards[i][u] * mask[i][u] for u in range(t_, width)) for t_ in range(width)] for i in range(rows)]
    w_run = []
    for i in range(rows):
        acc, out = 0.0, []
        for t_ in range(width):
            if mask[i][t_]:
                w = 1 - 2 * math.exp(old[i][t_]) + sps[i][t_]
                acc += w * (rho[i][t_] ** 2 if rho is not None else 1.0)
            out.append(acc)
        w_run.append(out)
    # per response: the list of (position, G, W) of its trained tokens in order
    seq = [[(t_, g[i][t_], w_run[i][t_]) for t_ in range(width) if mask[i][t_]] for i in range(rows)]
    adv = [[0.0] * width for _ in range(rows)]
    for grp in set(groups):
        members = [i for i in range(rows) if groups[i] == grp]
        counted = [i for i in members if seq[i]] if trained_order else members
        for i in members:
            lens = sorted((len(seq[k]) for k in members), reverse=True)
            for slot, (pos, gi, _) in enumerate(seq[i]):
                key = slot if trained_order else pos
                if len(counted) < 2:
                    base = 0.0
                else:
                    num = den = 0.0
                    for k in members:
                        entry = (seq[k][key] if key < len(seq[k]) else None) if trained_order else \
                            next((e for e in seq[k] if e[0] == pos), None)
                        if entry is not None:
                            num += entry[1] * entry[2]
                            den += entry[2]
                    base = num / (den + 1e-8)
                    longest = len(seq[i]) == lens[0] and lens.count(lens[0]) == 1
                    if zero_tail and longest and key >= lens[1]:
                        base = 0.0
                adv[i][pos] = gi - base
    return adv


def random_case(rng: random.Random, holes: bool):
    groups = [0, 0, 0, 1, 1, 2, 3, 3]  # group 2 is a group of one
    width = 6
    mask, rewards, old, sps, rho = [], [], [], [], []
    for _ in range(len(groups)):
        n = rng.randint(1, width)
        row = [1 if j < n else 0 for j in range(width)]
        if holes and n > 2:
            row[rng.randint(1, n - 2)] = 0  # tool output inside the episode
        mask.append(row)
        last = max(j for j in range(width) if row[j])
        rewards.append([float(rng.choice([0, 1])) if j == last else 0.0 for j in range(width)])
        old.append([math.log(rng.uniform(0.05, 0.95)) for _ in range(width)])
        sps.append([rng.uniform(0.1, 0.9) for _ in range(width)])
        rho.append([rng.uniform(0.5, 2.0) for _ in range(width)])
    rewards[1] = list(rewards[0])  # a tie
    return groups, mask, rewards, old, sps, rho


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("align,zero_tail,use_rho,holes", [
    ("position", False, False, False), ("position", True, True, False),
    ("trained", True, False, True), ("trained", False, True, True)])
def test_optimal_token_baseline_matches_the_formula(seed, align, zero_tail, use_rho, holes):
    groups, mask, rewards, old, sps, rho = random_case(random.Random(seed), holes)
    m = t(mask)
    garbage = torch.where(m.bool(), torch.zeros_like(m), torch.full_like(m, float("nan")))  # padding holds NaN
    adv, ret = F.optimal_token_baseline_advantages(
        t(rewards), m, torch.tensor(groups), t(old) + garbage, t(sps) + garbage,
        rollout_is_weights=(t(rho) + garbage) if use_rho else None, handle_zero_tail=zero_tail, align=align)
    want = otb_reference(rewards, mask, groups, old, sps, rho if use_rho else None, zero_tail, align == "trained")
    torch.testing.assert_close(adv, t(want), atol=1e-10, rtol=0)
    assert torch.all(adv[m == 0] == 0) and torch.all(ret[m == 0] == 0)
    # the group of one: no baseline, the advantage is the return
    torch.testing.assert_close(adv[5], ret[5])


def test_optimal_token_baseline_by_hand():
    """Two responses of one group, 2 tokens each, reward 1 and 0 on the last token. pi = 0.5 everywhere and
    sum pi^2 = 0.5: w = 1 - 1 + 0.5 = 0.5 per token, W = 0.5, 1.0; G = [1, 1] and [0, 0]; B_t = (1 W) / (2 W)
    = 0.5 at both positions: A = +0.5 / -0.5."""
    mask = t([[1, 1], [1, 1]])
    adv, _ = F.optimal_token_baseline_advantages(t([[0, 1.0], [0, 0.0]]), mask, torch.tensor([0, 0]),
                                                 torch.full((2, 2), math.log(0.5), dtype=D),
                                                 torch.full((2, 2), 0.5, dtype=D))
    torch.testing.assert_close(adv, t([[0.5, 0.5], [-0.5, -0.5]]), atol=1e-8, rtol=0)


def test_optimal_token_baseline_estimator_options(pm_estimators):
    from rlx.protocols import EstimatorInputs

    mask = t([[1, 1], [1, 0]])
    inputs = EstimatorInputs(response_mask=mask, scores=t([1.0, 0.0]), token_level_rewards=t([[0, 1.0], [0, 0]]),
                             group_index=torch.tensor([0, 0]), old_log_probs=torch.full((2, 2), -0.7, dtype=D),
                             sum_pi_squared=torch.full((2, 2), 0.4, dtype=D), options={"handle_zero_tail": True})
    fn = pm_estimators.get("advantage", "optimal_token_baseline").load_factory()
    adv, _ = fn(inputs)
    assert float(adv[0, 1]) == 1.0  # past the shorter response's end the baseline is 0: A = G = 1
    from rlx.errors import ConfigError

    with pytest.raises(ConfigError, match="handle_zero_tail"):
        fn(EstimatorInputs(**{**inputs.__dict__, "options": {"zero_tail": True}}))
    with pytest.raises(ConfigError, match="true or false"):
        fn(EstimatorInputs(**{**inputs.__dict__, "options": {"handle_zero_tail": "yes"}}))
    no_sps = EstimatorInputs(**{**inputs.__dict__, "sum_pi_squared": None})
    with pytest.raises(RuntimeError, match="sum_pi_squared"):
        fn(no_sps)


@pytest.fixture(scope="module")
def pm_estimators():
    from rlx.registry import PluginManager

    manager = PluginManager()
    manager.load_entry_points(strict=False, disabled=[])
    return manager


def test_the_worker_computes_sum_pi_squared(tiny_model_path):
    """The old-log-prob pass's sum over the vocabulary of pi^2, against softmax of the model's own logits."""
    from rlx.plugins.modeling.worker import TorchBackendOptions, TorchWorker
    from rlx.protocols import RoleSpec

    worker = TorchWorker(RoleSpec(role="ref", model_path=tiny_model_path, trainable=False, micro_batch_size=2),
                         TorchBackendOptions(), "cpu")
    torch.manual_seed(0)
    prompts = torch.randint(3, 60, (3, 5))
    responses = torch.randint(3, 60, (3, 4))
    response_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    batch = Batch({"prompts": prompts, "prompt_mask": torch.ones_like(prompts), "responses": responses,
                   "response_mask": response_mask})
    out = worker.compute_log_probs(batch, temperature=0.7, with_sum_pi_squared=True)
    plain = worker.compute_log_probs(batch, temperature=0.7)
    torch.testing.assert_close(out["log_probs"], plain["log_probs"], atol=1e-5, rtol=0)
    ids = torch.cat([prompts, responses], dim=1)
    with torch.no_grad():
        logits = worker.model(input_ids=ids).logits[:, 4:-1].float() / 0.7
    want = torch.softmax(logits, -1).square().sum(-1) * response_mask
    torch.testing.assert_close(out["sum_pi_squared"], want, atol=1e-5, rtol=0)


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "rlx", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)


def test_bad_rollout_correction_values_are_config_errors(tmp_path):
    bad = ["algorithm.rollout_correction.loss_type=clip", "algorithm.rollout_correction.rollout_is=geo",
           "algorithm.rollout_correction.rollout_is_threshold=-1"]
    proc = run_cli(tmp_path, "config", "validate", "--preset", "tiny", *bad)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in text, text
    for item in bad:
        assert item.split("=")[0].removeprefix("algorithm.") in text, (item, text)
    proc = run_cli(tmp_path, "config", "validate", "--preset", "tiny", "algorithm.policy_loss=gspo",
                   "algorithm.rollout_correction.bypass_mode=true")
    assert proc.returncode == 2 and "would not be used" in proc.stdout + proc.stderr


def test_bypass_and_optimal_token_baseline_train(tmp_path):
    """Two steps each through the trainer: bypass mode skips the old-log-prob pass and logs its correction; the
    optimal token baseline runs the pass with sum_pi_squared."""
    common = ["train", "--preset", "tiny", "trainer.total_steps=2", "trainer.test_freq=-1",
              "trainer.val_before_train=false", "trainer.loggers=[jsonl]", "trainer.save_freq=0",
              "trainer.save_hf_model=false"]
    from rlx.plugins.loggers.jsonl import read_metrics

    rc = "algorithm.rollout_correction."
    proc = run_cli(tmp_path, *common, f"trainer.output_dir={tmp_path / 'bypass'}", "algorithm.policy_loss=bypass_mode",
                   rc + "rollout_rs=seq_max_k2", rc + "rollout_rs_threshold=1.0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "bypass")
    assert len(rows) == 2 and all("timing/old_log_prob" not in r for r in rows)
    assert all("rollout_corr/rs_masked_fraction" in r and "rollout_corr/kl" in r for r in rows)
    proc = run_cli(tmp_path, *common, f"trainer.output_dir={tmp_path / 'otb'}",
                   "algorithm.adv_estimator=optimal_token_baseline")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "otb")
    assert len(rows) == 2 and all("timing/old_log_prob" in r for r in rows)
    proc = run_cli(tmp_path, *common, f"trainer.output_dir={tmp_path / 'otb-mt'}",
                   "algorithm.adv_estimator=optimal_token_baseline", "backend.name=megatron")
    assert proc.returncode == 2 and "megatron backend does not" in proc.stdout + proc.stderr, proc.stderr[-2000:]
