"""verl's further estimators and policy losses (issue 29) learn the built-in task: `rlx train --preset tiny` with
one of them, seed 1, 80 steps, greedy exact-match accuracy on builtin:arith-test as in test_algorithms_learn.py.

Measured on this 2-core machine, seeds 1, 2 and 3 (final accuracy at step 80; reward rise, the mean of the last 10
steps minus the first 5), with grpo, the preset's default, at 0.93 (seed 1) for comparison:

    adv_estimator=opo                      0.80 0.92 0.69   rise 0.53 0.60 0.42
    adv_estimator=grpo_passk               0.75 0.32 0.27   rise 0.15 0.05 0.05
    adv_estimator=gpg                      0.98 0.97 0.91   rise 0.86 0.77 0.71
    adv_estimator=optimal_token_baseline   0.97 0.69 0.57   rise 0.70 0.30 0.27
    adv_estimator=tir_optimal_token_baseline  0.81 0.97 0.82  rise 0.38 0.73 0.53
    policy_loss=sapo                       0.78 0.44 0.74   rise 0.50 0.22 0.67
    policy_loss=clip_cov                   0.80 0.92 0.94   rise 0.65 0.72 0.79
    policy_loss=geo_mean                   0.98 0.99 1.00   rise 0.85 0.82 0.85
    policy_loss=bypass_mode                0.96 0.95 0.95   rise 0.76 0.80 0.72
    policy_loss=cispo, lr 3e-4             0.53 0.66 0.56   rise 0.18 0.31 0.28
    policy_loss=kl_cov, lr 3e-4            0.53 0.50 0.60   rise 0.19 0.22 0.23
    policy_loss=gpg, lr 3e-4               0.33 0.25 0.49   rise 0.09 0.15 0.17

Seeds 1 and 2 of the first eight rows and the unclipped losses at lr 1e-3 were measured before the hf engine's
default micro-batch changed (cadb9f1: another sampling order, so another trajectory of the same seed); on today's
engine seed 1 gave 0.82, 0.82, 0.85, 0.76, 0.81 (tir_optimal_token_baseline), 0.66, 0.58, 0.89, 0.78, 0.53, 0.53
and 0.33 in the order of CASES below (docs/algorithms.md has the table).

The three losses without a clipped ratio (gpg: -A log pi; cispo: a clipped but detached weight times log pi; kl_cov:
a KL penalty on a few tokens only) push a negative sample's log-prob down without bound over the preset's 2 epochs
of 4 mini-batches each; at the preset's actor lr of 1e-3 they learn weakly and unevenly (gpg 0.35 0.10 0.39,
cispo 0.36 0.23 0.24, kl_cov 0.20 0.38 0.68; one epoch, or one mini-batch per step, was no better), so they are
tested at lr 3e-4, where they learn on every seed. grpo_passk trains only each group's best response (pass@k, not
the mean reward, is what it improves), so its reward hardly rises and only its accuracy is checked. On single-turn
responses tir_optimal_token_baseline is optimal_token_baseline with handle_zero_tail on; it has the same
thresholds. Every
threshold sits well below the least measured value and above 0.10, where a run that does not learn stays (it finds
the most frequent answer by step 20: gpg at lr 1e-3, seed 2, ended at 0.10). Twelve runs, two at a time (about 8
minutes on 2 cores).
"""

from __future__ import annotations

from pathlib import Path
from subprocess import CompletedProcess

import pytest
from test_algorithms_learn import learning_curve, train_selected

pytestmark = [pytest.mark.slow, pytest.mark.learning]

STEPS = 80
SLOW_LR = ["actor.optim.lr=0.0003"]
# name: (overrides, least final accuracy, least reward rise or None, metrics it must report)
CASES: dict[str, tuple[list[str], float, float | None, list[str]]] = {
    "opo": (["algorithm.adv_estimator=opo"], 0.35, 0.2, []),
    "grpo_passk": (["algorithm.adv_estimator=grpo_passk"], 0.15, None, []),
    "gpg_estimator": (["algorithm.adv_estimator=gpg"], 0.5, 0.3, []),
    "optimal_token_baseline": (["algorithm.adv_estimator=optimal_token_baseline"], 0.3, 0.1, []),
    "tir_optimal_token_baseline": (["algorithm.adv_estimator=tir_optimal_token_baseline"], 0.3, 0.1, []),
    "sapo": (["algorithm.policy_loss=sapo"], 0.25, 0.1, []),
    "clip_cov": (["algorithm.policy_loss=clip_cov"], 0.3, 0.15, []),
    "geo_mean": (["algorithm.policy_loss=geo_mean"], 0.5, 0.3, []),
    "bypass_mode": (["algorithm.policy_loss=bypass_mode"], 0.5, 0.3,
                    ["rollout_corr/is_weight_mean", "rollout_corr/kl", "rollout_corr/chi2_token"]),
    "cispo": (["algorithm.policy_loss=cispo", *SLOW_LR], 0.3, 0.1, []),
    "kl_cov": (["algorithm.policy_loss=kl_cov", *SLOW_LR], 0.3, 0.1, []),
    "gpg_loss": (["algorithm.policy_loss=gpg", *SLOW_LR], 0.15, 0.04, []),
}


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> dict[str, tuple[CompletedProcess, Path]]:
    return train_selected(request, tmp_path_factory.mktemp("learn-verl"), "name", lambda n: (CASES[n][0], STEPS))


@pytest.mark.parametrize("name", list(CASES))
def test_verl_algorithm_learns_the_builtin_task(runs, name: str) -> None:
    _, min_acc, min_rise, extra = CASES[name]
    train_rows, val, rise = learning_curve(name, *runs[name], STEPS)
    assert val[STEPS] >= min_acc, f"final exact-match accuracy {val[STEPS]:.2f} < {min_acc} ({val})"
    if min_rise is not None:
        assert rise >= min_rise, rise
    for key in ["actor/pg_loss", "actor/entropy", "critic/advantages/mean", *extra]:
        assert key in train_rows[-1], key
