"""The ``megatron`` backend: what megatron-core can run on the CPU here, and the backend contract on GPUs.

CPU (gloo): the parallel-layout and architecture checks; a megatron-core GPT model built from a Hugging Face
Qwen2 (tied embeddings, GQA with one key/value head) and Llama (untied, GQA 4:2) folder, HF -> Megatron ->
HF bit-exact, on one rank and split over 2 ranks by tensor or by pipeline parallelism; the critic's value
head; and the vocabulary-parallel log-probs, entropies and their gradients against the full-vocabulary
computation on 2 ranks.

megatron-core's model code places three things on CUDA whatever the model's device: a few buffers at
``torch.cuda.current_device()``, the default causal mask (``device="cuda"``), and the CUDA random state it
forks around attention dropout (dropout is 0 here). :func:`emulate_cuda_placement` points those three at the
CPU, and nothing else, so the CPU tests run megatron-core's real layers (local spec, float32): the forward
pass gives the ``torch`` backend's log-probs, entropies and values, and under TP=2 the same log-probs and
the same gradients (gathered back to Hugging Face names) as one rank. What needs more of CUDA (megatron's
DDP buffers and optimizer, its distributed checkpoints, pipeline transfers) is marked ``gpu``: the backend
contract against the ``torch`` backend, and a checkpoint round trip.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

from rlx.batch import Batch
from rlx.errors import UserError
from rlx.plugins.backends.megatron import (
    MegatronOptions,
    check_layout,
    config_overrides,
    layout_problems,
    model_outputs,
    require_megatron,
    run_model,
    vocab_parallel_log_probs,
)
from rlx.plugins.backends.megatron_convert import (
    build_chunks,
    check_architecture,
    export_hf,
    load_hf,
    make_bridge,
    read_checkpoint,
    read_hf_config,
    sdpa_attention_class,
)

pytestmark = pytest.mark.megatron


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny untied Llama with 4 query and 2 key/value heads (so TP=2 splits the groups), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def hf_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def loaded_chunks(path: str, options: MegatronOptions, value_head: bool = False, seed: int = 0
                  ) -> tuple[list[Any], Any, Any]:
    """This rank's megatron-core chunks holding the HF folder's weights (megatron's groups already set up),
    with the bridge and the HF config."""
    config = read_hf_config(path)
    bridge = make_bridge(config, torch.float32, config_overrides(options, torch.float32, on_cpu=True))
    chunks = build_chunks(bridge, config, value_head=value_head, use_te=False,
                          vpp=options.virtual_pipeline_model_parallel_size, device="cpu")
    load_hf(chunks, bridge, config, path, value_head=value_head, seed=seed)
    return chunks, bridge, config


def convert(path: str, options: MegatronOptions, value_head: bool = False, seed: int = 0
            ) -> dict[str, torch.Tensor]:
    """HF folder -> this rank's megatron-core chunks -> full HF tensors (megatron's groups already set up)."""
    chunks, bridge, config = loaded_chunks(path, options, value_head, seed)
    return {n: t.clone() for n, t in export_hf(chunks, bridge, config, value_head=value_head, comm_device="cpu")}


def save_model_checkpoint(chunks: list[Any], folder: str) -> None:
    """What ``MegatronWorker.save_checkpoint`` writes through ``dist_checkpointing`` (the same sharded state
    dict), less the optimizer's part: megatron's optimizer needs CUDA. Every rank calls it."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from rlx.plugins.backends.megatron import MegatronWorker

    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    state = MegatronWorker._sharded_state(SimpleNamespace(chunks=chunks, optimizer=None),  # type: ignore[arg-type]
                                          loading=False)
    dist_checkpointing.save(state, folder)


def emulate_cuda_placement(setattr_: Any) -> None:
    """Point megatron-core's three CUDA-only placements at the CPU (see the module docstring); the
    ``torch.cuda.synchronize()`` of ``dist_checkpointing``'s writer becomes a no-op."""
    import megatron.core.fusions.fused_softmax as fused_softmax
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    setattr_(torch.cuda, "current_device", lambda: "cpu")
    setattr_(torch.cuda, "synchronize", lambda device=None: None)
    setattr_(fused_softmax, "get_default_causal_mask",
             lambda sq: torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1))
    setattr_(CudaRNGStatesTracker, "fork", lambda self, name="model-parallel-rng": contextlib.nullcontext())


TEMPERATURE = 0.7  # the forward passes of these tests divide the logits by a sampling temperature


def forward_and_grads(path: str, options: MegatronOptions, batch: Batch, value_head: bool = False,
                      head: dict[str, torch.Tensor] | None = None, head_chunk: int = 0,
                      compiled: bool = False) -> dict[str, Any]:
    """The backend's forward pass (``run_model`` + ``model_outputs``) on ``batch``, then the gradients of
    sum((log_probs + 0.1 entropy) * mask) (or of sum(values^2)) as full tensors with Hugging Face names
    (each parameter's gradient written into it, then exported like weights). ``head_chunk`` > 0: the chunked
    head, that many response positions at a time. ``compiled``: the layers and the head's element-wise work
    compiled, as ``use_torch_compile`` does."""
    config = read_hf_config(path)
    bridge = make_bridge(config, torch.float32, config_overrides(options, torch.float32, on_cpu=True))
    chunks = build_chunks(bridge, config, value_head=value_head, use_te=False, vpp=None, device="cpu")
    load_hf(chunks, bridge, config, path, value_head=value_head, seed=0)
    if compiled:
        from rlx.plugins.backends.megatron import compile_layers

        assert compile_layers(chunks) == config.num_hidden_layers
    if head is not None:
        with torch.no_grad():
            chunks[0].output_layer.weight.copy_(head["weight"])
            chunks[0].output_layer.bias.copy_(head["bias"])
    output, where = run_model(chunks[0], batch, 1, head_chunk, temperature=TEMPERATURE, compiled_head=compiled)
    out = model_outputs(output, where, batch, value_head=value_head, with_entropy=True, head_done=head_chunk > 0,
                        temperature=TEMPERATURE)
    if value_head:
        loss = (out["values"] ** 2).sum()
    else:
        loss = ((out["log_probs"] + 0.1 * out["entropy"]) * batch["response_mask"]).sum()
    loss.backward()
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.copy_(p.grad)
    grads = {n: t.clone() for n, t in export_hf(chunks, bridge, config, value_head=value_head, comm_device="cpu")}
    return {**{k: v.detach() for k, v in out.items()}, "grads": grads}


def forward_batch() -> Batch:
    from test_backend_torch import make_batch

    return make_batch(seed=2)  # scored at TEMPERATURE


@pytest.fixture
def one_rank():
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mpu.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()


# -- weights: HF -> Megatron -> HF ------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["qwen2", "llama"])
def test_round_trip_is_bit_exact_on_one_rank(which: str, tiny_model_path: str, llama_path: str, one_rank: None
                                             ) -> None:
    path = tiny_model_path if which == "qwen2" else llama_path
    original = hf_tensors(path)
    out = convert(path, MegatronOptions())
    expected = {n for n in original if not (read_hf_config(path).tie_word_embeddings and n == "lm_head.weight")}
    assert set(out) == expected
    for name in expected:
        assert out[name].dtype == original[name].dtype
        assert torch.equal(out[name], original[name]), name


def test_the_megatron_model_holds_the_fused_layout(llama_path: str, one_rank: None) -> None:
    """The fused QKV groups each key/value head's queries with its key and value (GQA), and fc1 is
    [gate; up]: the converted tensors sit where megatron-core's attention and SwiGLU read them."""
    config = read_hf_config(llama_path)
    bridge = make_bridge(config, torch.float32, config_overrides(MegatronOptions(), torch.float32, on_cpu=True))
    chunk = build_chunks(bridge, config, value_head=False, use_te=False, vpp=None, device="cpu")[0]
    load_hf([chunk], bridge, config, llama_path, value_head=False, seed=0)
    hf = hf_tensors(llama_path)
    layer = chunk.decoder.layers[1]
    qkv = layer.self_attention.linear_qkv.weight.view(2, 4, 16, 64)  # kv groups, (2 q + k + v) heads, dim, hidden
    q = hf["model.layers.1.self_attn.q_proj.weight"].view(4, 16, 64)
    assert torch.equal(qkv[1, :2], q[2:4])  # group 1 holds query heads 2 and 3
    assert torch.equal(qkv[1, 2], hf["model.layers.1.self_attn.k_proj.weight"].view(2, 16, 64)[1])
    assert torch.equal(qkv[0, 3], hf["model.layers.1.self_attn.v_proj.weight"].view(2, 16, 64)[0])
    fc1 = layer.mlp.linear_fc1.weight
    assert torch.equal(fc1[:96], hf["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(fc1[96:], hf["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(layer.pre_mlp_layernorm.weight, hf["model.layers.1.post_attention_layernorm.weight"])
    assert torch.equal(chunk.output_layer.weight, hf["lm_head.weight"])


def test_critic_gets_a_seeded_value_head_and_keeps_a_saved_one(tiny_model_path: str, one_rank: None,
                                                              tmp_path: Path) -> None:
    from transformers import AutoModelForTokenClassification

    out = convert(tiny_model_path, MegatronOptions(), value_head=True, seed=3)
    again = convert(tiny_model_path, MegatronOptions(), value_head=True, seed=3)
    other = convert(tiny_model_path, MegatronOptions(), value_head=True, seed=4)
    original = hf_tensors(tiny_model_path)
    assert out["score.weight"].shape == (1, 64) and torch.equal(out["score.bias"], torch.zeros(1))
    assert torch.equal(out["score.weight"], again["score.weight"])
    assert not torch.equal(out["score.weight"], other["score.weight"])
    assert "lm_head.weight" not in out and "model.embed_tokens.weight" in out
    for name in original:
        assert torch.equal(out[name], original[name]), name
    # a critic folder (as rlx export writes one) round-trips with its head
    critic = AutoModelForTokenClassification.from_pretrained(tiny_model_path, num_labels=1)
    with torch.no_grad():
        critic.score.bias.fill_(0.25)
    critic.save_pretrained(tmp_path)
    saved = hf_tensors(str(tmp_path))
    back = convert(str(tmp_path), MegatronOptions(), value_head=True)
    assert set(back) == set(saved)
    for name in saved:
        assert torch.equal(back[name], saved[name]), name


# -- 2 ranks over gloo ------------------------------------------------------------------------------------
def _rank_main(rank: int, world: int, port: int, tiny: str, llama: str, out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    res: dict[str, Any] = {}
    emulate_cuda_placement(setattr)
    try:
        # (A tied model split into pipeline stages syncs its output layer with .cuda(): GPU only.)
        for name, tp, pp, path in (("tp", 2, 1, llama), ("pp", 1, 2, llama)):
            mpu.initialize_model_parallel(tp, pp)
            options = MegatronOptions(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
            chunks, bridge, config = loaded_chunks(path, options)
            res[name] = {n: t.clone() for n, t in export_hf(chunks, bridge, config, value_head=False,
                                                             comm_device="cpu")}
            save_model_checkpoint(chunks, os.path.join(out, f"dist-{name}"))
            mpu.destroy_model_parallel()
        mpu.initialize_model_parallel(2, 1)
        res["vocab"] = _vocab_parallel_case(rank)
        res["forward"] = forward_and_grads(llama, MegatronOptions(tensor_model_parallel_size=2), forward_batch())
        res["forward_chunked"] = forward_and_grads(llama, MegatronOptions(tensor_model_parallel_size=2),
                                                   forward_batch(), head_chunk=5)
        mpu.destroy_model_parallel()
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _vocab_case_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 5, 10, generator=g) * 3
    targets = torch.randint(0, 10, (3, 5), generator=g)
    w_lp, w_ent = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    return logits, targets, w_lp, w_ent


def _vocab_parallel_case(rank: int) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state as mpu

    logits, targets, w_lp, w_ent = _vocab_case_inputs()
    mine = logits[..., rank * 5:(rank + 1) * 5].clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs(mine, targets, mpu.get_tensor_model_parallel_group(), rank * 5, True)
    assert ent is not None
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    assert mine.grad is not None
    return {"log_probs": lp.detach(), "entropy": ent.detach(), "grad": mine.grad}


@pytest.fixture(scope="module")
def two_ranks(tiny_model_path: str, llama_path: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("megatron2")
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        mp.start_processes(_rank_main, args=(2, free_port(), tiny_model_path, llama_path, str(out)), nprocs=2,
                           join=True, start_method="spawn")
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
    results = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for res in results:
        res["dist"] = {case: str(out / f"dist-{case}") for case in ("tp", "pp")}
    return results


@pytest.mark.parametrize("case", ["tp", "pp"])
def test_round_trip_is_bit_exact_split_over_two_ranks(case: str, two_ranks: list[dict], llama_path: str) -> None:
    """TP=2 cuts the fused QKV by key/value group and fc1 by [gate; up] halves, the vocabulary and the
    row-parallel projections; PP=2 puts one layer on each rank. Gathered back, every rank has every tensor
    bit for bit."""
    original = hf_tensors(llama_path)
    expected = set(original)
    for rank in two_ranks:
        out = rank[case]
        assert set(out) == expected
        for name in expected:
            assert torch.equal(out[name], original[name]), (case, name)


def test_vocab_parallel_log_probs_entropy_and_gradients(two_ranks: list[dict]) -> None:
    """Two ranks each holding half of the vocabulary give the full softmax's log-probs and entropies, and
    the gradient of a loss of both with respect to each rank's half of the logits (float32, 1e-6)."""
    logits, targets, w_lp, w_ent = _vocab_case_inputs()
    full = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(full, -1)
    lp = logp.gather(-1, targets[..., None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    assert full.grad is not None
    for rank, res in enumerate(r["vocab"] for r in two_ranks):
        torch.testing.assert_close(res["log_probs"], lp.detach(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(res["entropy"], ent.detach(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(res["grad"], full.grad[..., rank * 5:(rank + 1) * 5], atol=1e-6, rtol=1e-6)


def test_forward_gives_the_torch_backends_log_probs_entropy_and_values(
        tiny_model_path: str, one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron-core's GPT model on the converted weights, rows right-aligned, log-probs and entropies from
    the vocabulary-parallel head at temperature 0.7: the ``torch`` backend's numbers (float32, 1e-5); the
    critic's values with the torch critic's head copied in, too."""
    from rlx.plugins.modeling.worker import TorchBackendOptions, TorchWorker
    from rlx.protocols import RoleSpec

    emulate_cuda_placement(monkeypatch.setattr)
    batch = forward_batch()
    mask = batch["response_mask"].bool()
    ref = TorchWorker(RoleSpec(role="ref", model_path=tiny_model_path, trainable=False, micro_batch_size=8),
                      TorchBackendOptions(), "cpu")
    want = ref.compute_log_probs(batch, with_entropy=True, temperature=TEMPERATURE)
    got = forward_and_grads(tiny_model_path, MegatronOptions(), batch)
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(got[key][mask], want[key][mask], atol=1e-5, rtol=1e-5)
        assert not got[key][~mask].any()
    critic = TorchWorker(RoleSpec(role="critic", model_path=tiny_model_path, trainable=False, value_head=True,
                                  micro_batch_size=8), TorchBackendOptions(), "cpu")
    score = critic.model.score
    head = {"weight": score.weight.detach(), "bias": score.bias.detach()}
    values = forward_and_grads(tiny_model_path, MegatronOptions(), batch, value_head=True, head=head)["values"]
    torch.testing.assert_close(values[mask], critic.compute_values(batch)["values"][mask], atol=1e-5, rtol=1e-5)


def test_tensor_parallel_forward_and_gradients_match_one_rank(
        two_ranks: list[dict], llama_path: str, one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """TP=2 over gloo (fused QKV and fc1 split by head group and by [gate; up], vocabulary-parallel embedding
    and head, row-parallel projections with their all-reduces) gives one rank's log-probs and entropies, and
    the same gradient for every weight once gathered (float32, 1e-5)."""
    emulate_cuda_placement(monkeypatch.setattr)
    one = forward_and_grads(llama_path, MegatronOptions(), forward_batch())
    for rank in two_ranks:
        for got in (rank["forward"], rank["forward_chunked"]):
            for key in ("log_probs", "entropy"):
                torch.testing.assert_close(got[key], one[key], atol=1e-5, rtol=1e-5)
            assert set(got["grads"]) == set(one["grads"])
            for name, grad in one["grads"].items():
                torch.testing.assert_close(got["grads"][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_compiled_layers_give_the_eager_numbers_and_gradients(llama_path: str, one_rank: None,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """actor.use_torch_compile on the megatron backend: every decoder layer compiled (dynamic shapes), and the
    chunked head's element-wise work, give the eager layers' log-probs, entropies and every weight's gradient
    (float32 on the CPU; the compiler reorders sums), with no graph break (megatron-core's per-call deprecation
    warning would split each linear layer's graph). megatron-core's recomputation forks CUDA random states, so
    compiled + recomputed layers are checked on a GPU only (benchmarks/megatron_step.py)."""
    import torch._dynamo

    emulate_cuda_placement(monkeypatch.setattr)
    options = MegatronOptions()
    eager = forward_and_grads(llama_path, options, forward_batch(), head_chunk=5)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    import rlx.plugins.modeling.head as torch_head

    flags: list[bool] = []
    real = torch_head.chunked_head
    monkeypatch.setattr(torch_head, "chunked_head", lambda *a: flags.append(a[-1]) or real(*a))
    compiled = forward_and_grads(llama_path, options, forward_batch(), head_chunk=5, compiled=True)
    assert flags == [True]  # the head's element-wise work compiled too
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(compiled[key], eager[key], atol=1e-5, rtol=1e-5)
    for name, grad in eager["grads"].items():
        scale = max(1.0, grad.abs().max().item())
        torch.testing.assert_close(compiled["grads"][name], grad, atol=1e-5 * scale, rtol=1e-4, msg=name)
    torch._dynamo.reset()


@pytest.mark.parametrize("whole_vocabulary", [True, False], ids=["torch-head", "vocab-parallel"])
@pytest.mark.parametrize("which", ["qwen2", "llama"])
def test_the_chunked_head_gives_the_full_heads_numbers_and_gradients(
        which: str, whole_vocabulary: bool, tiny_model_path: str, llama_path: str, one_rank: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """actor.log_prob_chunk_size: the head's logits formed 5 response positions at a time (several chunks per
    row, one crossing rows), each chunk recomputed in the backward pass, give the full head's log-probs,
    entropies and every weight's gradient (float32, 1e-6 of each tensor's scale); tied (Qwen2: the embedding is the
    head) and untied. At one TP rank through the torch backends' chunked head (the default) and through the
    vocabulary-parallel function (``WHOLE_VOCABULARY_HEAD=False``, what TP > 1 runs)."""
    import rlx.plugins.backends.megatron as backend

    emulate_cuda_placement(monkeypatch.setattr)
    monkeypatch.setattr(backend, "WHOLE_VOCABULARY_HEAD", whole_vocabulary)
    path = llama_path if which == "llama" else tiny_model_path
    full = forward_and_grads(path, MegatronOptions(), forward_batch())
    calls: list[tuple[int, int]] = []
    real = backend.chunked_head

    def spy(hidden: torch.Tensor, *args: Any) -> Any:
        calls.append((hidden.shape[0], args[3]))
        return real(hidden, *args)

    monkeypatch.setattr(backend, "chunked_head", spy)
    chunked = forward_and_grads(path, MegatronOptions(), forward_batch(), head_chunk=5)
    batch = forward_batch()
    assert calls == [(batch["responses"].numel(), 5)]  # the head ran chunked, over every response position
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(chunked[key], full[key], atol=1e-6, rtol=1e-6)
    assert set(chunked["grads"]) == set(full["grads"])
    for name, grad in full["grads"].items():
        # float32 sums in another order: the tolerance scales with the tensor's largest gradient (the tied
        # embedding's reach 60 and differ by 1e-5 on some CPUs, 2e-7 of its scale)
        scale = max(1.0, grad.abs().max().item())
        torch.testing.assert_close(chunked["grads"][name], grad, atol=1e-6 * scale, rtol=1e-5, msg=name)



@pytest.mark.parametrize("whole_vocabulary", [True, False], ids=["torch-head", "vocab-parallel"])
def test_the_chunked_head_without_entropy_gives_zeros_and_the_same_log_probs(
        whole_vocabulary: bool, one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``with_entropy=False`` (a loss without an entropy term): entropies are 0, the log-probs and the gradients
    of the hidden states and head are those of the call with entropies, on either path at one TP rank."""
    import rlx.plugins.backends.megatron as backend
    import rlx.plugins.modeling.head as torch_head

    monkeypatch.setattr(backend, "WHOLE_VOCABULARY_HEAD", whole_vocabulary)
    calls: list[bool] = []
    real = torch_head.chunked_head

    def spy(*args: Any) -> Any:
        calls.append(args[-1])  # compiled
        return real(*args)

    monkeypatch.setattr(torch_head, "chunked_head", spy)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 16, generator=gen)
    weight = torch.randn(40, 16, generator=gen)
    targets = torch.randint(0, 40, (7,), generator=gen)
    out = {}
    for with_entropy in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = backend.chunked_head(h, w, targets, 0.7, 3, with_entropy)
        lp.sum().backward()
        out[with_entropy] = (lp.detach(), ent.detach(), h.grad, w.grad)
    assert torch.equal(out[False][1], torch.zeros(7))
    assert out[True][1].min() > 0
    for i in (0, 2, 3):  # log-probs, the hidden states' gradient, the head's
        torch.testing.assert_close(out[False][i], out[True][i], atol=1e-6, rtol=1e-6)
    assert calls == ([False, False] if whole_vocabulary else [])  # which path ran: the torch head only at one rank


def test_the_attention_core_is_pytorchs_fused_attention_with_megatrons_numbers(
        llama_path: str, one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Transformer Engine the layers' attention core is PyTorch's scaled_dot_product_attention: the
    outputs and input gradients of megatron-core's own DotProductAttention (causal, GQA 4:2; float32, 1e-6),
    and megatron-core's path where rlx's conditions do not hold (an explicit mask)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    emulate_cuda_placement(monkeypatch.setattr)
    config = read_hf_config(llama_path)
    bridge = make_bridge(config, torch.float32, config_overrides(MegatronOptions(), torch.float32, on_cpu=True))
    fused_cls = sdpa_attention_class()
    chunk = build_chunks(bridge, config, value_head=False, use_te=False, vpp=None, device="cpu")[0]
    assert all(type(layer.self_attention.core_attention) is fused_cls for layer in chunk.decoder.layers)
    fused = fused_cls(bridge.config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    plain = DotProductAttention(bridge.config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                attention_type="self")
    g = torch.Generator().manual_seed(5)
    inputs = [torch.randn(7, 3, heads, 16, generator=g) for heads in (4, 2, 2)]  # [s, b, heads, d]

    def run(module: Any, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        out = module(*leaves, mask)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), [t.grad for t in leaves]  # type: ignore[misc]

    fused_calls: list[int] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        fused_calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    (want, want_grads), (got, got_grads) = run(plain), run(fused)
    assert len(fused_calls) == 1  # the fused kernel ran (megatron's own path never calls it)
    assert got.shape == (7, 3, 64)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    mask = torch.rand(3, 1, 7, 7, generator=g) > 0.7  # True = masked out (megatron's convention)
    mask &= ~torch.eye(7, dtype=torch.bool)
    torch.testing.assert_close(run(fused, mask)[0], run(plain, mask)[0], atol=0, rtol=0)
    assert len(fused_calls) == 1  # a mask takes megatron-core's path


# -- distributed checkpoints -> Hugging Face in one CPU process (rlx export) ---------------------------------
@pytest.mark.parametrize("which", ["qwen2", "llama", "critic"])
def test_a_distributed_checkpoint_reads_back_as_the_models_weights(
        which: str, tiny_model_path: str, llama_path: str, one_rank: None, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """A checkpoint's model shards, read with PyTorch's checkpoint reader in one process (no megatron model,
    no groups: ``export_checkpoint``'s path), give every Hugging Face tensor bit for bit: the tied Qwen2, the
    untied GQA Llama, and a critic with its seeded value head."""
    emulate_cuda_placement(monkeypatch.setattr)
    path = llama_path if which == "llama" else tiny_model_path
    value_head = which == "critic"
    chunks, bridge, config = loaded_chunks(path, MegatronOptions(), value_head=value_head, seed=3)
    want = {n: t.clone() for n, t in export_hf(chunks, bridge, config, value_head=value_head, comm_device="cpu")}
    save_model_checkpoint(chunks, str(tmp_path / "dist"))
    got = dict(read_checkpoint(str(tmp_path / "dist"), config, value_head=value_head))
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    if value_head:
        assert got["score.weight"].shape == (1, 64) and got["score.weight"].abs().sum() > 0


@pytest.mark.parametrize("case", ["tp", "pp"])
def test_a_checkpoint_written_by_two_ranks_reads_in_one_process(case: str, two_ranks: list[dict],
                                                                 llama_path: str) -> None:
    """Written by 2 ranks (TP=2: each holds half of QKV, fc1, the vocabulary...; PP=2: a layer each), read in
    one process: the shards are placed by their global offsets, so every tensor is the HF original."""
    original = hf_tensors(llama_path)
    got = dict(read_checkpoint(two_ranks[0]["dist"][case], read_hf_config(llama_path), value_head=False))
    assert set(got) == set(original)
    for name, tensor in original.items():
        assert torch.equal(got[name], tensor), (case, name)


class _Planted:
    """Unpickling this creates the file ``path`` (it must never happen)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def test_reading_a_damaged_or_foreign_checkpoint_is_a_user_error(
        tiny_model_path: str, llama_path: str, one_rank: None, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    emulate_cuda_placement(monkeypatch.setattr)
    folder = tmp_path / "dist"
    chunks, _, _ = loaded_chunks(llama_path, MegatronOptions())
    save_model_checkpoint(chunks, str(folder))
    with pytest.raises(UserError, match="is missing"):
        list(read_checkpoint(str(tmp_path / "nothing"), read_hf_config(llama_path), value_head=False))
    with pytest.raises(UserError, match=r"config\.json says 3"):  # the checkpoint of another model
        config = read_hf_config(llama_path)
        config.num_hidden_layers = 3
        list(read_checkpoint(str(folder), config, value_head=False))
    (folder / "metadata.json").write_text('{"sharded_backend": "zarr"}')
    with pytest.raises(UserError, match="'zarr' format"):
        list(read_checkpoint(str(folder), read_hf_config(llama_path), value_head=False))
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    # the index is read without running code: a planted pickle is refused and never runs
    index = (folder / ".metadata").read_bytes()
    ran = tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_Planted(str(ran))))
    with pytest.raises(UserError, match="Refused to load"):
        list(read_checkpoint(str(folder), read_hf_config(llama_path), value_head=False))
    assert not ran.exists()
    (folder / ".metadata").write_bytes(index)
    assert len(list(read_checkpoint(str(folder), read_hf_config(llama_path), value_head=False))) > 0
    for shard in folder.glob("*.distcp"):
        shard.unlink()
    with pytest.raises(UserError, match=r"Cannot read .*No such file"):
        list(read_checkpoint(str(folder), read_hf_config(llama_path), value_head=False))


def test_rlx_export_writes_a_megatron_checkpoint_as_a_hugging_face_folder(
        tiny_model_path: str, one_rank: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A run folder as ``rlx train --backend megatron`` leaves it (config.yaml, a sealed checkpoint holding
    actor/dist): ``rlx export`` writes a folder that ``from_pretrained`` loads, with the checkpoint's weights,
    on a machine without a GPU."""
    import yaml
    from transformers import AutoModelForCausalLM

    from rlx.registry import get_plugin_manager
    from rlx.run import checkpoint
    from rlx.validate import load_config

    emulate_cuda_placement(monkeypatch.setattr)
    chunks, bridge, config = loaded_chunks(tiny_model_path, MegatronOptions())
    with torch.no_grad():  # weights of its own, so the test sees the checkpoint's, not the model folder's
        for p in chunks[0].parameters():
            p.add_(torch.randn_like(p) * 0.01)
    want = {n: t.clone() for n, t in export_hf(chunks, bridge, config, value_head=False, comm_device="cpu")}
    run = tmp_path / "run"
    run.mkdir()
    resolved = load_config(get_plugin_manager(), preset="tiny", shortcuts={"backend": "megatron"},
                           overrides=[f"trainer.output_dir={run}"])
    (run / "config.yaml").write_text(yaml.safe_dump(resolved.as_dict(), sort_keys=False))
    checkpoint.save(run / "checkpoints", 4, lambda tmp: save_model_checkpoint(chunks, str(tmp / "actor" / "dist")),
                    {})
    out = tmp_path / "hf"
    proc = _rlx_with_megatron(tmp_path, "export", str(run), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "global_step_4" in proc.stdout and "Warning" not in proc.stderr, proc.stderr
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}
    state = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for name, tensor in want.items():
        assert torch.equal(state[name], tensor), name
    assert torch.equal(state["lm_head.weight"], want["model.embed_tokens.weight"])  # tied
    critic = _rlx_with_megatron(tmp_path, "export", str(run), "--out", str(tmp_path / "c"), "--role", "critic")
    assert critic.returncode == 2 and "has no critic" in critic.stderr and "Traceback" not in critic.stderr


# -- checks before anything starts -----------------------------------------------------------------------
def test_layout_problems_name_every_misfit(llama_path: str) -> None:
    config = read_hf_config(llama_path)  # 4 heads, 2 key/value heads, 2 layers, vocabulary 96
    assert layout_problems(MegatronOptions(tensor_model_parallel_size=2), 4, config) == []
    problems = layout_problems(MegatronOptions(tensor_model_parallel_size=4, pipeline_model_parallel_size=3,
                                               sequence_parallel=False), 8, config)
    text = " | ".join(problems)
    assert "12 does not divide the 8 training processes" in text
    assert "does not divide the model's 2 key/value heads" in text
    assert "= 3 does not divide the model's 2 layers" in text
    assert "attention heads" not in text  # 4 heads split by 4 is fine
    assert "virtual_pipeline_model_parallel_size x" not in text
    vpp = layout_problems(MegatronOptions(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
                          2, config)
    assert vpp == ["pipeline_model_parallel_size=2 x virtual_pipeline_model_parallel_size=2 = 4 does not divide "
                   "the model's 2 layers"]
    assert layout_problems(MegatronOptions(virtual_pipeline_model_parallel_size=2), 1) == [
        "virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1"]
    assert layout_problems(MegatronOptions(sequence_parallel=True), 1) == [
        "sequence_parallel needs tensor_model_parallel_size > 1"]
    assert layout_problems(MegatronOptions(tensor_model_parallel_size=5), 5, config)[0].endswith(
        "does not divide the model's 4 attention heads")
    assert "vocabulary of 96" in layout_problems(MegatronOptions(tensor_model_parallel_size=5), 5, config)[-1]
    assert layout_problems(MegatronOptions(recompute_granularity="full"), 1) == [
        "recompute_granularity=full needs recompute_method and recompute_num_layers"]
    assert layout_problems(MegatronOptions(recompute_method="uniform"), 1) == [
        "recompute_method and recompute_num_layers apply to recompute_granularity=full only"]
    assert layout_problems(MegatronOptions(context_parallel_size=2), 2) == [
        "context_parallel_size > 1 is not supported by the megatron backend yet"]
    with pytest.raises(UserError, match=r"parallel layout does not fit.*8 training processes"):
        check_layout(MegatronOptions(tensor_model_parallel_size=3), 8)


def test_unsupported_architectures_are_user_errors(tmp_path: Path) -> None:
    from transformers import GPT2Config, Qwen2Config

    with pytest.raises(UserError, match="does not support the model type 'gpt2'"):
        check_architecture(GPT2Config(), "gpt")
    with pytest.raises(UserError, match="sliding-window"):
        check_architecture(Qwen2Config(use_sliding_window=True, max_window_layers=0), "q")
    scaled = Qwen2Config(rope_scaling={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                       "original_max_position_embeddings": 4096})
    with pytest.raises(UserError, match="rope type 'yarn'"):
        check_architecture(scaled, "q")
    with pytest.raises(UserError, match="Cannot read the model config"):
        read_hf_config(str(tmp_path))


def test_missing_megatron_core_is_a_user_error(monkeypatch: pytest.MonkeyPatch, tiny_model_path: str,
                                               tmp_path: Path) -> None:
    from rlx.plugins.backends.megatron_convert import export_checkpoint
    from rlx.protocols import RoleSpec

    require_megatron()
    monkeypatch.setitem(sys.modules, "mbridge", None)
    with pytest.raises(UserError, match="needs mbridge") as info:
        require_megatron()
    assert "rlx[megatron]" in str(info.value.hint if hasattr(info.value, "hint") else info.value)
    spec = RoleSpec(role="actor", model_path=tiny_model_path, trainable=False)
    with pytest.raises(UserError, match="rlx export of a megatron checkpoint needs mbridge"):
        export_checkpoint(str(tmp_path), spec, str(tmp_path / "out"))


def test_build_checks_layout_model_and_device(tiny_model_path: str) -> None:
    from rlx.config import RLXConfig
    from rlx.plugins.backends.megatron import build

    def ctx(nproc: int, device: str = "cuda") -> Any:
        config = RLXConfig.model_validate({"model": {"path": tiny_model_path}, "trainer": {"device": device},
                                           "launcher": {"name": "local", "nproc": nproc}})
        return SimpleNamespace(config=config)

    with pytest.raises(UserError, match=r"model's 1 key/value heads"):
        build(MegatronOptions(tensor_model_parallel_size=2), ctx(2))
    with pytest.raises(UserError, match="does not divide the 3 training processes"):
        build(MegatronOptions(pipeline_model_parallel_size=2), ctx(3))
    with pytest.raises(UserError, match="needs NVIDIA GPUs"):
        build(MegatronOptions(), ctx(1, "cpu"))
    backend = build(MegatronOptions(pipeline_model_parallel_size=2), ctx(2))
    assert backend.options.pipeline_model_parallel_size == 2
    lora = ctx(1)
    lora.config.model.lora_rank = 8
    lora.config.actor.ulysses_sequence_parallel_size = 2
    with pytest.raises(UserError, match=r"LoRA .*; actor.ulysses_sequence_parallel_size > 1"):
        build(MegatronOptions(), lora)


# -- GPU: the backend contract against the torch backend ---------------------------------------------------
def _specs(path: str) -> tuple[Any, Any, Any]:
    from rlx.protocols import RoleSpec

    schedule = {"warmup_steps": 2, "total_steps": 8, "lr_schedule": "cosine", "dtype": "float32",
                "weight_decay": 0.0}
    actor = RoleSpec(role="actor", model_path=path, trainable=True, lr=3e-4, micro_batch_size=2, **schedule)
    critic = RoleSpec(role="critic", model_path=path, trainable=True, value_head=True, lr=1e-3, micro_batch_size=2,
                      **schedule)
    ref = RoleSpec(role="ref", model_path=path, trainable=False, micro_batch_size=3, dtype="float32")
    return actor, critic, ref


@pytest.fixture
def megatron_teardown() -> Any:
    """The workers set up megatron's groups and a one-rank NCCL group in this process: remove them after."""
    yield
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.gpu
def test_same_numbers_as_the_torch_backend_on_one_gpu(tiny_model_path: str, tmp_path: Path,
                                                      megatron_teardown: None) -> None:
    """float32 on one GPU (TF32 off): log-probs, entropies and values to 1e-4, the update's losses and gradient
    norms to 1e-4 relative, weights to 1e-5; the critic's head is seeded differently, so its values are
    compared after copying the torch critic's head in. A checkpoint written after the update and loaded into a
    fresh worker repeats the next update (1e-6), and ``rlx export``'s reader gives its weights exactly."""
    from test_backend_torch import critic_batch, grpo_loss, make_batch

    from rlx.plugins.algorithms.base import CriticLoss
    from rlx.plugins.backends.megatron import MegatronWorker
    from rlx.plugins.modeling.worker import TorchBackendOptions, TorchWorker

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    actor_spec, critic_spec, ref_spec = _specs(tiny_model_path)
    batch = critic_batch()
    extra = make_batch(seed=5)
    loss = grpo_loss(loss_agg_mode="seq-mean-token-sum")
    t_ref = TorchWorker(ref_spec, TorchBackendOptions(), "cuda")
    batch.tensors["old_log_probs"] = t_ref.compute_log_probs(batch)["log_probs"]
    m_ref = MegatronWorker(ref_spec, MegatronOptions(), "cuda")
    want, got = t_ref.compute_log_probs(batch, with_entropy=True), m_ref.compute_log_probs(batch, with_entropy=True)
    mask = batch["response_mask"].bool()
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(got[key][mask], want[key][mask], atol=1e-4, rtol=1e-4)

    t_actor, m_actor = TorchWorker(actor_spec, TorchBackendOptions(), "cuda"), MegatronWorker(actor_spec,
                                                                                            MegatronOptions(), "cuda")
    minis = batch.split(4) + batch.split(4)
    t_metrics, m_metrics = t_actor.update(minis, loss), m_actor.update(minis, loss)
    for a, b in zip(t_metrics, m_metrics):
        for key in ("actor/pg_loss", "grad_norm", "lr"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    t_weights = dict(t_actor.named_weights())
    for name, tensor in m_actor.named_weights():
        torch.testing.assert_close(tensor.cpu(), t_weights[name].cpu(), atol=1e-5, rtol=0)

    m_actor.save_checkpoint(str(tmp_path / "ckpt"))
    saved = {n: t.detach().cpu().clone() for n, t in m_actor.named_weights()}
    # rlx export's reader, in this process without megatron's model: the checkpoint's weights (with the
    # optimizer's tensors beside them in the same folder)
    from transformers import AutoModelForCausalLM

    from rlx.plugins.backends.megatron_convert import export_checkpoint

    export_checkpoint(str(tmp_path / "ckpt"), actor_spec, str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name
    after = m_actor.update([extra], loss)
    resumed = MegatronWorker(actor_spec, MegatronOptions(), "cuda")
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    again = resumed.update([extra], loss)[0]
    for key, value in after[0].items():
        assert again[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key

    t_critic = TorchWorker(critic_spec, TorchBackendOptions(), "cuda")
    m_critic = MegatronWorker(critic_spec, MegatronOptions(), "cuda")
    head = m_critic.chunks[0].output_layer
    with torch.no_grad():
        head.weight.copy_(t_critic.model.score.weight)
        if t_critic.model.score.bias is not None:
            head.bias.copy_(t_critic.model.score.bias)
    v_want, v_got = t_critic.compute_values(batch)["values"], m_critic.compute_values(batch)["values"]
    torch.testing.assert_close(v_got[mask], v_want[mask], atol=1e-4, rtol=1e-4)
    c_want, c_got = t_critic.update(minis, CriticLoss(0.2)), m_critic.update(minis, CriticLoss(0.2))
    for a, b in zip(c_want, c_got):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


def test_rows_are_right_aligned_and_positions_point_at_the_token_before_each_response_token() -> None:
    """Each row's valid prompt and response tokens come first (a causal mask then never lets a token see
    padding, and positions start at 0), the length is a multiple of the TP size under sequence
    parallelism, and where[i, j] is the position whose output predicts response token j."""
    from test_backend_torch import make_batch

    from rlx.plugins.backends.megatron import right_aligned

    batch = make_batch(seed=3)
    ids, where = right_aligned(batch, 4)
    valid_p, valid_r = batch["prompt_mask"].bool(), batch["response_mask"].bool()
    longest = int((valid_p.sum(1) + valid_r.sum(1)).max())
    assert ids.shape == (len(batch), -(-longest // 4) * 4)
    for i in range(len(batch)):
        tokens = torch.cat([batch["prompts"][i][valid_p[i]], batch["responses"][i][valid_r[i]]])
        assert torch.equal(ids[i, :len(tokens)], tokens)
        assert not ids[i, len(tokens):].any()
        for j in range(int(valid_r[i].sum())):
            assert ids[i, where[i, j] + 1] == batch["responses"][i, j]


def _rlx_with_megatron(tmp_path: Path, *args: str) -> Any:
    """``rlx ARGS`` in a subprocess whose plugin manager has the installed plugins and this backend (until
    its entry point is in pyproject.toml)."""
    import subprocess

    code = ("import sys\nfrom rlx.registry import PluginManager, reset_plugin_manager\n"
            "import rlx.plugins.backends.megatron as m\nfrom rlx.cli.main import run\n"
            "pm = PluginManager()\npm.load_entry_points()\n"
            "if ('backend', 'megatron') not in pm.components():\n    pm.register(m, name='backend_megatron')\n"
            f"reset_plugin_manager(pm)\nrun({list(args)!r})\n")
    env = {**os.environ, "RLX_CACHE": str(tmp_path / "cache"), "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def test_rlx_train_refuses_a_bad_layout_with_one_message(tmp_path: Path) -> None:
    proc = _rlx_with_megatron(tmp_path, "train", "--preset", "tiny", "--backend", "megatron", "trainer.device=auto",
                              "backend.tensor_model_parallel_size=2", f"trainer.output_dir={tmp_path / 'run'}")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stderr.count("Error:") == 1, proc.stderr
    assert "does not divide the 1 training processes" in proc.stderr
    assert "does not divide the model's 1 key/value heads" in proc.stderr
    shown = _rlx_with_megatron(tmp_path, "config", "show", "--preset", "tiny", "--backend", "megatron",
                               "backend.tensor_model_parallel_size=2")
    assert shown.returncode == 0, shown.stderr
    assert "tensor_model_parallel_size: 2" in shown.stdout and "use_distributed_optimizer: false" in shown.stdout


def test_the_optimizers_torch_kernels_give_megatrons_fallback_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """use_torch_kernels' gradient norm and scaled copies against the arithmetic of megatron-core's own
    fallbacks (per-tensor norms, then the norm of the norms; dst = src * scale), float64 references; the
    module functions it replaces are swapped only where they are megatron's fallbacks."""
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    from rlx.plugins.backends.megatron import _foreach_l2_norm, _foreach_scale, use_torch_kernels

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=g) for shape in ((7, 5), (3,), (64, 33), (1,))]
    want = torch.stack([t.double().norm() for t in grads]).norm()
    norm, _ = _foreach_l2_norm(2048 * 32, None, [grads], False)
    assert norm.shape == (1,) and norm.dtype == torch.float32
    assert torch.allclose(norm.double(), want.reshape(1), rtol=1e-6)

    masters = [t.clone() for t in grads]
    params = [torch.zeros_like(t, dtype=torch.bfloat16) for t in grads]
    _foreach_scale(2048 * 32, None, [masters, params], 1.0)  # master weights into the bf16 parameters
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(params, masters))
    _foreach_scale(2048 * 32, None, [masters, params], 0.25)
    assert all(torch.equal(p, (m * 0.25).to(torch.bfloat16)) for p, m in zip(params, masters))
    _foreach_scale(2048 * 32, None, [masters, masters], 0.5)  # in place: the clipped gradients
    assert all(torch.equal(m, t * 0.5) for m, t in zip(masters, grads))

    for module, name in ((clip_grads, "l2_norm_impl"), (clip_grads, "multi_tensor_scale_impl"),
                         (mcore_optimizer, "multi_tensor_scale_impl")):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    fallbacks = clip_grads.l2_norm_impl is mcore_utils.local_multi_tensor_l2_norm
    cpu = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    use_torch_kernels(SimpleNamespace(optimizer=cpu))
    assert cpu.param_groups[0]["fused"] is not True  # CPU parameters: torch's default form stays
    if fallbacks:  # neither Transformer Engine nor Apex installed (as here)
        assert clip_grads.l2_norm_impl is _foreach_l2_norm
        assert clip_grads.multi_tensor_scale_impl is _foreach_scale
        assert mcore_optimizer.multi_tensor_scale_impl is _foreach_scale
