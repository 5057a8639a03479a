"""Multi-turn rollouts end to end (issue 28): `rlx train --preset tiny_tools` with the hf engine and the real
calculator tool, one sequence per episode, tool output read and not trained.

Learning (marked `learning`), measured on seeds 42, 1 and 2 of this 2-core machine (docs/benchmarks.md): the
training reward (exact match of the final answer, sampled) was 0.09 / 0.10 / 0.11 at step 1, 0.23 / 0.35 / 0.30
over the first 3 steps and 0.91 / 0.86 / 0.85 over the last 5 of 40; sampled validation accuracy went from
0.06 / 0.08 / 0.11 to 0.93 / 0.92 / 0.88. The thresholds ask for a rise of 0.3 (the issue's 0.2, with a margin)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlx.plugins.loggers.jsonl import read_metrics


def rlx(*args: str, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "rlx", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_tiny_tools_trains_on_episodes_and_logs_agent_metrics(tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = rlx("train", "--preset", "tiny_tools", "trainer.total_steps=2", "trainer.test_freq=2",
                 "trainer.val_before_train=false", f"trainer.output_dir={run}", "trainer.loggers=[jsonl]",
                 "trainer.log_samples=4", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [r for r in read_metrics(run) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.3 < r["agent/tool_calls/mean"] <= 1.0  # about half the warm-started first turns call the tool
        assert 1.0 < r["agent/turns/mean"] <= 3.0
        assert 0.1 < r["agent/masked_token_share"] < 0.6  # the tool turns' tokens
        assert r["agent/tool_errors/mean"] < 0.2
        assert r["agent/end/answer"] + r["agent/end/max_turns"] + r["agent/end/budget"] == pytest.approx(1.0)
        assert r["response_length/max"] <= 64  # the whole episode stays within data.max_response_length
    assert "val/acc" in read_metrics(run)[-1]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert any("<tool_response>" in s.get("response", "") for s in samples), samples[:2]


def test_tiny_tools_one_step_off_policy(tmp_path: Path) -> None:
    """Asynchronous RL with episodes: the next step's episodes (engine turns and tool calls) run in the rollout
    thread beside training."""
    run = tmp_path / "run"
    result = rlx("train", "--preset", "tiny_tools", "trainer.max_staleness=1", "algorithm.tis_cap=2",
                 "trainer.total_steps=3", "trainer.test_freq=-1", "trainer.val_before_train=false",
                 f"trainer.output_dir={run}", "trainer.loggers=[jsonl]", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(run)
    assert [r["async/staleness/max"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["agent/tool_calls/mean"] > 0 for r in rows)


@pytest.mark.parametrize("args, expect", [
    (["agent.name=tool_call"], "agent.tools: agent loop 'tool_call' has no tools"),
    (["agent.name=tool_call", "agent.tools=[calculater]"], "No tool named 'calculater'"),
    (["--preset", "tiny_tools", "tools.calculator.max_digits=0"], "tools.calculator"),
    (["--preset", "tiny_tools", "tools.python.timeout_s=5"], "tools.python: options for a tool that is not on"),
    (["--preset", "tiny_tools", "trainer.max_staleness=2", "rollout.partial=true"],
     "rollout.partial: an episode of agent loop 'tool_call' is not continued"),
    (["--preset", "tiny_tools", "agent.max_turns=0"], "agent.max_turns"),
    (["--preset", "tiny_tools", "agent.format=chatml"], "agent.format"),
])
def test_agent_config_errors_exit_2(tmp_path: Path, args: list[str], expect: str) -> None:
    result = rlx("config", "validate", *args, cwd=tmp_path, timeout=120)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert expect in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.multiproc
def test_tiny_tools_with_a_rollout_pool(tmp_path: Path) -> None:
    """Episodes with the engine in processes of its own: every turn goes to the pool through the worker group."""
    run = tmp_path / "run"
    result = rlx("train", "--preset", "tiny_tools", "--nproc", "2", "launcher.rollout_nproc=1",
                 "trainer.total_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
                 f"trainer.output_dir={run}", "trainer.loggers=[jsonl]", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert all(r["agent/tool_calls/mean"] > 0.3 for r in read_metrics(run))


@pytest.mark.learning
def test_tiny_tools_learns_to_call_the_tool_and_copy_its_result(tmp_path: Path) -> None:
    result = rlx("train", "--preset", "tiny_tools", "trainer.save_hf_model=false", cwd=tmp_path, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "outputs" / "rlx" / "tiny-tools-grpo")
    train = [r for r in rows if "reward/mean" in r]
    assert len(train) == 40
    first = sum(r["reward/mean"] for r in train[:3]) / 3
    last = sum(r["reward/mean"] for r in train[-5:]) / 5
    print(f"reward first 3 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last - first >= 0.3, (first, last)
    assert sum(r["agent/tool_calls/mean"] for r in train[-5:]) / 5 > 0.8  # it learned to call the tool
    acc = {r["step"]: r["val/acc"] for r in rows if "val/acc" in r}
    assert acc[40] - acc[0] >= 0.3, acc
