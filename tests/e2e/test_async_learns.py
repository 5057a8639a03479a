"""Asynchronous RL learns the built-in job like the synchronous loop (issue 27): `rlx train
trainer.max_staleness=1 algorithm.tis_cap=2`, the default job's 120 steps, each trained on rollouts one
policy version old.

Measured on this 2-core machine (docs/benchmarks.md), final greedy accuracy on the built-in test set: with
the lag corrected (tis_cap=2) 0.93, 0.97 and 0.83 on seeds 42 (the default), 2 and 3; without a
correction 0.84, 0.56 and 0.90 on seeds 42, 2 and 3 (seed 2 reached 0.98 at step 100 and fell back), which is
why the run says to set a correction. The synchronous job ends at 0.88-1.00 on seeds 1-5.

One greedy evaluation is not a steady measure of a run this small: on CI's machine (2026-12-05, another x86 CPU,
so another trajectory of the same seed) the corrected run read 0.79 / 0.97 / 0.95 / 0.98 at steps 40-100 and
0.52 at step 120, its sampled reward 0.83 over the last 10 steps. So the run is judged by the mean of its last
three evaluations (steps 80, 100, 120: 0.82 there, 0.87 here today, 0.92 / 0.94 / 0.81 on seeds 42 / 2 / 3 when
the table in docs/benchmarks.md was measured) against 0.6, every one of them against 0.3, and the sampled
reward's rise against 0.4: far above chance (accuracy 0.02, rise about 0).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlx.plugins.loggers.jsonl import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.learning]


def test_one_step_off_policy_default_job_learns(tmp_path: Path) -> None:
    env = dict(os.environ)
    result = subprocess.run([sys.executable, "-m", "rlx", "train", "trainer.max_staleness=1", "algorithm.tis_cap=2",
                             "trainer.save_hf_model=false"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=1200, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "outputs" / "rlx" / "tiny-grpo")
    train = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in train] == list(range(1, 121))
    assert max(r["async/staleness/max"] for r in train) == 1.0 and train[0]["async/staleness/max"] == 0.0
    assert all(r["async/staleness/mean"] == 1.0 for r in train[1:])
    acc = {r["step"]: r["val/acc"] for r in rows if "val/acc" in r}
    rewards = [r["reward/mean"] for r in train]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    print(f"accuracy {acc}, reward first 5 steps {first:.3f}, last 10 steps {last:.3f}")
    assert acc[0] <= 0.2, acc
    late = [acc[step] for step in (80, 100, 120)]
    assert sum(late) / 3 >= 0.6 and min(late) >= 0.3, acc
    assert last >= first + 0.4, (first, last)
    assert "actor/tis_weight_mean" in train[-1]
