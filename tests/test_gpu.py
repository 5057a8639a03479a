"""GPU paths: mixed precision training and bf16 rollouts on CUDA. Skipped where there is no GPU."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def test_actor_keeps_float32_master_weights_and_trains_under_autocast(tiny_model_path: str) -> None:
    import torch

    from rlx.plugins.backends.torch_local import TorchBackendOptions, TorchWorker
    from rlx.protocols import RoleSpec

    actor = TorchWorker(RoleSpec(role="actor", model_path=tiny_model_path, trainable=True, dtype="bfloat16"),
                        TorchBackendOptions(), "cuda")
    ref = TorchWorker(RoleSpec(role="ref", model_path=tiny_model_path, trainable=False, dtype="bfloat16"),
                      TorchBackendOptions(), "cuda")
    assert {p.dtype for p in actor.model.parameters()} == {torch.float32}
    assert {p.dtype for p in ref.model.parameters()} == {torch.bfloat16}
    assert actor.autocast and not ref.autocast


def test_short_grpo_run_on_cuda_in_bf16(tmp_path: Path) -> None:
    from rlx.registry import get_plugin_manager
    from rlx.trainer import Trainer
    from rlx.validate import load_config

    pm = get_plugin_manager()
    resolved = load_config(pm, preset="tiny", overrides=[
        "trainer.device=cuda", "model.dtype=bfloat16", "trainer.total_steps=3", "trainer.test_freq=-1",
        "trainer.loggers=[jsonl]", "trainer.save_hf_model=false", f"trainer.output_dir={tmp_path}"])
    metrics = Trainer(resolved, pm).fit()
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss"):
        assert math.isfinite(metrics[key]), key
    # The bf16 rollout engine and the autocast actor score the same tokens almost alike.
    assert metrics["rollout/log_prob_diff"] < 0.05
