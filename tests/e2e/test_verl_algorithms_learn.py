"""verl's further estimators and policy losses (issue 29) learn the built-in task: `rlx train --preset tiny` with
one of them, seed 1, greedy exact-match accuracy on builtin:arith-test as in test_algorithms_learn.py; 80 steps,
or 120 for the four losses that learn at lr 3e-4 (below).

Measured on this 2-core machine, 2026-12-07 (final accuracy; reward rise, the mean of the last 10 steps minus the
first 5), with grpo, the preset's default, at 0.93 (seed 1) for comparison. Seed 1 at 80 steps:

    adv_estimator=opo                         0.93  rise 0.48
    adv_estimator=grpo_passk                  0.87  rise 0.17
    adv_estimator=gpg                         0.92  rise 0.72
    adv_estimator=optimal_token_baseline      0.73  rise 0.36
    adv_estimator=tir_optimal_token_baseline  0.74  rise 0.35
    policy_loss=clip_cov                      0.81  rise 0.62
    policy_loss=geo_mean                      0.92  rise 0.72
    policy_loss=bypass_mode                   0.91  rise 0.64

Earlier seeds 2 and 3 of these, on an engine whose micro-batches (and so float sums) differed, accuracy (rise):
opo 0.92 0.69 (0.60 0.42), grpo_passk 0.32 0.27 (0.05 0.05), gpg 0.97 0.91 (0.77 0.71), optimal_token_baseline
0.69 0.57 (0.30 0.27), tir 0.97 0.82 (0.73 0.53), clip_cov 0.92 0.94 (0.72 0.79), geo_mean 0.99 1.00 (0.82
0.85), bypass_mode 0.95 0.95 (0.80 0.72).

The losses without a hard clip on the ratio (sapo: a soft gate; gpg: -A log pi; cispo: a clipped but detached
weight times log pi; kl_cov: a KL penalty on a few tokens only) push a sample's log-prob further over the
preset's 2 epochs of 4 mini-batches each than PPO's clip lets it go. At the preset's actor lr of 1e-3 they learn
unevenly: sapo seeds 1-5 gave 0.36 0.80 0.82 0.52 0.29 at step 80 (seed 1 with rise 0.07: it failed CI's run
with the old threshold of 0.1), and gpg 0.35 0.10 0.39, cispo 0.36 0.23 0.24, kl_cov 0.20 0.38 0.68 earlier.
At lr 3e-4 every seed learns, but late: most sit at the most frequent answer (0.10) to step 40-60 and rise
after it, so step 80 cuts through the rise (0.30-0.77). They are tested at lr 3e-4 over the preset's 120 steps:

    policy_loss=sapo    seeds 1-6  0.98 0.82 0.94 0.97 0.99 0.99   rise 0.82 0.65 0.84 0.82 0.84 0.85
    policy_loss=cispo   seeds 1-3  0.91 0.89 0.94                  rise 0.80 0.82 0.82
    policy_loss=kl_cov  seeds 1-3  0.98 0.71 0.97                  rise 0.80 0.53 0.82
    policy_loss=gpg     seeds 1-3  0.92 0.74 0.81                  rise 0.71 0.52 0.68

grpo_passk trains only each group's best response (pass@k, not the mean reward, is what it improves), so its
reward hardly rises and only its accuracy is checked. On single-turn responses tir_optimal_token_baseline is
optimal_token_baseline with handle_zero_tail on; it has the same thresholds. Every threshold sits well below the
least measured value and above 0.10, where a run that does not learn stays (it finds the most frequent answer by
step 20: gpg at lr 1e-3, seed 2, ended at 0.10). Twelve runs, two at a time (about 6 minutes on 2 cores).
"""

from __future__ import annotations

from pathlib import Path
from subprocess import CompletedProcess

import pytest
from test_algorithms_learn import learning_curve, train_selected

pytestmark = [pytest.mark.slow, pytest.mark.learning]

STEPS = 80
LONGER = {"sapo": 120, "cispo": 120, "kl_cov": 120, "gpg_loss": 120}  # steps where not STEPS
SLOW_LR = ["actor.optim.lr=0.0003"]
# name: (overrides, least final accuracy, least reward rise or None, metrics it must report)
CASES: dict[str, tuple[list[str], float, float | None, list[str]]] = {
    "opo": (["algorithm.adv_estimator=opo"], 0.35, 0.2, []),
    "grpo_passk": (["algorithm.adv_estimator=grpo_passk"], 0.15, None, []),
    "gpg_estimator": (["algorithm.adv_estimator=gpg"], 0.5, 0.3, []),
    "optimal_token_baseline": (["algorithm.adv_estimator=optimal_token_baseline"], 0.3, 0.1, []),
    "tir_optimal_token_baseline": (["algorithm.adv_estimator=tir_optimal_token_baseline"], 0.3, 0.1, []),
    "sapo": (["algorithm.policy_loss=sapo", *SLOW_LR], 0.4, 0.25, []),
    "clip_cov": (["algorithm.policy_loss=clip_cov"], 0.3, 0.15, []),
    "geo_mean": (["algorithm.policy_loss=geo_mean"], 0.5, 0.3, []),
    "bypass_mode": (["algorithm.policy_loss=bypass_mode"], 0.5, 0.3,
                    ["rollout_corr/is_weight_mean", "rollout_corr/kl", "rollout_corr/chi2_token"]),
    "cispo": (["algorithm.policy_loss=cispo", *SLOW_LR], 0.4, 0.25, []),
    "kl_cov": (["algorithm.policy_loss=kl_cov", *SLOW_LR], 0.4, 0.25, []),
    "gpg_loss": (["algorithm.policy_loss=gpg", *SLOW_LR], 0.4, 0.25, []),
}


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> dict[str, tuple[CompletedProcess, Path]]:
    return train_selected(request, tmp_path_factory.mktemp("learn-verl"), "name",
                          lambda n: (CASES[n][0], LONGER.get(n, STEPS)))


@pytest.mark.parametrize("name", list(CASES))
def test_verl_algorithm_learns_the_builtin_task(runs, name: str) -> None:
    _, min_acc, min_rise, extra = CASES[name]
    steps = LONGER.get(name, STEPS)
    train_rows, val, rise = learning_curve(name, *runs[name], steps)
    assert val[steps] >= min_acc, f"final exact-match accuracy {val[steps]:.2f} < {min_acc} ({val})"
    if min_rise is not None:
        assert rise >= min_rise, rise
    for key in ["actor/pg_loss", "actor/entropy", "critic/advantages/mean", *extra]:
        assert key in train_rows[-1], key
