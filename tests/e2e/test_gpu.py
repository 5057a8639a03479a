"""GPU paths: mixed precision training and bf16 rollouts on CUDA. Skipped where there is no GPU."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def test_actor_keeps_float32_master_weights_and_trains_under_autocast(tiny_model_path: str) -> None:
    import torch

    from rlx.batch import Batch
    from rlx.plugins.algorithms.grpo import GRPOLoss, GRPOOptions
    from rlx.plugins.modeling.worker import TorchBackendOptions, TorchWorker
    from rlx.protocols import RoleSpec

    actor = TorchWorker(RoleSpec(role="actor", model_path=tiny_model_path, trainable=True, dtype="bfloat16"),
                        TorchBackendOptions(), "cuda")
    ref = TorchWorker(RoleSpec(role="ref", model_path=tiny_model_path, trainable=False, dtype="bfloat16"),
                      TorchBackendOptions(), "cuda")
    assert {p.dtype for p in ref.model.parameters()} == {torch.bfloat16}
    # A training step's layer outputs are bf16 (autocast) while the weights stay float32.
    seen: list[torch.dtype] = []
    layer = actor.model.model.layers[0].mlp.down_proj
    layer.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    g = torch.Generator().manual_seed(0)
    batch = Batch({"prompts": torch.randint(3, 60, (4, 5), generator=g),
                   "prompt_mask": torch.ones(4, 5, dtype=torch.long),
                   "responses": torch.randint(3, 60, (4, 3), generator=g),
                   "response_mask": torch.ones(4, 3, dtype=torch.long),
                   "old_log_probs": torch.zeros(4, 3), "advantages": torch.ones(4, 3)})
    metrics = actor.train_step(batch, GRPOLoss(GRPOOptions(use_kl_loss=False)))
    assert seen and set(seen) == {torch.bfloat16}
    assert {p.dtype for p in actor.model.parameters()} == {torch.float32}
    assert math.isfinite(metrics["grad_norm"]) and metrics["skipped_step"] == 0.0


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
    assert metrics["rollout/logprob_diff_mean"] < 0.05
