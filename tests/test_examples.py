"""The examples stay runnable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_gsm8k_config_is_valid() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rlx", "config", "validate", "--config", str(EXAMPLES / "gsm8k_grpo.yaml"),
         "data.train_files=builtin:arith-train"], capture_output=True, text=True, env=dict(os.environ))
    assert result.returncode == 0, result.stderr


def test_train_tiny_example_runs(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_tiny.py"), "trainer.total_steps=2", "trainer.test_freq=-1",
         f"trainer.output_dir={tmp_path}", "trainer.loggers=[jsonl]"],
        capture_output=True, text=True, env=dict(os.environ), timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "final mean reward" in result.stdout
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
