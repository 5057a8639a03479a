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
