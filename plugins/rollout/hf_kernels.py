"""GPU kernels of the ``hf`` engine's decode step beside the attention of ``hf_static``: sampling fused into one
pass over the logits.

``rlx::race_sample`` draws each row's next token from softmax(logits * inv_temperature) by the Gumbel-max race
(the arg-max of x + G with G = -log(-log U), U uniform: the same law as ``Sampler.race``'s x - log E with E
exponential, since -log U is exponential) and returns its log-prob x_token - logsumexp(x). The Triton kernel
reads the logits once, in their own dtype, and draws U in registers from a seed (Philox, counter = the
logit's flat index), so no (rows, vocabulary) noise or float32 copy is written; ``greedy`` takes the arg-max
of x. Each program reduces one block of one row's vocabulary (maximum, sum of exponentials, the block's
winner); a second, one-program-per-row kernel combines the blocks. The seed is a (1,) int64 tensor on the
device that the caller redraws before each call (``Tensor.random_``, which a CUDA graph replays with a fresh
draw each time), so every call and every row gets its own numbers. Off the GPU (or without Triton) the op is
the same computation in torch, with its uniform numbers from torch's generator.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

RACE_BLOCK = 4096  # vocabulary entries per program


@functools.cache
def _triton_race() -> Any:
    """(run(logits, inv_temperature, seed, greedy, block) -> (token, log_prob)), or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def blocks(x_ptr, seed_ptr, m_ptr, s_ptr, best_ptr, idx_ptr, chosen_ptr, inv_t, V, s_xb, NB,
               GREEDY: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        cols = part * BLOCK + tl.arange(0, BLOCK)
        inside = cols < V
        x = tl.load(x_ptr + row * s_xb + cols, mask=inside, other=float("-inf")).to(tl.float32) * inv_t
        m = tl.max(x, axis=0)
        s = tl.sum(tl.where(inside, tl.exp(x - m), 0.0), axis=0)
        if GREEDY:
            race = x
        else:
            seed = tl.load(seed_ptr).to(tl.int32)
            u = tl.rand(seed, (row * V + cols).to(tl.int32))
            u = tl.minimum(tl.maximum(u, 1.0e-12), 1.0 - 1.0e-7)
            race = x - tl.log(-tl.log(u))
        race = tl.where(inside, race, float("-inf"))
        best = tl.max(race, axis=0)
        idx = tl.min(tl.where(race == best, cols, V), axis=0)  # the first winner, as torch's arg-max
        chosen = tl.max(tl.where(cols == idx, x, float("-inf")), axis=0)
        out = row * NB + part
        tl.store(m_ptr + out, m)
        tl.store(s_ptr + out, s)
        tl.store(best_ptr + out, best)
        tl.store(idx_ptr + out, idx)
        tl.store(chosen_ptr + out, chosen)

    @triton.jit
    def combine(m_ptr, s_ptr, best_ptr, idx_ptr, chosen_ptr, token_ptr, lp_ptr, NB, NB_PAD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        p = tl.arange(0, NB_PAD)
        real = p < NB
        at = row * NB + p
        m = tl.load(m_ptr + at, mask=real, other=float("-inf"))
        s = tl.load(s_ptr + at, mask=real, other=0.0)
        best = tl.load(best_ptr + at, mask=real, other=float("-inf"))
        top = tl.max(m, axis=0)
        lse = top + tl.log(tl.sum(s * tl.exp(m - top), axis=0))
        winner = tl.max(best, axis=0)
        first = tl.min(tl.where(best == winner, p, NB_PAD), axis=0)  # blocks run in vocabulary order
        token = tl.load(idx_ptr + row * NB + first)
        chosen = tl.load(chosen_ptr + row * NB + first)
        tl.store(token_ptr + row, token)
        tl.store(lp_ptr + row, chosen - lse)

    def run(logits: Any, inv_temperature: float, seed: Any, greedy: bool, block: int = RACE_BLOCK) -> Any:
        import torch

        b, vocab = logits.shape
        nb = triton.cdiv(vocab, block)
        f32 = {"dtype": torch.float32, "device": logits.device}
        m, s, best, chosen = (torch.empty(b, nb, **f32) for _ in range(4))
        idx = torch.empty(b, nb, dtype=torch.int64, device=logits.device)
        token = torch.empty(b, dtype=torch.int64, device=logits.device)
        log_prob = torch.empty(b, **f32)
        if b:
            blocks[(b, nb)](logits, seed, m, s, best, idx, chosen, inv_temperature, vocab, logits.stride(0), nb,
                            GREEDY=greedy, BLOCK=block, num_warps=8 if block >= 2048 else 4)
            combine[(b,)](m, s, best, idx, chosen, token, log_prob, nb, NB_PAD=max(16, triton.next_power_of_2(nb)))
        return token, log_prob

    return run


def race_reference(logits: torch.Tensor, inv_temperature: float, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's law in torch (CPU, float32 logits, no Triton): x = logits * inv_temperature, the arg-max of
    x + Gumbel noise from torch's generator (of x when greedy), its log-prob x_token - logsumexp(x)."""
    import torch

    x = logits.float() * inv_temperature
    if greedy:
        token = x.argmax(-1)
    else:
        u = torch.rand_like(x).clamp(1e-12, 1.0 - 1e-7)
        token = (x - (-u.log()).log()).argmax(-1)
    return token, x.gather(-1, token.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)


def _interpreted() -> bool:
    """Triton's interpreter runs kernels on CPU tensors (``TRITON_INTERPRET=1``: the tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def race_available(device: Any) -> bool:
    """Whether the decode step on ``device`` samples through ``rlx::race_sample``'s kernel (a GPU with Triton)."""
    return (str(device).startswith("cuda") or _interpreted()) and _triton_race() is not None


def race_usable(logits: Any) -> bool:
    """Whether ``rlx::race_sample`` runs its Triton kernel for these logits (a GPU and Triton)."""
    return (bool(logits.is_cuda) or _interpreted()) and logits.dim() == 2 and _triton_race() is not None


@functools.cache
def race_op() -> Any:
    """``rlx::race_sample(logits, inv_temperature, seed, greedy) -> (token, log_prob)`` (registered once): the
    Triton kernels on a GPU, :func:`race_reference` elsewhere; opaque to torch.compile."""
    import torch

    schema = "(Tensor logits, float inv_temperature, Tensor seed, bool greedy) -> (Tensor, Tensor)"

    @torch.library.custom_op("rlx::race_sample", mutates_args=(), schema=schema)
    def race_sample(logits: torch.Tensor, inv_temperature: float, seed: torch.Tensor,
                    greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if race_usable(logits):
            return _triton_race()(logits if logits.stride(-1) == 1 else logits.contiguous(), inv_temperature, seed,
                                  greedy)
        return race_reference(logits, inv_temperature, greedy)

    @race_sample.register_fake
    def _(logits: torch.Tensor, inv_temperature: float, seed: torch.Tensor,
          greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        b = logits.shape[0]
        return (logits.new_empty(b, dtype=torch.int64), logits.new_empty(b, dtype=torch.float32))

    return race_sample
