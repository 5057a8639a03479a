"""`rlx export`: a Hugging Face folder from a run's checkpoint, written by the backend that trained it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlx.run import checkpoint

pytestmark = pytest.mark.slow

TINY = ["--preset", "tiny", "trainer.test_freq=-1", "trainer.loggers=[jsonl]", "trainer.save_hf_model=false",
        "trainer.total_steps=2", "trainer.save_freq=1"]


def rlx(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rlx", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def same_weights(folder: Path, reference: dict[str, torch.Tensor]) -> bool:
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    return all(torch.equal(state[k], v) for k, v in reference.items())


@pytest.mark.parametrize("backend", ["torch", "fsdp2"])
def test_export_writes_the_checkpoints_weights(tmp_path: Path, backend: str) -> None:
    from safetensors.torch import load_file

    run = tmp_path / "run"
    trained = rlx("train", *TINY, f"--backend={backend}", "--nproc=2", f"trainer.output_dir={run}", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    # the reference: the torch backend's own file, or the fsdp2 run's final weights exported at the end
    first, last = run / "checkpoints" / "global_step_1", run / "checkpoints" / "global_step_2"
    out = tmp_path / "hf"
    result = rlx("export", str(run), "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "global_step_2" in result.stdout
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()}
    older = tmp_path / "hf1"
    assert rlx("export", str(first), "--out", str(older), cwd=tmp_path).returncode == 0
    if backend == "torch":
        assert same_weights(out, load_file(last / "actor" / "model.safetensors"))
        assert same_weights(older, load_file(first / "actor" / "model.safetensors"))
        # A run trained on a GPU with flash-attn exports on a machine without either: the kernel is not
        # part of the weights.
        import yaml

        config = yaml.safe_load((run / "config.yaml").read_text())
        config["backend"]["attn_implementation"] = "flash_attention_2"
        (run / "config.yaml").write_text(yaml.safe_dump(config))
        flash = tmp_path / "hf-flash"
        result = rlx("export", str(run), "--out", str(flash), cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        assert same_weights(flash, load_file(last / "actor" / "model.safetensors"))
    else:
        from transformers import AutoModelForCausalLM

        a = AutoModelForCausalLM.from_pretrained(out).state_dict()
        b = AutoModelForCausalLM.from_pretrained(older).state_dict()
        assert any(not torch.equal(a[k], b[k]) for k in a), "two checkpoints, two sets of weights"


def test_export_refuses_damaged_checkpoints_and_occupied_folders(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert rlx("train", *TINY, f"trainer.output_dir={run}", cwd=tmp_path).returncode == 0
    out = tmp_path / "hf"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    busy = rlx("export", str(run), "--out", str(out), cwd=tmp_path)
    assert busy.returncode == 2 and "already holds files" in busy.stderr and "Traceback" not in busy.stderr
    assert (out / "mine.txt").read_text() == "keep"
    weights = run / "checkpoints" / "global_step_2" / "actor" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    damaged = rlx("export", str(run / "checkpoints" / "global_step_2"), "--out", str(tmp_path / "x"), cwd=tmp_path)
    assert damaged.returncode == 2 and "cannot be trusted" in damaged.stderr and "Traceback" not in damaged.stderr
    fallback = rlx("export", str(run), "--out", str(tmp_path / "y"), cwd=tmp_path)
    assert fallback.returncode == 0, fallback.stderr[-2000:]
    assert "global_step_2 cannot be trusted" in fallback.stderr and "global_step_1" in fallback.stdout
    assert checkpoint.verify(run / "checkpoints" / "global_step_1") is None
