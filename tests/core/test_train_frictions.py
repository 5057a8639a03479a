"""Frictions a new user met following the README (issue 33), as the `rlx` command shows them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml


def rlx(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RLX_CACHE": str(tmp_path / "cache"), "NO_COLOR": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "rlx", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


def test_default_run_folder_carries_the_algorithm(tmp_path: Path) -> None:
    """`rlx train` and `rlx train --algorithm ppo` in one folder get two run folders, not one."""
    for algorithm in (None, "ppo", "rloo"):
        proc = rlx(tmp_path, "config", "show", *(["--algorithm", algorithm] if algorithm else []))
        assert proc.returncode == 0, proc.stderr
        trainer = yaml.safe_load(proc.stdout)["trainer"]
        assert trainer["experiment"] == f"tiny-{algorithm or 'grpo'}", trainer


def test_missing_model_mentions_the_preset(tmp_path: Path) -> None:
    """A config file replaces the preset; the error for the missing model says how to get it back."""
    config = tmp_path / "mine.yaml"
    config.write_text("actor:\n  optim:\n    lr: 0.0001\n")
    proc = rlx(tmp_path, "config", "validate", "--config", str(config))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "model.path: no model given" in proc.stderr and "--preset tiny" in proc.stderr, proc.stderr


TINY = ["train", "--preset", "tiny", "trainer.test_freq=-1", "trainer.loggers=[jsonl]", "trainer.save_hf_model=false",
        "trainer.total_steps=1"]


def test_changed_run_is_refused_and_record_written_once(tmp_path: Path) -> None:
    """A finished GRPO run asked to resume as RLOO or with another reward is refused (exit 2, the differences
    named); asked again unchanged, it says it has nothing to do; its config.yaml and provenance.json stay."""
    run = tmp_path / "run"
    first = rlx(tmp_path, *TINY, f"trainer.output_dir={run}")
    assert first.returncode == 0, first.stderr[-2000:]
    record = {name: (run / name).read_bytes() for name in ("config.yaml", "provenance.json")}
    for change, words in ((["--algorithm", "rloo"], "algorithm.name: 'grpo' -> 'rloo'"),
                          (["--reward", "format"], "reward.name: 'arith' -> 'format'"),
                          (["trainer.seed=7"], "trainer.seed: 42 -> 7")):
        proc = rlx(tmp_path, *TINY, *change, f"trainer.output_dir={run}")
        assert proc.returncode == 2, (change, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr and words in proc.stderr, proc.stderr
        assert "trainer.experiment=NAME" in proc.stderr
    done = rlx(tmp_path, *TINY, f"trainer.output_dir={run}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Run already finished at step 1/1; nothing to do" in done.stdout
    assert "trainer.total_steps=2" in done.stdout
    assert {name: (run / name).read_bytes() for name in record} == record


def test_a_finished_reward_model_run_is_left_as_it_is(tmp_path: Path) -> None:
    run = tmp_path / "rm"
    first = rlx(tmp_path, "rm", "train", "trainer.total_steps=3", f"trainer.output_dir={run}")
    assert first.returncode == 0, first.stderr[-2000:]
    record = {p: p.read_bytes() for p in [run / "config.yaml", run / "metrics.jsonl",
                                          *sorted((run / "hf_model").iterdir())]}
    again = rlx(tmp_path, "rm", "train", "trainer.total_steps=2", f"trainer.output_dir={run}")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "Run already finished at step 3/2; nothing to do" in again.stdout
    assert {p: p.read_bytes() for p in record} == record  # config, metrics and model untouched
    changed = rlx(tmp_path, "rm", "train", "trainer.total_steps=6", "optim.lr=3e-4", f"trainer.output_dir={run}")
    assert changed.returncode == 2 and "Traceback" not in changed.stderr
    assert "optim.lr: 0.001 -> 0.0003" in changed.stderr and "trainer.experiment=NAME" in changed.stderr
