"""``actor.use_torch_compile`` / ``critic.use_torch_compile``: each decoder layer compiled in place
(``rlx.plugins.modeling.compile.compile_decoder_layers``), with dynamic shapes.

On the CPU (inductor's C++ backend), float32: the compiled layers give the eager model's log-probs,
entropies and values to 2e-5 and its gradients to 1e-4 of each tensor's largest entry (measured: 3.8e-6 and
1.7e-6; fused arithmetic reorders sums), packed and padded, with gradient checkpointing too (which the
compiled layers run inside their graph). What compilation is for, the speed on a GPU, is measured by
``benchmarks/actor_update.py`` (docs/benchmarks.md).
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch
from test_backend_torch import grpo_loss, make_batch
from test_packing import ATOL, assert_grads_close
from test_shared_prompts import grouped_batch

from rlx.errors import ConfigError, UserError
from rlx.plugins.algorithms.base import CriticLoss
from rlx.plugins.modeling import checkpointing, packing
from rlx.plugins.modeling import compile as compiling
from rlx.plugins.modeling.compile import compile_decoder_layers
from rlx.plugins.modeling.worker import TorchBackendOptions, TorchWorker
from rlx.protocols import RoleSpec
from rlx.records import ForwardOptions, LossContext, RoleSettings

# Inductor compiles CPU kernels with the system's C++ compiler (CI installs g++ when it is missing).
needs_cxx_compiler = pytest.mark.skipif(not any(shutil.which(c) for c in compiling.CXX_COMPILERS),
                                        reason="torch.compile on the CPU needs a C++ compiler")
pytestmark = needs_cxx_compiler


@pytest.fixture
def model_path(tiny_model_path, one_thread):
    return tiny_model_path


def worker(path: str, role: str = "actor", **options: Any) -> TorchWorker:
    gc = bool(options.pop("gradient_checkpointing", False))
    spec = RoleSpec(role=role, model_path=path, trainable=True, value_head=role == "critic", lr=1e-3,
                    micro_batch_size=4, gradient_checkpointing=gc, forward=ForwardOptions(**options))
    return TorchWorker(spec, TorchBackendOptions(), "cpu")


def gradients(w: TorchWorker, batch: Any, loss_fn: Any) -> dict[str, torch.Tensor]:
    w.zero_grad()
    ctx = LossContext(float(batch["response_mask"].sum()), float(len(batch)))  # one mini-batch, one rank
    loss, _ = loss_fn(w.forward(batch, grad=True), batch, ctx)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in w.model.named_parameters() if p.grad is not None}


def actor_batch(batch: Any = None) -> Any:
    batch = make_batch() if batch is None else batch
    mask = batch["response_mask"]
    batch.tensors["advantages"] = torch.linspace(-1, 1, len(batch))[:, None] * mask
    return batch


@pytest.mark.parametrize("packed, checkpointing, shared", [(True, False, False), (False, False, False),
                                                             (True, True, False), (True, False, True)],
                         ids=["packed", "padded", "packed+checkpointing", "packed+shared-prompts"])
def test_compiled_layers_give_the_eager_log_probs_and_gradients(model_path, packed, checkpointing, shared):
    import torch._dynamo

    batch = actor_batch(grouped_batch() if shared else None)
    settings = {"use_remove_padding": packed, "gradient_checkpointing": checkpointing}
    eager, compiled = worker(model_path, **settings), worker(model_path, use_torch_compile=True, **settings)
    layers = compiled.hf_model.model.layers
    assert compiled.share_prompts == eager.share_prompts == packed  # on by default for packed rows
    assert (packing.LAYOUT_KWARG in packing.model_inputs(batch, packed, True)[0]) == shared  # a grouped batch shares
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert all(layer._compiled_call_impl is None for layer in eager.hf_model.model.layers)
    torch._dynamo.reset()  # no graph cached by an earlier test: the counts below are this test's
    torch._dynamo.utils.counters.clear()
    want, got = eager.compute_log_probs(batch, True), compiled.compute_log_probs(batch, True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the compiled path really ran
    mask = batch["response_mask"].bool()
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(got[key][mask], want[key][mask], atol=ATOL, rtol=0, msg=key)
    batch.tensors["old_log_probs"] = want["log_probs"]
    loss = grpo_loss(entropy_coeff=0.01)
    torch._dynamo.utils.counters.clear()
    assert_grads_close(gradients(compiled, batch, loss), gradients(eager, batch, loss), "compiled")
    # The training pass compiled too (under checkpointing: inside the graph, not left eager).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    # A whole optimizer step through the shared update loop, and the state dict keeps the model's own names.
    before = {k: v.clone() for k, v in compiled.model.state_dict().items()}
    compiled.train_step(batch, loss)
    assert set(compiled.model.state_dict()) == set(eager.model.state_dict()) == set(before)
    assert any(not torch.equal(v, before[k]) for k, v in compiled.model.state_dict().items())


def saved_bytes(w: TorchWorker, batch: Any) -> int:
    """Bytes of the tensors a training forward pass keeps for its backward pass (after a warm-up pass)."""
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    w.forward(batch, grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        w.forward(batch, grad=True)
    return total[0]


def test_gradient_checkpointing_still_saves_memory_in_compiled_layers(model_path):
    """torch.utils.checkpoint turns compilation off for what it runs, so the compiled layers checkpoint
    themselves inside their graph. Measured here as the bytes the forward pass keeps for the backward pass:
    1,155,896 compiled without checkpointing, 504,456 with (eager: 1,590,904 and 151,224; the head, outside
    the layers, is the same in all four). The test asks for less than 60%."""
    batch = actor_batch()
    batch.tensors["old_log_probs"] = torch.zeros_like(batch["response_mask"], dtype=torch.float32)
    plain = saved_bytes(worker(model_path, use_torch_compile=True), batch)
    checkpointed = worker(model_path, use_torch_compile=True, gradient_checkpointing=True)
    assert not checkpointing.is_on(checkpointed.hf_model)  # transformers' own wrapping is off ...
    assert saved_bytes(checkpointed, batch) < 0.6 * plain  # ... and the layers recompute inside their graph


def test_a_compiled_critic_gives_the_eager_values_and_gradients(model_path):
    batch = actor_batch()
    batch.tensors["values"] = torch.zeros_like(batch["response_mask"], dtype=torch.float32)
    batch.tensors["returns"] = torch.rand(len(batch), 1) * batch["response_mask"]
    eager, compiled = worker(model_path, "critic"), worker(model_path, "critic", use_torch_compile=True)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(compiled.compute_values(batch)["values"][mask],
                               eager.compute_values(batch)["values"][mask], atol=ATOL, rtol=0)
    loss = CriticLoss(0.2)
    assert_grads_close(gradients(compiled, batch, loss), gradients(eager, batch, loss), "compiled")


def test_a_model_without_decoder_layers_to_compile_is_a_user_error():
    with pytest.raises(UserError, match=r"critic.use_torch_compile=true compiles the decoder layers") as exc:
        compile_decoder_layers(torch.nn.Linear(2, 2), "critic")
    assert "critic.use_torch_compile=false" in exc.value.hint


def test_compiling_on_a_cpu_without_a_cxx_compiler_is_a_user_error(model_path, monkeypatch):
    monkeypatch.setattr(compiling.shutil, "which", lambda name: None)
    with pytest.raises(UserError, match="on the CPU needs a C\\+\\+ compiler") as exc:
        worker(model_path, use_torch_compile=True)
    assert "Install g++" in exc.value.hint and "actor.use_torch_compile=false" in exc.value.hint


def test_the_packed_layout_reaches_every_layer_as_an_argument(model_path, monkeypatch):
    """The layout is found once, before the forward pass, and handed down (no lookup inside a layer, which in
    a compiled layer would break its graph)."""
    lookups, handed = [], []
    monkeypatch.setattr(packing, "_layout_outside_compile", lambda: lambda *a: lookups.append(a))
    original = packing.packed_sdpa

    def spy(*args, **kwargs):
        handed.append(kwargs.get(packing.LAYOUT_KWARG))
        return original(*args, **kwargs)

    monkeypatch.setattr(packing, "packed_sdpa", spy)  # what the worker registers with transformers
    ours = worker(model_path)
    ours.compute_log_probs(actor_batch())
    assert not lookups
    assert handed and len(handed) % ours.hf_model.config.num_hidden_layers == 0  # every layer of every pass
    assert all(isinstance(layout, packing.PackedLayout) for layout in handed)


def test_fsdp1_refuses_compilation_before_the_run_and_megatron_takes_it():
    from rlx.cli.main import _pm
    from rlx.plugins.backends.megatron import settings_problems
    from rlx.validate import load_config

    with pytest.raises(ConfigError) as exc:
        load_config(_pm(), preset="tiny", overrides=["critic.use_torch_compile=true", "backend.name=fsdp"])
    assert "critic.use_torch_compile=true is built in the fsdp2 and torch backends" in str(exc.value)
    assert "Use backend.name=fsdp2" in str(exc.value)
    for backend in ("fsdp2", "torch"):
        config = load_config(_pm(), preset="tiny", overrides=["actor.use_torch_compile=true",
                                                              f"backend.name={backend}"]).config
        assert config.actor.use_torch_compile and not config.critic.use_torch_compile
    # the megatron backend compiles its decoder layers (tests/plugins/backends/test_megatron.py)
    assert not settings_problems({"actor": RoleSettings(ForwardOptions(use_torch_compile=True))})


# -- fsdp2 over 2 gloo processes ------------------------------------------------------------------------
def _fsdp2_rank(rank: int, world: int, port: int, path: str, batch: Any, out: str) -> None:
    import os

    import torch.distributed as dist

    from rlx.dispatch import shard
    from rlx.plugins.backends.fsdp import FSDP2Options, FSDPWorker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mine = shard(batch, world)[rank]
        res: dict[str, Any] = {}
        for name, compiled in (("eager", False), ("compiled", True)):
            spec = RoleSpec(role="actor", model_path=path, trainable=True, lr=1e-3, micro_batch_size=2,
                            forward=ForwardOptions(use_torch_compile=compiled))
            w = FSDPWorker(spec, FSDP2Options(), "cpu", "fsdp2")
            res[f"{name}_log_probs"] = w.compute_log_probs(mine, with_entropy=True)["log_probs"]
            res[f"{name}_metrics"] = w.update([mine], grpo_loss())
            # The last step's gradients, still held after it (the next update zeroes them), gathered whole.
            res[f"{name}_grads"] = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                                    for n, p in w.model.named_parameters() if p.grad is not None}
            res[f"{name}_layers_compiled"] = all(
                layer._compiled_call_impl is not None for layer in w._plain(w.model).model.layers)
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_fsdp2_compiles_its_layers_and_matches_the_eager_run(tiny_model_path, tmp_path):
    """Two gloo ranks, each holding half of every layer: compiled layers (FSDP2's gathering hooks run outside
    the graph) give the eager run's log-probs, gradient norm and gradients."""
    import torch.multiprocessing as mp
    from test_fsdp import free_port

    batch = actor_batch()
    batch.tensors["old_log_probs"] = torch.zeros_like(batch["response_mask"], dtype=torch.float32)
    mp.start_processes(_fsdp2_rank, args=(2, free_port(), tiny_model_path, batch, str(tmp_path)), nprocs=2,
                       join=True, start_method="spawn")
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert res["compiled_layers_compiled"] and not res["eager_layers_compiled"]
        torch.testing.assert_close(res["compiled_log_probs"], res["eager_log_probs"], atol=ATOL, rtol=0)
        assert res["compiled_metrics"][0]["grad_norm"] == pytest.approx(res["eager_metrics"][0]["grad_norm"],
                                                                        rel=1e-4)
        assert_grads_close(res["compiled_grads"], res["eager_grads"], f"rank {rank}")
