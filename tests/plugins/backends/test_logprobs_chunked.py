"""Log-probs and entropies from the head in chunks (``log_prob_chunk_size``): the plain path's numbers and
gradients, and no (positions x vocabulary) float32 tensor beyond one chunk, forward or backward.

Tolerances: float32 on the CPU, the same products summed in another order: 1e-5 absolute on log-probs
and entropies, 1e-5 relative to each gradient's largest entry. bfloat16: both paths round the same
bf16 logits, then reduce in float32: 1e-3.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from test_backend_torch import grpo_loss, make_batch
from test_compile import needs_cxx_compiler
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rlx.plugins.algorithms.functional import entropy_from_logits, log_probs_from_logits
from rlx.plugins.modeling import head
from rlx.plugins.modeling.head import chunked_head, fused_head_supported
from rlx.plugins.modeling.worker import TorchBackendOptions, TorchWorker
from rlx.protocols import RoleSpec
from rlx.records import ForwardOptions, LossContext

VOCAB = 4096


def plain(hidden, weight, bias, targets, temperature):
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    return log_probs_from_logits(logits[None], targets[None])[0], entropy_from_logits(logits)


def leaves(n: int = 11, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, 16, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(50, 16, generator=g) * 0.5).to(dtype).requires_grad_()
    bias = (torch.randn(50, generator=g) * 0.1).to(dtype).requires_grad_()
    targets = torch.randint(0, 50, (n,), generator=g)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return hidden, weight, bias, targets, g_lp, g_ent


def grads_of(fn, hidden, weight, bias, targets, g_lp, g_ent, use):
    params = [t for t in (hidden, weight, bias) if t is not None]
    for t in params:
        t.grad = None
    lp, ent = fn(hidden, weight, bias, targets)
    loss = (lp * g_lp).sum() * ("lp" in use) + (ent * g_ent).sum() * ("ent" in use)
    loss.backward()
    return lp.detach(), ent.detach(), [t.grad.clone() for t in params]


def assert_grads(got, want):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5 * float(w.abs().max()), rtol=0)


@pytest.mark.parametrize("use", [("lp",), ("ent",), ("lp", "ent")])
@pytest.mark.parametrize("chunk", [1, 4, 11, 64])
def test_chunked_head_equals_the_plain_path(chunk, use):
    hidden, weight, bias, targets, g_lp, g_ent = leaves()
    want = grads_of(lambda h, w, b, t: plain(h, w, b, t, 0.7), hidden, weight, bias, targets, g_lp, g_ent, use)
    got = grads_of(lambda h, w, b, t: chunked_head(h, w, b, t, 0.7, chunk), hidden, weight, bias, targets,
                   g_lp, g_ent, use)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)
    assert_grads(got[2], want[2])


@needs_cxx_compiler
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("use", [("lp",), ("ent",), ("lp", "ent")])
def test_compiled_chunked_head_equals_the_plain_path(use, temperature):
    """use_torch_compile: the per-chunk element-wise work (statistics forward, logit gradients backward) runs
    compiled, the one-hot term as a comparison instead of a scatter. Chunks of 4 over 11 positions: the last
    chunk is shorter (the row count is dynamic from the first compilation). Same tolerances as the eager
    head."""
    from torch._dynamo.utils import counters

    hidden, weight, bias, targets, g_lp, g_ent = leaves()
    want = grads_of(lambda h, w, b, t: plain(h, w, b, t, temperature), hidden, weight, bias, targets, g_lp,
                    g_ent, use)
    torch._dynamo.reset()
    counters.clear()
    got = grads_of(lambda h, w, b, t: chunked_head(h, w, b, t, temperature, 4, compiled=True), hidden, weight,
                   bias, targets, g_lp, g_ent, use)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)
    assert_grads(got[2], want[2])
    assert counters["stats"]["unique_graphs"] >= 2  # the statistics and the gradients ran compiled


def test_spans_leave_no_chunk_of_one_row_but_a_single_row():
    def sizes(n: int, chunk: int) -> list[int]:
        return [p.stop - p.start for p in head._spans(n, chunk)]

    assert sizes(11, 4) == [4, 4, 3]
    assert sizes(9, 4) == [4, 3, 2]  # the last row alone takes one from the chunk before it
    assert sizes(5, 2) == [2, 2, 1]
    assert sizes(8, 4) == [4, 4]
    assert sizes(1, 4) == [1]
    assert sizes(0, 4) == []
    assert sizes(5, 1) == [1, 1, 1, 1, 1]


@needs_cxx_compiler
def test_compiled_chunked_head_compiles_once_whatever_the_row_counts():
    """A later compilation costs its step seconds (1.4 s of a 0.5B GRPO update on an H100, at its third step):
    after the first call, no row count, chunk position or single-row chunk compiles the head again, and each
    gives the plain path's numbers and gradients."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    graphs = None
    for n in (11, 9, 13, 5, 2, 1, 17):
        hidden, weight, bias, targets, g_lp, g_ent = leaves(n, seed=n)
        want = grads_of(lambda h, w, b, t: plain(h, w, b, t, 0.9), hidden, weight, bias, targets, g_lp, g_ent,
                        ("lp", "ent"))
        got = grads_of(lambda h, w, b, t: chunked_head(h, w, b, t, 0.9, 4, compiled=True), hidden, weight, bias,
                       targets, g_lp, g_ent, ("lp", "ent"))
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)
        assert_grads(got[2], want[2])
        if graphs is None:
            graphs = counters["stats"]["unique_graphs"]
            assert graphs >= 2  # the statistics and the gradients, compiled
        assert counters["stats"]["unique_graphs"] == graphs, f"{n} rows compiled the head again"


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_chunked_head_on_a_gpu_at_a_real_vocabulary(compiled):
    """bf16 on a GPU with Qwen2.5's vocabulary (151,936): the eager and the compiled (Triton) head equal the
    plain path run in float32 on the same bf16 inputs. Tolerances: log-probs and entropies 2e-2 (bf16
    logits), gradients 2e-2 of each one's largest entry."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, hdim, vocab = 1000, 256, 151936
    hidden = torch.randn(n, hdim, generator=g, device="cuda").bfloat16().requires_grad_()
    weight = (torch.randn(vocab, hdim, generator=g, device="cuda") * 0.1).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g, device="cuda")
    g_lp, g_ent = torch.randn(n, generator=g, device="cuda"), torch.randn(n, generator=g, device="cuda")
    got = grads_of(lambda h, w, b, t: chunked_head(h, w, None, t, 0.9, 384, compiled=compiled), hidden,
                   weight, None, targets, g_lp, g_ent, ("lp", "ent"))
    leaves32 = [hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()]
    want = grads_of(lambda h, w, b, t: plain(h, w, None, t, 0.9), *leaves32, None, targets, g_lp, g_ent,
                    ("lp", "ent"))
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=2e-2, rtol=0)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a.float(), b, atol=2e-2 * float(b.abs().max()), rtol=0)


def test_head_entropy_is_exact_for_large_logits():
    """The entropy comes from sums shifted by the row maximum (log s - t / s), so logits in the hundreds lose
    nothing to cancellation: a row of equal logits has entropy log V whatever their size."""
    for level in (0.0, 300.0, -300.0):
        z = torch.full((2, 50), level)
        lse, chosen, entropy = head._logit_stats(z, torch.tensor([0, 7]), 1.0)
        torch.testing.assert_close(lse, torch.full((2,), level + math.log(50)), atol=1e-6, rtol=0)
        torch.testing.assert_close(entropy, torch.full((2,), math.log(50)), atol=1e-6, rtol=0)
        torch.testing.assert_close(chosen, torch.full((2,), -math.log(50)), atol=1e-6, rtol=0)


def test_chunked_head_in_bfloat16_reduces_in_float32():
    hidden, weight, bias, targets, _, _ = leaves(dtype=torch.bfloat16)
    lp, ent = chunked_head(hidden, weight, bias, targets, 1.0, 4)
    assert lp.dtype == ent.dtype == torch.float32
    want_lp, want_ent = plain(hidden, weight, bias, targets, 1.0)
    torch.testing.assert_close(lp, want_lp, atol=1e-3, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=1e-3, rtol=0)
    (lp.sum() + ent.sum()).backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> str:
    """A one-layer Qwen2 with a vocabulary of 4096: the logits dwarf everything else in the pass."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
                         max_position_embeddings=64)
    path = tmp_path_factory.mktemp("wide")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def worker(path: str, chunk: int, packed: bool = True) -> TorchWorker:
    spec = RoleSpec(role="actor", model_path=path, trainable=True, lr=1e-3, micro_batch_size=8,
                    forward=ForwardOptions(log_prob_chunk_size=chunk, use_remove_padding=packed))
    return TorchWorker(spec, TorchBackendOptions(), "cpu")


def batch_for(vocab: int):
    return make_batch()


def ctx_of(batch) -> LossContext:
    """One mini-batch on one rank: its own counts."""
    return LossContext(float(batch["response_mask"].sum()), float(len(batch)))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_worker_log_probs_entropy_and_gradients_equal_the_plain_path(wide_model, one_thread, packed):
    batch = batch_for(VOCAB)
    mask = batch["response_mask"].bool()
    loss_fn = grpo_loss(entropy_coeff=0.01)  # the entropy's gradient counts too
    out = {}
    for chunk in (0, 5):
        w = worker(wide_model, chunk, packed)
        lp = w.compute_log_probs(batch, with_entropy=True)
        loss, _ = loss_fn(w.forward(batch, grad=True), batch, ctx_of(batch))
        loss.backward()
        out[chunk] = lp, {n: p.grad.clone() for n, p in w.model.named_parameters()}
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(out[5][0][key][mask], out[0][0][key][mask], atol=1e-5, rtol=0, msg=key)
    assert_grads(list(out[5][1].values()), list(out[0][1].values()))


def storages(tree: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)}


class VocabTensors(TorchDispatchMode):
    """Records, for every floating tensor an op allocates (a view of its inputs is not an allocation) whose
    last axis is the vocabulary, how many positions it spans (its size over the vocabulary)."""

    def __init__(self) -> None:
        super().__init__()
        self.positions: list[tuple[int, torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = storages((args, kwargs))
        for t in tree_flatten(out)[0]:
            if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() and t.shape[-1] == VOCAB
                    and t.untyped_storage().data_ptr() not in inputs):
                self.positions.append((t.numel() // VOCAB, t.dtype))
        return out


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_no_float32_copy_of_the_logits_beyond_one_chunk(wide_model, one_thread, packed):
    """The log-prob pass and a training forward + backward: with chunks of 4 positions no tensor spans
    more than 4 positions of the vocabulary; the plain path makes float32 (positions x vocabulary)
    tensors over every response position (the check sees them)."""
    batch = batch_for(VOCAB)
    positions = int(batch["response_mask"].sum())
    largest = {}
    for chunk in (0, 4):
        w = worker(wide_model, chunk, packed)
        with VocabTensors() as seen:
            w.compute_log_probs(batch, with_entropy=True)
            loss, _ = grpo_loss(entropy_coeff=0.01)(w.forward(batch, grad=True), batch, ctx_of(batch))
            loss.backward()
        largest[chunk] = max(n for n, _ in seen.positions)
        assert any(dtype == torch.float32 for _, dtype in seen.positions)
    assert largest[0] >= positions
    assert largest[4] <= 4


def test_models_that_transform_the_logits_keep_the_plain_path(wide_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(wide_model)
    assert fused_head_supported(model)
    model.config.final_logit_softcapping = 30.0  # Gemma 2's tanh cap after lm_head
    assert not fused_head_supported(model)


def test_chunked_head_under_autocast_computes_in_its_dtype():
    """float32 master weights under bf16 autocast (a trained role on a GPU; here the CPU's autocast): the
    logits are bf16 products as autocast's own linear layer makes them, gradients reach the float32 leaves."""
    hidden, weight, bias, targets, g_lp, g_ent = leaves()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = grads_of(lambda h, w, b, t: plain(h, w, b, t, 1.0), hidden, weight, bias, targets, g_lp, g_ent,
                        ("lp", "ent"))
        got = grads_of(lambda h, w, b, t: chunked_head(h, w, b, t, 1.0, 4), hidden, weight, bias, targets, g_lp,
                       g_ent, ("lp", "ent"))
    exact = grads_of(lambda h, w, b, t: plain(h, w, b, t, 1.0), hidden, weight, bias, targets, g_lp, g_ent,
                     ("lp", "ent"))
    torch.testing.assert_close(got[0], want[0], atol=1e-3, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=1e-3, rtol=0)
    assert float((got[0] - exact[0]).abs().max()) > 1e-4  # bf16 products, not float32 ones
    for g, w in zip(got[2], want[2]):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=2e-2 * float(w.abs().max()), rtol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = chunked_head(hidden, weight, bias, targets, 1.0, 4)
    with MatmulDtypes() as seen:  # the backward recomputes the logits and forms gradients in bf16 too
        (lp * g_lp + ent * g_ent).sum().backward()
    assert seen.dtypes == {torch.bfloat16}


class MatmulDtypes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.dtypes.update(a.dtype for a in args if isinstance(a, torch.Tensor))
        return func(*args, **(kwargs or {}))
