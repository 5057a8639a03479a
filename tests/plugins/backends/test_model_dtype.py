"""``actor.model_dtype`` / ``critic.model_dtype``: float32 master weights (the default) or pure bf16 training
weights, gradients and AdamW moments (half the trained role's memory, as TRL and verl's
``fsdp_config.model_dtype=bf16``)."""

from __future__ import annotations

from typing import Literal

import pytest
import torch
from test_backend_torch import critic_batch, grpo_loss, make_batch

from rlx.config import validate
from rlx.errors import ConfigError
from rlx.plugins.modeling.worker import TorchBackendOptions, TorchWorker
from rlx.protocols import RoleSpec
from rlx.records import ForwardOptions
from rlx.step import role_settings


@pytest.fixture
def model_path(tiny_model_path, one_thread):
    return tiny_model_path


def make(path: str, model_dtype: Literal["float32", "bfloat16"] | None, critic: bool = False) -> TorchWorker:
    forward = ForwardOptions(use_remove_padding=False, **({"model_dtype": model_dtype} if model_dtype else {}))
    spec = RoleSpec(role="critic" if critic else "actor", model_path=path, trainable=True, value_head=critic,
                    lr=1e-2, micro_batch_size=8, forward=forward)
    return TorchWorker(spec, TorchBackendOptions(), "cpu")


def dtypes(worker: TorchWorker) -> set[torch.dtype]:
    return {p.dtype for p in worker.model.parameters()}


def moment_dtypes(worker: TorchWorker) -> set[torch.dtype]:
    assert worker.optimizer is not None
    return {s[k].dtype for s in worker.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")}


@pytest.mark.parametrize("critic", [False, True])
def test_bf16_role_trains_in_bf16(model_path, critic):
    worker = make(model_path, "bfloat16", critic)
    assert dtypes(worker) == {torch.bfloat16}
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    if critic:
        from rlx.plugins.algorithms.base import CriticLoss

        metrics = worker.train_step(critic_batch(), CriticLoss(0.5))
    else:
        metrics = worker.train_step(make_batch(), grpo_loss())
    assert metrics["skipped_step"] == 0.0
    assert all(p.grad is None or p.grad.dtype == torch.bfloat16 for p in worker.model.parameters())
    assert moment_dtypes(worker) == {torch.bfloat16}
    changed = [n for n, p in worker.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert len(changed) > len(before) // 2, changed
    # log-probs come out in float32 whatever the weights
    if not critic:
        assert worker.compute_log_probs(make_batch())["log_probs"].dtype == torch.float32


def test_float32_master_weights_stay_the_default(model_path):
    for worker in (make(model_path, None), make(model_path, "float32")):
        worker.train_step(make_batch(), grpo_loss())
        assert dtypes(worker) == {torch.float32}
        assert moment_dtypes(worker) == {torch.float32}
    config = validate({})
    assert config.actor.model_dtype == config.critic.model_dtype == "float32"
    assert role_settings(config, "actor").forward.model_dtype == "float32"


def test_config_reaches_the_roles():
    config = validate({"actor": {"model_dtype": "bfloat16"}, "critic": {"model_dtype": "bfloat16"}})
    assert role_settings(config, "actor").forward.model_dtype == "bfloat16"
    assert role_settings(config, "critic").forward.model_dtype == "bfloat16"


@pytest.mark.parametrize("value", ["fp16", "bf16", "float16"])
def test_bad_value_is_a_config_error(value):
    with pytest.raises(ConfigError) as exc:
        validate({"actor": {"model_dtype": value}})
    assert "actor.model_dtype: must be one of 'float32' or 'bfloat16'" in str(exc.value)


@pytest.fixture
def group():
    """The one-rank group an FSDP worker makes for itself in this process, destroyed afterwards."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@pytest.mark.parametrize("engine", ["fsdp2", "fsdp"])
def test_fsdp_backends_train_bf16_weights(model_path, group, engine):
    """fsdp2 and fsdp shard bf16 weights and keep bf16 AdamW moments; a step changes the weights. The
    configuration is accepted for both."""
    from rlx.cli.main import _pm
    from rlx.plugins.backends.fsdp import FSDP2Options, FSDPOptions, FSDPWorker
    from rlx.validate import load_config

    spec = RoleSpec(role="actor", model_path=model_path, trainable=True, lr=1e-2, micro_batch_size=8,
                    forward=ForwardOptions(use_remove_padding=False, model_dtype="bfloat16"))
    worker = FSDPWorker(spec, FSDP2Options() if engine == "fsdp2" else FSDPOptions(), "cpu", engine)
    assert dtypes(worker) == {torch.bfloat16}
    before = {n: local(p).detach().clone() for n, p in worker.model.named_parameters()}
    metrics = worker.train_step(make_batch(), grpo_loss())
    assert metrics["skipped_step"] == 0.0
    assert moment_dtypes(worker) == {torch.bfloat16}
    changed = [n for n, p in worker.model.named_parameters() if not torch.equal(local(p).detach(), before[n])]
    assert len(changed) > len(before) // 2, changed
    assert worker.compute_log_probs(make_batch())["log_probs"].dtype == torch.float32
    assert {t.dtype for _, t in worker.named_weights()} == {torch.bfloat16}
    config = load_config(_pm(), preset="tiny", overrides=[f"backend.name={engine}", "actor.model_dtype=bfloat16",
                                                          "critic.model_dtype=bfloat16"])
    assert config.config.critic.model_dtype == "bfloat16"
