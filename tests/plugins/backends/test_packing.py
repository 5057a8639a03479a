"""Packed sequences (``use_remove_padding``): a micro-batch's rows go through the model as one row without
padding, with position ids restarting per sequence, and give the padded path's log-probs, entropies, values
and gradients; the loss still sees (batch, response_length) tensors. On the torch backend and on fsdp2 over
2 gloo processes.

Tolerances (float32 on the CPU): the packed row is one attention call over all the micro-batch's tokens,
so its sums are ordered differently from the padded rows': log-probs, entropies and values agree to
2e-5 absolute (measured: 4e-6), gradients to 1e-4 of the largest gradient entry of each tensor
(measured: below 1e-5). A packed row whose attention leaked across sequences, or whose positions did not
restart, is off by more than 1e-2.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch
from test_backend_torch import critic_batch, grpo_loss, make_batch
from test_fsdp import free_port

from rlx.batch import Batch
from rlx.dispatch import shard
from rlx.plugins.algorithms.base import CriticLoss
from rlx.plugins.modeling import checkpointing
from rlx.plugins.modeling.head import response_log_probs, response_values
from rlx.plugins.modeling.packing import model_inputs
from rlx.plugins.modeling.worker import TorchBackendOptions, TorchWorker
from rlx.protocols import RoleSpec
from rlx.records import ForwardOptions, LossContext

ATOL = 2e-5
GRAD_RTOL = 1e-4
WORLD = 2


@pytest.fixture
def model_path(tiny_model_path, one_thread):
    return tiny_model_path


def spec(path: str, role: str = "actor", **options: Any) -> RoleSpec:
    return RoleSpec(role=role, model_path=path, trainable=role != "ref", value_head=role == "critic", lr=1e-3,
                    micro_batch_size=8, forward=ForwardOptions(**options))


def worker(path: str, role: str = "actor", attn: str = "sdpa", **options: Any) -> TorchWorker:
    return TorchWorker(spec(path, role, **options), TorchBackendOptions(attn_implementation=attn), "cpu")


def grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want) and want, what
    for name, g in want.items():
        scale = float(g.abs().max())
        torch.testing.assert_close(got[name], g, atol=GRAD_RTOL * max(scale, 1e-12), rtol=0, msg=f"{what}: {name}")


def test_packed_inputs_are_the_valid_tokens_with_restarting_positions():
    batch = make_batch(rows=3)  # prompts of 5, 9, 3 tokens; responses of 6, 1, 4
    inputs, keep = model_inputs(batch, packed=True)
    assert set(inputs) == {"input_ids", "position_ids"}  # no attention mask: transformers reads the positions
    assert inputs["input_ids"].shape == (1, 5 + 6 + 9 + 1 + 3 + 4)
    assert inputs["position_ids"][0].tolist() == list(range(11)) + list(range(10)) + list(range(7))
    rows = [torch.cat([batch["prompts"][i][batch["prompt_mask"][i].bool()],
                       batch["responses"][i][batch["response_mask"][i].bool()]]) for i in range(3)]
    assert torch.equal(inputs["input_ids"][0], torch.cat(rows))
    # the position before each response token: the last prompt token, then the response itself
    assert keep.tolist() == [4, 5, 6, 7, 8, 9, 11 + 8, 21 + 2, 21 + 3, 21 + 4, 21 + 5]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_log_probs_entropy_and_values_equal_the_padded_ones(model_path, attn):
    batch = make_batch()
    mask = batch["response_mask"].bool()
    padded, packed = worker(model_path, "ref", attn, use_remove_padding=False), worker(model_path, "ref", attn)
    assert packed.packed and not padded.packed
    want, got = padded.compute_log_probs(batch, with_entropy=True), packed.compute_log_probs(batch, with_entropy=True)
    for key in ("log_probs", "entropy"):
        assert got[key].shape == mask.shape
        torch.testing.assert_close(got[key][mask], want[key][mask], atol=ATOL, rtol=0, msg=key)
        assert torch.all(got[key][~mask] == 0)
    critics = [worker(model_path, "critic", attn, use_remove_padding=p) for p in (False, True)]
    want_v, got_v = (c.compute_values(batch)["values"] for c in critics)
    torch.testing.assert_close(got_v, want_v, atol=ATOL, rtol=0)
    assert float(want_v[mask].abs().min()) > 0


def test_packed_attention_stays_within_each_sequence(model_path):
    """A row packed with others scores as it does alone; the same tokens as one sequence (positions not
    restarting: attention crosses rows) score differently, which is what the comparison would catch."""
    model = worker(model_path, "ref").model
    batch = make_batch()
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        together, _ = response_log_probs(model, batch, 1.0, False, packed=True)
        for i in range(len(batch)):
            alone, _ = response_log_probs(model, batch.index([i]), 1.0, False, packed=True)
            torch.testing.assert_close(alone[0][mask[i]], together[i][mask[i]], atol=ATOL, rtol=0)
        inputs, keep = model_inputs(batch, packed=True)
        one = model(input_ids=inputs["input_ids"], position_ids=torch.arange(inputs["input_ids"].shape[1])[None])
        crossed = torch.log_softmax(one.logits[0, keep].float(), -1).gather(-1, batch["responses"][mask][:, None])
    assert float((crossed[:, 0] - together[mask]).abs().max()) > 1e-2


@pytest.mark.parametrize("chunk", [0, 5], ids=["plain-head", "chunked-head"])
def test_packed_gradients_equal_the_padded_ones(model_path, chunk):
    """One backward of the GRPO loss (entropy bonus on, so the entropy's gradient counts too) and of the
    critic's loss: the same gradient for every parameter, packed or padded."""
    batch = make_batch()
    batch_ctx = LossContext(float(batch["response_mask"].sum()), float(len(batch)))
    loss_fn = grpo_loss(entropy_coeff=0.01)
    out = {}
    for packed in (False, True):
        w = worker(model_path, use_remove_padding=packed, log_prob_chunk_size=chunk)
        loss, _ = loss_fn(w.forward(batch, grad=True), batch, batch_ctx)
        loss.backward()
        out[packed] = grads(w.model)
    assert_grads_close(out[True], out[False], "actor")
    cbatch = critic_batch()
    cbatch_ctx = LossContext(float(cbatch["response_mask"].sum()), float(len(cbatch)))
    for packed in (False, True):
        c = worker(model_path, "critic", use_remove_padding=packed)
        loss, _ = CriticLoss(0.2)(c.forward(cbatch, grad=True), cbatch, cbatch_ctx)
        loss.backward()
        out[packed] = grads(c.model)
    assert_grads_close(out[True], out[False], "critic")


def test_the_loss_sees_batch_by_response_length_tensors(model_path):
    batch = make_batch()
    seen = {}

    def loss_fn(outputs, mb, ctx):
        seen.update({k: tuple(v.shape) for k, v in outputs.items()})
        return outputs["log_probs"].sum() * 0.0, {}

    worker(model_path).train_step(batch, loss_fn)
    assert seen == {"log_probs": (8, 6), "entropy": (8, 6)}


def test_values_packed_match_a_row_alone(model_path):
    critic = worker(model_path, "critic")
    batch = make_batch()
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        together = response_values(critic.model, batch, packed=True)
        for i in (0, 3, 7):
            alone = response_values(critic.model, batch.index([i]), packed=False)
            torch.testing.assert_close(alone[0][mask[i]], together[i][mask[i]], atol=ATOL, rtol=0)


# -- fsdp2 on 2 gloo processes ---------------------------------------------------------------------
def _rank_main(rank: int, world: int, port: int, path: str, batch: Batch, out: str) -> None:
    import torch.distributed as dist

    from rlx.plugins.backends.fsdp import FSDP2Options, FSDPWorker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mine = shard(batch, world)[rank]
        mine_ctx = LossContext(float(batch["response_mask"].sum()), float(len(batch)))
        res: dict[str, Any] = {}
        for packed in (False, True):
            actor = FSDPWorker(spec(path, use_remove_padding=packed), FSDP2Options(), "cpu", "fsdp2")
            critic = FSDPWorker(spec(path, "critic", use_remove_padding=packed), FSDP2Options(), "cpu", "fsdp2")
            assert actor.packed is packed and critic.packed is packed
            lp = actor.compute_log_probs(mine, with_entropy=True)
            res[f"log_probs_{packed}"], res[f"entropy_{packed}"] = lp["log_probs"], lp["entropy"]
            res[f"values_{packed}"] = critic.compute_values(mine)["values"]
            loss, _ = grpo_loss(entropy_coeff=0.01)(actor.forward(mine, grad=True), mine, mine_ctx)
            actor.backward(loss)
            res[f"grads_{packed}"] = {n: p.grad.full_tensor().clone() for n, p in actor.model.named_parameters()}
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_fsdp2_two_processes_packed_equals_padded(model_path, tmp_path):
    import torch.multiprocessing as mp

    batch = make_batch()
    mask = batch["response_mask"].bool()
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        mp.start_processes(_rank_main, args=(WORLD, free_port(), model_path, batch, str(tmp_path)), nprocs=WORLD,
                           join=True, start_method="spawn")
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    # the single-process torch backend, padded: what both layouts on 2 ranks must give
    ref = worker(model_path, use_remove_padding=False)
    want = ref.compute_log_probs(batch, with_entropy=True)
    want_values = worker(model_path, "critic", use_remove_padding=False).compute_values(batch)["values"]
    batch_ctx = LossContext(float(batch["response_mask"].sum()), float(len(batch)))
    loss, _ = grpo_loss(entropy_coeff=0.01)(ref.forward(batch, grad=True), batch, batch_ctx)
    loss.backward()
    want_grads = grads(ref.model)
    for packed in (False, True):
        for key, expected in (("log_probs", want["log_probs"]), ("entropy", want["entropy"]), ("values", want_values)):
            got = torch.cat([r[f"{key}_{packed}"] for r in ranks])  # the launcher's gather: rank order
            torch.testing.assert_close(got[mask], expected[mask], atol=ATOL, rtol=0, msg=f"{key}, packed={packed}")
        for r in range(WORLD):
            assert_grads_close(ranks[r][f"grads_{packed}"], want_grads, f"rank {r}, packed={packed}")


def test_flex_attention_cannot_train_on_the_cpu(model_path):
    from rlx.errors import UserError

    with pytest.raises(UserError, match="flex attention has no backward pass"):
        worker(model_path, "actor", "flex_attention")


def test_packed_rows_on_sdpa_build_no_tokens_by_tokens_mask(model_path):
    """On sdpa the packed row is cut per sequence for attention (rlx's packed_sdpa): no (T x T) tensor is
    made, where transformers' own sdpa path builds a block-diagonal (T x T) mask."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from rlx.plugins.modeling.packing import PACKED_SDPA

    batch = make_batch()
    total = int(batch["prompt_mask"].sum() + batch["response_mask"].sum())

    class Square(TorchDispatchMode):
        found = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[-2:]) == (total, total):
                    Square.found = True
            return out

    ours = worker(model_path, "ref")
    assert ours.model.config._attn_implementation == PACKED_SDPA
    with Square():
        ours.compute_log_probs(batch)
    assert not Square.found
    with Square(), torch.no_grad():  # the same model on transformers' sdpa: the check sees the mask
        ours.model.config._attn_implementation = "sdpa"
        response_log_probs(ours.model, batch, 1.0, False, packed=True)
    assert Square.found
    assert worker(model_path, "ref", "eager").model.config._attn_implementation == "eager"


def test_packed_attention_waits_for_the_device_once_per_forward_not_per_layer(model_path):
    """The packed layout (sequence starts, lengths, the valid positions) is found once per forward pass and
    shared by every layer; a layer that picked its valid outputs with a boolean mask would make the host wait
    for the GPU in each layer. Counted as the operations whose output size depends on the data (``nonzero``,
    ``masked_select``, boolean indexing), which must not grow with the number of layers."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountNonzero(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            boolean_index = func.overloadpacket is torch.ops.aten.index and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []))
            if func.overloadpacket in (torch.ops.aten.nonzero, torch.ops.aten.masked_select) or boolean_index:
                CountNonzero.calls += 1
            return func(*args, **(kwargs or {}))

    def count(layers: int) -> int:
        ours = worker(model_path, "ref")
        ours.hf_model.model.layers = ours.hf_model.model.layers[:layers]
        ours.hf_model.config.num_hidden_layers = layers
        CountNonzero.calls = 0
        with CountNonzero():
            ours.compute_log_probs(make_batch())
        return CountNonzero.calls

    full = worker(model_path, "ref").hf_model.config.num_hidden_layers
    assert full >= 2
    assert count(full) == count(1) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_varlen_flash_attention_equals_attention_per_sequence_on_a_gpu():
    """On a GPU in bf16, packed rows run PyTorch's variable-length flash attention (no padding, GQA without
    repeated keys). Its outputs and the gradients of query, key and value equal the per-sequence SDPA path
    (the CPU's) run on float32 copies, to bf16 accuracy: 2e-2 of each tensor's largest entry."""
    from types import SimpleNamespace

    from rlx.plugins.modeling import packing

    if packing._varlen_attn() is None:
        pytest.skip("torch < 2.10 has no varlen_attn")
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [37, 5, 128, 64, 1, 90]
    total, heads, kv_heads, d = sum(lengths), 14, 2, 64
    positions = torch.cat([torch.arange(n) for n in lengths]).cuda()[None]
    q, k, v = (torch.randn(1, h, total, d, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    module = SimpleNamespace()  # packed_sdpa reads only the module's class name (for its error message)
    assert packing.varlen_kernel_usable(q)
    out, _ = packing.packed_sdpa(module, q, k, v, None, scaling=d**-0.5, position_ids=positions)
    upstream = torch.randn(out.shape, device="cuda", generator=g)
    (out.float() * upstream).sum().backward()
    ref_inputs = [x.detach().float().requires_grad_() for x in (q, k, v)]
    packing._LAYOUT[:] = [None, None]
    ref, _ = packing.packed_sdpa(module, *ref_inputs, None, scaling=d**-0.5, position_ids=positions)
    (ref * upstream).sum().backward()
    assert out.shape == ref.shape == (1, total, heads, d)
    for got, want, what in [(out.float(), ref, "output"), *((x.grad.float(), r.grad, f"grad {i}")
                                                             for i, (x, r) in enumerate(zip((q, k, v), ref_inputs)))]:
        torch.testing.assert_close(got, want, atol=2e-2 * float(want.abs().max()), rtol=0, msg=what)


def test_gradient_checkpointing_combines_with_packing_and_the_chunked_head(model_path):
    """Recomputed activations (the attention's packed layout included) give the same gradients."""
    batch = make_batch()
    batch_ctx = LossContext(float(batch["response_mask"].sum()), float(len(batch)))
    out = {}
    for recompute in (False, True):
        spec_ = dataclasses.replace(spec(model_path, log_prob_chunk_size=5), gradient_checkpointing=recompute)
        w = TorchWorker(spec_, TorchBackendOptions(), "cpu")
        assert w.packed and checkpointing.is_on(w.model) is recompute
        loss, _ = grpo_loss(entropy_coeff=0.01)(w.forward(batch, grad=True), batch, batch_ctx)
        loss.backward()
        out[recompute] = grads(w.model)
    assert_grads_close(out[True], out[False], "gradient checkpointing")
