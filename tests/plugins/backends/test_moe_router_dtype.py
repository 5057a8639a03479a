"""``model.router_dtype=float32``: the mixture-of-experts routers of a bf16 model compute their gate in float32
(megatron-core's ``moe_router_dtype=fp32``, which verl's megatron MoE scripts set).

The routers of the four Hugging Face MoE families rlx patches (Qwen2-MoE, Qwen3-MoE, Mixtral, Qwen3-VL-MoE) are
checked against a float32 reference (the same router module, upcast, on the upcast input): the patched logits,
top-k weights and experts equal it, the unpatched bf16 ones do not; autocast does not pull the patched gate back
to bf16; a dense model is left alone with a warning and an MoE router rlx does not know is a config error. Then
a 2-step GRPO run of ``rlx train`` on the fsdp2 backend trains the tiny Qwen3-MoE model of test_moe_fsdp2 in
bf16 with the option on.
"""

from __future__ import annotations

import copy
import math
import types

import pytest
import torch
from test_moe_fsdp2 import _tiny
from test_trainer import rlx

pytestmark = pytest.mark.slow

HIDDEN, EXPERTS = 64, 8


def _router(family: str) -> torch.nn.Module:
    """A router of ``family`` (hidden size 64, 8 experts, top-2) with random weights, in bf16."""
    common = dict(hidden_size=HIDDEN, num_experts_per_tok=2)
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeConfig, Qwen3MoeTopKRouter

        router = Qwen3MoeTopKRouter(Qwen3MoeConfig(**common, num_experts=EXPERTS, norm_topk_prob=True))
    elif family == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeConfig, Qwen2MoeTopKRouter

        router = Qwen2MoeTopKRouter(Qwen2MoeConfig(**common, num_experts=EXPERTS, norm_topk_prob=False))
    elif family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralTopKRouter

        router = MixtralTopKRouter(MixtralConfig(**common, num_local_experts=EXPERTS))
    else:
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
            Qwen3VLMoeTextConfig,
            Qwen3VLMoeTextTopKRouter,
        )

        router = Qwen3VLMoeTextTopKRouter(Qwen3VLMoeTextConfig(**common, num_experts=EXPERTS))
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(EXPERTS, HIDDEN))
    return router.to(torch.bfloat16)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "qwen3_vl_moe"])
def test_patched_router_computes_in_float32(family):
    from rlx.plugins.modeling.moe import apply_router_dtype

    router = _router(family)
    x = torch.randn(2, 16, HIDDEN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    reference = copy.deepcopy(router).float()(x.float())  # the library's own forward, all in float32
    bf16_logits = router(x)[0]
    assert bf16_logits.dtype == torch.bfloat16

    holder = torch.nn.Sequential(router)
    assert apply_router_dtype(holder, "auto") == 0 and router(x)[0].dtype == torch.bfloat16
    assert apply_router_dtype(holder, "float32") == 1
    assert apply_router_dtype(holder, "float32") == 1  # a second call patches nothing more
    logits, weights, experts = router(x)
    assert logits.dtype == weights.dtype == torch.float32
    torch.testing.assert_close(logits, reference[0], rtol=0, atol=0)
    torch.testing.assert_close(weights, reference[1].float(), rtol=1e-6, atol=1e-7)
    assert torch.equal(experts, reference[2])
    assert (logits - bf16_logits.float()).abs().max() > 1e-3  # bf16 rounds the logits; float32 does not
    # Under autocast (a float32 master model on a GPU, here the CPU's bf16 autocast) the gate stays in float32.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert router(x)[0].dtype == torch.float32
        assert torch.nn.functional.linear(x.float(), router.weight.float()).dtype == torch.bfloat16
    # The gradient reaches the weight in its own dtype.
    router(x)[1].sum().backward()
    assert router.weight.grad is not None and router.weight.grad.dtype == torch.bfloat16


def test_a_bf16_moe_model_routes_in_float32_and_a_dense_one_is_left_alone(tmp_path):
    from transformers import AutoModelForCausalLM

    from rlx.errors import UserError
    from rlx.plugins.modeling.moe import apply_router_dtype

    model = AutoModelForCausalLM.from_pretrained(_tiny("qwen3_moe", tmp_path / "moe"), dtype=torch.bfloat16)
    ids = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        before = model(ids, output_router_logits=True)
        assert apply_router_dtype(model, "float32", "the test's model") == 2
        after = model(ids, output_router_logits=True)
    assert after.logits.dtype == torch.bfloat16  # the rest of the model keeps its dtype
    assert all(r.dtype == torch.float32 for r in after.router_logits)
    assert all(b.dtype == torch.bfloat16 for b in before.router_logits)
    assert math.isfinite(float(after.logits.float().sum()))

    # The torch backend's worker applies spec.router_dtype where it loads the model (the reference: bf16 weights).
    from rlx.plugins.modeling.moe import router_kind
    from rlx.plugins.modeling.worker import TorchBackendOptions, TorchWorker
    from rlx.protocols import RoleSpec

    for router_dtype, routed_in in (("auto", torch.bfloat16), ("float32", torch.float32)):
        worker = TorchWorker(RoleSpec(role="ref", model_path=str(tmp_path / "moe"), trainable=False,
                                      dtype="bfloat16", router_dtype=router_dtype), TorchBackendOptions(), "cpu")
        routers = [m for m in worker.model.modules() if router_kind(m)]
        assert len(routers) == 2
        assert all(r(torch.zeros(3, HIDDEN, dtype=torch.bfloat16))[0].dtype == routed_in for r in routers)

    dense = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.warns(UserWarning, match="no mixture-of-experts router"):
        assert apply_router_dtype(dense, "float32") == 0
    unknown = torch.nn.Sequential(torch.nn.Linear(4, 4))
    unknown.config = types.SimpleNamespace(num_experts=4)
    with pytest.raises(UserError, match="rlx knows no router class"):
        apply_router_dtype(unknown, "float32", "the policy's model")


def test_grpo_trains_a_bf16_moe_model_with_float32_routers(tmp_path):
    from rlx.plugins.loggers.jsonl import read_metrics

    model = _tiny("qwen3_moe", tmp_path / "qwen3_moe")
    run = tmp_path / "run"
    result = rlx("train", "--preset", "tiny", f"model.path={model}", "backend.name=fsdp2", "model.dtype=bfloat16",
                 "model.router_dtype=float32", "trainer.total_steps=2", "trainer.test_freq=-1",
                 "trainer.val_before_train=false", "trainer.loggers=[jsonl]", "data.train_batch_size=4",
                 "actor.ppo_mini_batch_size=4", "rollout.n=2", "rollout.decoder=dynamic", "actor.optim.lr=0.01",
                 f"trainer.output_dir={run}", cwd=tmp_path, threads=1)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for name in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert math.isfinite(row[name]), (name, row)
    assert "no mixture-of-experts router" not in result.stderr
