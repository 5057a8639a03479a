"""The registered advantage estimators pass every input they are documented to use (gamma, lam, the
group index, the baseline scores, the critic's values) on to the math, and say what they are missing.
Checked through the plugin manager, as the algorithm calls them, on hand-computed returns."""

from __future__ import annotations

import pytest
import torch

from rlx.plugins.algorithms import functional as F
from rlx.protocols import EstimatorInputs
from rlx.registry import PluginManager


@pytest.fixture(scope="module")
def estimators():
    pm = PluginManager()
    pm.load_entry_points(strict=False, disabled=[])
    return lambda name: pm.get("advantage", name).load_factory()


def one_reward_at_the_end(**kwargs) -> EstimatorInputs:
    """Two responses of 3 tokens, reward 1 on the last token of the first and 0 for the second."""
    mask = torch.ones(2, 3)
    rewards = torch.zeros(2, 3)
    rewards[0, 2] = 1.0
    return EstimatorInputs(response_mask=mask, scores=rewards.sum(-1), token_level_rewards=rewards,
                           group_index=torch.tensor([0, 0]), **kwargs)


def test_reinforce_plus_plus_discounts_with_gamma(estimators):
    _, returns = estimators("reinforce_plus_plus")(one_reward_at_the_end(gamma=0.5))
    torch.testing.assert_close(returns[0], torch.tensor([0.25, 0.5, 1.0]))


def test_gae_uses_gamma_and_lambda(estimators):
    inputs = one_reward_at_the_end(gamma=0.5, lam=0.8, values=torch.zeros(2, 3))
    _, returns = estimators("gae")(inputs)
    torch.testing.assert_close(returns[0], torch.tensor([0.16, 0.4, 1.0]))  # (gamma * lam)^k with V = 0


def test_group_baselines_use_the_group_index(estimators):
    scores = torch.tensor([1.0, 0.0, 0.5, 0.25])
    index = torch.tensor([7, 7, 9, 9])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    inputs = EstimatorInputs(response_mask=mask, scores=scores, token_level_rewards=torch.zeros(4, 3),
                             group_index=index)
    adv, ret = estimators("reinforce_plus_plus_baseline")(inputs)
    want_adv, want_ret = F.reinforce_plus_plus_baseline_advantages(scores, index, mask)
    torch.testing.assert_close(adv, want_adv)
    torch.testing.assert_close(ret, want_ret)
    # Group means 0.5 and 0.375: the first and third responses are above their groups' means.
    assert adv[0, 0] > 0 > adv[1, 0] and adv[2, 0] > 0 > adv[3, 0]
    assert bool((adv[mask == 0] == 0).all())


def test_remax_subtracts_the_greedy_score(estimators):
    inputs = one_reward_at_the_end(baseline_scores=torch.tensor([0.25, 0.5]), norm_adv_by_std=False)
    adv, _ = estimators("remax")(inputs)
    torch.testing.assert_close(adv, torch.tensor([[0.75] * 3, [-0.5] * 3]))


def test_remax_divides_by_the_root_mean_square(estimators):
    """norm_adv_by_std (remax's default): s - b divided by its root mean square over the real tokens, not
    whitened: no batch mean is subtracted, so the greedy baseline alone decides each advantage's sign."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    scores = torch.tensor([1.0, 1.0, 0.0])

    def remax(baseline: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
        return estimators("remax")(EstimatorInputs(
            response_mask=mask, scores=scores, token_level_rewards=torch.zeros(3, 3),
            group_index=torch.tensor([0, 1, 2]), baseline_scores=torch.tensor(baseline)))

    # s - b = 1, 0.5, 0 on 2, 1 and 3 tokens: mean square (1 + 1 + 0.25 + 0) / 6 = 0.375
    adv, returns = remax([0.0, 0.5, 0.0])
    rms = 0.375 ** 0.5
    torch.testing.assert_close(adv, torch.tensor([[1 / rms] * 2 + [0.0], [0.5 / rms, 0.0, 0.0], [0.0] * 3]))
    torch.testing.assert_close(returns, scores[:, None] * mask)  # the returns stay the scores
    # Every response better than its greedy one by the same amount: whitening would give 0, scaling gives 1.
    adv, _ = remax([0.5, 0.5, -0.5])
    torch.testing.assert_close(adv, mask)
    # Every response as good as its greedy one: 0, not 0 / 0.
    adv, _ = remax([1.0, 1.0, 0.0])
    assert bool((adv == 0).all())


@pytest.mark.parametrize(("name", "needs"), [("gae", "needs the critic's values"),
                                             ("remax", "needs baseline_scores (greedy-response scores)")])
def test_missing_inputs_are_named(estimators, name, needs):
    with pytest.raises(RuntimeError) as exc:
        estimators(name)(one_reward_at_the_end())
    assert str(exc.value) == f"the {name} estimator {needs}"
