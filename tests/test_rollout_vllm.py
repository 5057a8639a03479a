"""The ``vllm`` rollout engine: the engine contract (``rlx.testing``) on vLLM's CPU build, and its config
errors. Tests marked ``vllm`` skip without vllm; the missing-package message is checked where it is missing."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

from rlx.testing import RolloutEngineContract

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
