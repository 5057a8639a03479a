"""Each algorithm learns the built-in task on the CPU: `rlx train --preset tiny --algorithm NAME`.

Thresholds come from measurements (80 steps, seeds 1-3, one torch thread; docs/algorithms.md has the
table): the mean reward of the first 5 steps was 0.111-0.135 for every algorithm, and of the last 10
steps 0.737-0.804 (grpo 0.765-0.783, rloo 0.737-0.792, reinforce_plus_plus 0.774-0.794, ppo
0.760-0.804). The tests ask for a last-10 mean of at least 0.6 and a rise of at least 0.4: below every
measured run, and far above what an untrained or broken policy reaches (about 0.12).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlx.plugins.loggers.jsonl import read_metrics

pytestmark = pytest.mark.slow

# Metrics each algorithm must report besides the common ones.
EXTRA_METRICS = {
    "grpo": ["actor/kl_loss"],
    "rloo": ["actor/reward_kl_penalty", "actor/reward_kl_coef"],
    "reinforce_plus_plus": ["actor/reward_kl_penalty", "actor/reward_kl_coef"],
    "ppo": ["critic/vf_loss", "critic/vf_clipfrac", "critic/vf_explained_var", "critic/values/mean",
            "critic/grad_norm"],
}


@pytest.mark.parametrize("algorithm", list(EXTRA_METRICS))
def test_algorithm_learns_the_builtin_task(tmp_path: Path, algorithm: str) -> None:
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "rlx", "train", "--preset", "tiny", "--algorithm", algorithm, "trainer.seed=1",
         "trainer.test_freq=-1", "trainer.loggers=[jsonl]", "trainer.save_freq=0", "trainer.save_hf_model=false",
         f"trainer.output_dir={run}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 81))
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    print(f"{algorithm}: reward first 5 steps {first:.3f}, last 10 steps {last:.3f}")
    assert last >= 0.6 and last >= first + 0.4, (first, last)
    for key in ["actor/pg_loss", "actor/pg_clipfrac_low", "actor/pg_clipfrac_high", "actor/ppo_kl", "actor/entropy",
                "critic/advantages/mean", "critic/returns/mean", *EXTRA_METRICS[algorithm]]:
        assert key in rows[-1], key
