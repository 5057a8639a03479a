"""The ``vllm`` rollout engine: the engine contract (``rlx.plugins.testing``) on vLLM's CPU build, and its config
errors. Tests marked ``vllm`` skip without vllm; the missing-package message is checked where it is missing."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from typing import Any

import pytest

from rlx.plugins.testing import RolloutEngineContract

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="module", autouse=True)
def _small_kv_cache():
    """vLLM's CPU build would reserve several GiB of KV cache by default; the tiny policies need little."""
    old = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    yield
    if old is None:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    else:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = old


@pytest.mark.vllm
class TestVLLMEngineContract(RolloutEngineContract):
    def make_engine(self, model_path: str, tokenizer: Any) -> Any:
        from rlx.plugins.rollout.vllm import VLLMRollout, VLLMRolloutOptions

        options = VLLMRolloutOptions(dtype="float32", enforce_eager=True, kv_cache_space_gb=1,
                                     weight_bucket_mb=0.01)  # several RPC calls per update
        return VLLMRollout(model_path, options, eos_token_ids=[tokenizer.eos_token_id],
                           pad_token_id=tokenizer.pad_token_id, seed=0, max_model_len=256)


def rlx_train(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "rlx", "train", "--rollout", "vllm",
                           f"trainer.output_dir={tmp_path / 'run'}", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(HAS_VLLM, reason="checks the message shown when vllm is not installed")
def test_without_vllm_one_message_with_the_install_command(tmp_path):
    res = rlx_train(tmp_path)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    assert "needs the Python package `vllm`" in res.stderr and "pip install 'rlx[vllm]'" in res.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.vllm
def test_bad_engine_options_are_config_errors_before_anything_starts(tmp_path):
    res = rlx_train(tmp_path, "rollout.engine_kwargs={max_num_seq: 4, worker_extension_cls: x}",
                    "rollout.tensor_parallel_size=64")
    assert res.returncode == 2, res.stderr
    err = res.stderr
    assert "Traceback" not in err and "EngineCore" not in err + res.stdout  # no engine was started
    assert "engine_kwargs.max_num_seq: the installed vLLM" in err and "Did you mean 'max_num_seqs'?" in err
    assert "engine_kwargs.worker_extension_cls: set by rlx" in err
    assert "rollout.tensor_parallel_size: 64 is more than the devices this machine has" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    for bad in ("1.5", "0"):
        res = rlx_train(tmp_path, f"rollout.gpu_memory_utilization={bad}")
        assert res.returncode == 2 and "rollout.gpu_memory_utilization" in res.stderr, res.stderr


@pytest.mark.vllm
def test_an_option_the_installed_vllm_lacks_is_named(monkeypatch):
    from rlx.plugins.rollout import vllm as plugin

    known, version = plugin.engine_arg_fields()
    monkeypatch.setattr(plugin, "engine_arg_fields", lambda: (known - {"enable_prefix_caching"}, version))
    opts = plugin.VLLMRolloutOptions(enable_prefix_caching=False)
    assert opts.plugin_problems(None) == [
        f"enable_prefix_caching: the installed vLLM {version} has no engine argument 'enable_prefix_caching'; remove "
        "the option or install a vLLM that supports it."]
    assert plugin.VLLMRolloutOptions().plugin_problems(None) == []  # only options that were set are checked
