"""The decode step's Triton sampling kernels (``rlx.plugins.rollout.hf_kernels``) against torch's numbers.

On a machine without a GPU these run under Triton's interpreter (``TRITON_INTERPRET=1``, set here before
Triton is imported), which executes the kernels on CPU tensors: it checks what they compute, not their speed
or the GPU's limits. Triton is not part of rlx's dependencies; the module skips where it is not installed::

    TRITON_INTERPRET=1 python -m pytest -q tests/plugins/rollout/test_hf_kernels_triton.py   # pip install triton
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)
pytest.importorskip("triton")

from rlx.plugins.rollout.hf_kernels import _triton_race

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def race(logits: torch.Tensor, inv_t: float, seed: int, greedy: bool, block: int) -> tuple[torch.Tensor, ...]:
    run = _triton_race()
    assert run is not None
    return run(logits.to(DEVICE), inv_t, torch.tensor([seed], device=DEVICE), greedy, block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_the_arg_max_and_its_log_prob(dtype: torch.dtype) -> None:
    """Greedy: the arg-max of each row and its log-prob under softmax(x / T), across several vocabulary blocks
    (300 entries in blocks of 64, the last one partial), bf16 and float32 logits."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(7, 300, generator=g) * 3).to(dtype)
    token, log_prob = race(logits, 1 / 0.7, 0, True, 64)
    x = logits.float() / 0.7
    assert torch.equal(token.cpu(), x.argmax(-1))
    want = torch.log_softmax(x, -1).gather(-1, token.cpu()[:, None]).squeeze(-1)
    torch.testing.assert_close(log_prob.cpu(), want, atol=1e-5, rtol=1e-5)


def test_the_draws_follow_the_softmax_at_the_temperature() -> None:
    """1,000 draws from one row's logits (40 tokens, one block) fall on each token with its softmax
    probability at the temperature (each frequency within 4.5 standard errors), and each draw's log-prob is the
    log-softmax at the drawn token. (The interpreter runs one program at a time: a few thousand take seconds.)"""
    logits = torch.linspace(-2.0, 2.0, 40)[torch.randperm(40, generator=torch.Generator().manual_seed(1))]
    rows = 1000
    for inv_t in (1.0, 2.0):
        token, log_prob = race(logits.expand(rows, -1).contiguous(), inv_t, 1234, False, 64)
        p = torch.softmax(logits * inv_t, -1)
        freq = torch.bincount(token.cpu(), minlength=40).double() / rows
        se = (p.double() * (1 - p.double()) / rows).sqrt()
        assert ((freq - p.double()).abs() <= 4.5 * se + 1e-9).all(), (freq - p).abs().max()
        torch.testing.assert_close(log_prob.cpu(), torch.log_softmax(logits * inv_t, -1)[token.cpu()], atol=1e-5,
                                   rtol=1e-5)


def test_seeds_and_rows_draw_their_own_numbers() -> None:
    """The same seed gives the same tokens; another seed other tokens; rows with identical logits draw apart."""
    logits = torch.zeros(64, 1000)  # uniform: every token equally likely
    a, _ = race(logits, 1.0, 5, False, 512)
    b, _ = race(logits, 1.0, 5, False, 512)
    c, _ = race(logits, 1.0, 6, False, 512)
    assert torch.equal(a, b)
    assert (a != c).float().mean() > 0.9
    assert len(set(a.tolist())) > 55  # 64 rows over 1000 tokens: nearly all distinct


def test_the_decode_step_samples_through_the_kernel(tiny_model_path: str, tmp_path) -> None:
    """The hf engine's slot decoder on the tiny model with the kernel in its step (the interpreter's CPU tensors
    here): every recorded log-prob is the training forward's, a prompt's samples differ, and each step draws
    new numbers (a row's tokens are not one token repeated)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlx.plugins.modeling.head import response_log_probs
    from rlx.plugins.rollout.hf import HFRollout, HFRolloutOptions
    from rlx.protocols import SamplingParams
    from rlx.run.data import PromptExample, collate

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    torch.manual_seed(1234)
    with torch.no_grad():  # random weights: spread-out distributions (the built-in model answers a digit)
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    rollout = HFRollout(str(tmp_path), HFRolloutOptions(decoder="static", prompt_bucket=8, compile="off"), DEVICE,
                        [tok.eos_token_id], tok.pad_token_id)
    ids = [[11, 23, 37, 5, 8], [42, 17], [3, 4, 5, 6, 7, 9]]
    prompts = collate([PromptExample(x, tok.decode(x), "s", str(i), {}) for i, x in enumerate(ids)], tok.pad_token_id)
    torch.manual_seed(0)
    out = rollout.generate(prompts, SamplingParams(n=4, max_tokens=10, temperature=1.0))
    decoder = list(rollout.static.decoders.values())[-1]
    assert decoder.fused and decoder.noise is None
    mask = out["response_mask"].bool()
    with torch.no_grad():
        lp, _ = response_log_probs(rollout.model, out, 1.0, with_entropy=False)
    torch.testing.assert_close(out["rollout_log_probs"][mask], lp[mask], atol=1e-4, rtol=0)
    rows = out["responses"].view(3, 4, -1)
    assert all(len({tuple(r.tolist()) for r in rows[i]}) > 1 for i in range(3))
    assert all(len(set(r[m].tolist())) > 1 for r, m in zip(out["responses"], mask) if m.sum() > 3)


# bf16 only on a GPU: Triton's interpreter gets bf16 matrix products wrong (the unsplit kernel too)
HALF = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("splits", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", HALF)
def test_the_decode_attention_in_splits_equals_the_reference(splits: int, dtype: torch.dtype) -> None:
    """The slot attention kernel with its columns cut into ranges (``splits``; 1 is the unsplit kernel) equals
    the plain-torch reference, caches included: rows of different starts, one with no earlier column, one whose
    columns all lie in the last range, grouped query heads (7 per key/value head, padded to 16)."""
    from rlx.plugins.rollout.hf_static import _triton_attention, attend_reference

    torch.manual_seed(0)
    b, cap, heads, kv_heads, d, length, slot = 5, 8, 14, 2, 64, 300, 260
    q = torch.randn(b, heads, d, dtype=dtype)
    k, v = (torch.randn(b, kv_heads, d, dtype=dtype) for _ in range(2))
    caches = [torch.randn(cap, kv_heads, length, d, dtype=dtype) for _ in range(2)]
    start = torch.tensor([0, 37, slot, 250, 129])  # row 2: no earlier column; row 3: the last range only
    at = torch.tensor([slot])
    ref = [c.clone() for c in caches]
    got = _triton_attention()(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), *(c.to(DEVICE) for c in caches),
                              start.to(DEVICE), at.to(DEVICE), d ** -0.5, splits=splits)
    want = attend_reference(q.float(), k.float(), v.float(), *(c.float() for c in ref), start, at, d ** -0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), want, atol=tol, rtol=tol)


def test_the_new_column_is_written_once_into_the_cache() -> None:
    """Split 0 alone writes the new key and value at the current column of every row (the other splits read)."""
    from rlx.plugins.rollout.hf_static import _triton_attention

    torch.manual_seed(1)
    b, kv_heads, d, length, slot = 3, 2, 64, 200, 150
    q = torch.randn(b, 4, d)
    k, v = torch.randn(b, kv_heads, d), torch.randn(b, kv_heads, d)
    caches = [torch.zeros(4, kv_heads, length, d) for _ in range(2)]
    _triton_attention()(q, k, v, caches[0], caches[1], torch.zeros(b, dtype=torch.long), torch.tensor([slot]),
                        d ** -0.5, splits=3)
    assert torch.equal(caches[0][:b, :, slot], k) and torch.equal(caches[1][:b, :, slot], v)
    caches[0][:b, :, slot] = 0
    caches[1][:b, :, slot] = 0
    assert not caches[0].any() and not caches[1].any()


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", HALF)
def test_the_rotary_embedding_inside_the_attention_kernel(splits: int, dtype: torch.dtype) -> None:
    """rlx::slot_attention_rope's kernel on q/k/v as views of one fused q/k/v product (no copies), rotating q
    and the new key itself, equals the rotation in torch followed by the reference attention; the cache holds
    the rotated key."""
    from rlx.plugins.rollout.hf_static import _rotate, _triton_attention, attend_reference

    torch.manual_seed(2)
    b, heads, kv_heads, d, length, slot = 4, 14, 2, 64, 200, 130
    qkv = torch.randn(b, (heads + 2 * kv_heads) * d, dtype=dtype)
    nq, nk = heads * d, kv_heads * d
    q = qkv[:, :nq].reshape(b, heads, d)
    k = qkv[:, nq:nq + nk].reshape(b, kv_heads, d)
    v = qkv[:, nq + nk:].reshape(b, kv_heads, d)
    angle = torch.rand(b, d // 2) * 6
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(dtype), torch.cat([angle.sin()] * 2, -1).to(dtype)
    caches = [torch.randn(b, kv_heads, length, d, dtype=dtype) for _ in range(2)]
    ref = [c.clone().float() for c in caches]
    start = torch.tensor([0, 17, 100, slot])
    at = torch.tensor([slot])
    got = _triton_attention()(q, k, v, caches[0], caches[1], start, at, d ** -0.5, splits=splits, cos=cos, sin=sin)
    qr, kr = (_rotate(x.float(), cos.float()[:, None], sin.float()[:, None]) for x in (q, k))
    want = attend_reference(qr, kr, v.float(), *ref, start, at, d ** -0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(caches[0][:, :, slot].float(), kr, atol=tol, rtol=tol)


@pytest.mark.parametrize("shape,dtype", [((64, 96), torch.bfloat16), ((1001,), torch.uint8),
                                         ((3, 5000), torch.float32)])
def test_the_l2_prefetchs_load_kernel_reads_any_tensor_and_writes_nothing(shape, dtype):
    """hf_prefetch's ``load`` mode (the one the interpreter can run: the other two are PTX) covers tensors of
    whole and partial blocks, in words of 4 bytes or single bytes, and leaves its scratch as it was."""
    from rlx.plugins.rollout.hf_prefetch import _kernels

    run = _kernels()
    assert run is not None
    flat = (torch.arange(int(torch.tensor(shape).prod())) % 7).reshape(shape).to(dtype).to(DEVICE)
    scratch = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    run(flat, scratch, "load")
    assert int(scratch.item()) == 0
