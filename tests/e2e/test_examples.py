"""The examples stay runnable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_gsm8k_config_is_valid() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rlx", "config", "validate", "--config", str(EXAMPLES / "gsm8k_grpo.yaml"),
         "data.train_files=builtin:arith-train"], capture_output=True, text=True, env=dict(os.environ))
    assert result.returncode == 0, result.stderr


def test_agent_example_config_is_valid() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rlx", "config", "validate", "--config", str(EXAMPLES / "agent_python_gsm8k.yaml"),
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


def test_real_model_example_runs(tmp_path: Path) -> None:
    """examples/real_model/ as its README runs it, with the built-in tiny model standing in for SmolLM2
    (no hub here): the data preparation, `rlx data validate`, two training steps of the GPU config with the
    CPU layer over it, and `rlx eval` of the exported model. The recipe's numbers come from the GPU runs in
    examples/real_model/results/; this test keeps the files runnable."""
    import json

    folder = EXAMPLES / "real_model"
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def rlx(*args: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([sys.executable, "-m", "rlx", *args], capture_output=True, text=True, env=env,
                                timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]
        return result

    data = tmp_path / "data"
    made = subprocess.run([sys.executable, str(folder / "make_data.py"), "--task", "one_step", "--out", str(data),
                           "--train-size", "64", "--test-size", "16"], capture_output=True, text=True, env=env)
    assert made.returncode == 0, made.stderr
    for split in ("train", "test"):
        rlx("data", "validate", str(data / f"{split}.parquet"))
    train = {json.dumps(r) for r in _rows(data / "train.parquet")}
    assert not train & {json.dumps(r) for r in _rows(data / "test.parquet")}  # held out
    run = tmp_path / "run"
    # The built-in tokenizer spends more tokens on these prompts than SmolLM2's (160 vs about 60).
    rlx("train", "-c", str(folder / "config.yaml"), "-c", str(folder / "cpu.yaml"), "model.path=builtin:tiny-qwen2",
        f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
        "data.max_prompt_length=256", "trainer.total_steps=2", f"trainer.output_dir={run}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "val/acc" in rows[0]  # val_before_train, then 2 steps
    assert (run / "checkpoints" / "global_step_2").is_dir()
    rlx("eval", "--model", str(run / "hf_model"), "--data", str(data / "test.parquet"), "--reward", "gsm8k",
        "--max-tokens", "16", "--n", "2", "--temperature", "0.5", "--k", "1", "--k", "2",
        "-o", str(tmp_path / "e.json"))
    result = json.loads((tmp_path / "e.json").read_text())["metrics"]["all"]
    assert result["prompts"] == 16 and {"pass@2", "maj@2"} <= result.keys()


def _rows(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    return [{"prompt": r["prompt"], "answer": r["reward_model"]["ground_truth"]} for r in rows]
