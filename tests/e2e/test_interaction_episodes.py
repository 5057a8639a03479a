"""Episodes with an interaction end to end: `rlx train --preset tiny_tools` with the hf engine, the calculator tool
and the built-in gsm8k interaction (verl's run_qwen2.5-3b_gsm8k_multiturn_4xgpu.sh in small: tools and a simulated
user), on the CPU. The tiny model answers "What is A+B?" with a bare number, so the interaction reads the last
number (method=flexible). A verl-style reward function reads the interaction's turn scores from extra_info."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlx.plugins.loggers.jsonl import read_metrics

# verl's reward signature; 1.0 when the interaction's last score was 1 (it ended the episode on a right answer).
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    scores = extra_info["turn_scores"]
    return 1.0 if scores and scores[-1] == 1.0 else 0.0
'''


def test_tiny_tools_with_the_gsm8k_interaction(tmp_path: Path) -> None:
    run = tmp_path / "run"
    reward = tmp_path / "turn_reward.py"
    reward.write_text(REWARD)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "rlx", "train", "--preset", "tiny_tools", "agent.interactions=[gsm8k]",
         "interactions.gsm8k.method=flexible", "interactions.gsm8k.incorrect_message=Wrong, try again.",
         "data.max_response_length=128", "reward.name=custom", f"reward.path={reward}", "trainer.total_steps=2",
         "trainer.test_freq=-1", "trainer.val_before_train=false", f"trainer.output_dir={run}",
         "trainer.loggers=[jsonl]", "trainer.log_samples=8"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [r for r in read_metrics(run) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.3 < r["agent/interaction_turns/mean"] <= 2.0  # agent.max_turns=3: at most two are answered
        assert 0.0 < r["agent/turn_score/mean"] < 1.0
        assert r["agent/end/answer"] + r["agent/end/max_turns"] + r["agent/end/budget"] == pytest.approx(1.0)
        # Only the interaction ends an episode as answered, and the reward reads its last score: the two agree.
        assert r["reward/mean"] == pytest.approx(r["agent/end/answer"])
        assert 0.1 < r["agent/masked_token_share"] < 0.9  # tool turns and user turns are read, not trained
        assert r["response_length/max"] <= 128
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert any("\nuser\nWrong, try again.\nassistant\n" in s["response"] for s in samples), samples[:2]
