"""``rlx::l2_prefetch``: the slot decode step's next weights pulled into the GPU's L2 cache on a side stream.

At a few rows a decode step's matrix products are far from the memory bandwidth they could use: each is a
small kernel that spends much of its few microseconds starting up and waiting for its first bytes (on an H100
at 64 rows, the MLP's gate/up product reads 17.4 MB in 8.6 us and its down product 8.7 MB in 9.0 us, against
5.2 and 2.6 us at full bandwidth). While the attention half of a layer runs (its q/k/v product, the attention
over the cache, the output product, two norms), the memory system has bandwidth to spare; this op forks a side
stream there that asks for the layer's MLP weights, so the MLP's products then read them from L2. The request
is a pure read, so nothing waits on it: the main stream goes on at once, and the side stream joins it at the
end of the step (:func:`join`, needed so that a CUDA graph recording the step closes). In a recorded graph the
fork and the join are edges between the two streams' kernels and cost nothing at replay.

How the bytes are asked for is :data:`MODE`:

- ``line``: ``prefetch.global.L2::evict_last``, one cache line of 128 bytes per lane (sm_80 and later);
- ``bulk``: ``cp.async.bulk.prefetch.L2.global``, one request for 16 KB per lane (the TMA unit, sm_90 and later);
- ``load``: plain loads of every 16 bytes whose values are discarded (any GPU, and Triton's CPU interpreter);
- ``off``: nothing (the op is not called).

Which of them helps, if any, is measured (``benchmarks/decode_speed.py --l2-prefetch``); :data:`SCHEDULE`
says what is asked for where: ``mlp`` the layer's gate/up and down weights after its q/k/v product, ``mlp+next``
also the next layer's q/k/v and output weights after the gate/up product. A kernel that fails to build or run
at its first (eager) launch turns the prefetch off for the process with a warning: it is only ever a hint.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

Mode = Literal["off", "line", "bulk", "load"]
MODE: Mode = "off"
SCHEDULE: Literal["mlp", "mlp+next"] = "mlp"
LINE = 128  # bytes per request in line mode (an L2 cache line)
BULK = 16384  # bytes per request in bulk mode
LOAD = 16  # bytes per lane in load mode (one 16-byte vector)
LANES = {"line": 1024, "bulk": 32, "load": 1024}  # requests per program
WARPS = {"line": 4, "bulk": 1, "load": 4}

_pending: list[Any] = []  # side streams forked since the last join (Python runs only while eager or recording)


@functools.cache
def _kernels() -> Any:
    """The Triton kernel, by mode: ``run(flat_bytes, scratch, mode)``; None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def lines(ptr, n_bytes, scratch_ptr, LANES: tl.constexpr, STEP: tl.constexpr):
        offs = (tl.program_id(0).to(tl.int64) * LANES + tl.arange(0, LANES)) * STEP
        at = ptr + tl.minimum(offs, n_bytes - 1)  # a lane past the end asks for the last line again
        done = tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [at],
                                         dtype=tl.int32, is_pure=False, pack=1)
        total = tl.sum(done, axis=0)
        tl.store(scratch_ptr, total, mask=total == 123456789)  # never true; keeps the requests

    @triton.jit
    def bulk(ptr, n_bytes, scratch_ptr, LANES: tl.constexpr, STEP: tl.constexpr):
        offs = (tl.program_id(0).to(tl.int64) * LANES + tl.arange(0, LANES)) * STEP
        size = tl.minimum(n_bytes - offs, STEP).to(tl.int32)  # <= 0 past the end: no request
        at = ptr + tl.minimum(offs, n_bytes - 1)
        done = tl.inline_asm_elementwise(
            "{\n\t.reg .pred p;\n\tsetp.gt.s32 p, $2, 0;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\t"
            "mov.u32 $0, 0;\n\t}", "=r,l,r", [at, size], dtype=tl.int32, is_pure=False, pack=1)
        total = tl.sum(done, axis=0)
        tl.store(scratch_ptr, total, mask=total == 123456789)

    @triton.jit
    def loads(ptr, n_words, scratch_ptr, LANES: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * LANES * 4 + tl.arange(0, LANES * 4)  # int32 words, 4 a lane
        words = tl.load(ptr + offs, mask=offs < n_words, other=0)
        total = tl.max(words, axis=0)
        tl.store(scratch_ptr, total, mask=total == 123456789)  # rarely true, and harmless when it is

    def run(flat: torch.Tensor, scratch: torch.Tensor, mode: str) -> None:
        """Ask for the bytes of ``flat`` (a contiguous tensor of any dtype) in ``mode``."""
        import torch

        lanes, warps = LANES[mode], WARPS[mode]
        n_bytes = flat.numel() * flat.element_size()
        if mode == "load":
            words = flat.view(-1).view(torch.int32) if n_bytes % 4 == 0 else flat.view(-1).view(torch.uint8)
            n = words.numel()
            loads[(triton.cdiv(n, lanes * 4),)](words, n, scratch, LANES=lanes, num_warps=warps)
            return
        as_bytes = flat.view(-1).view(torch.uint8)
        step = LINE if mode == "line" else BULK
        kernel = lines if mode == "line" else bulk
        kernel[(triton.cdiv(triton.cdiv(n_bytes, step), lanes),)](as_bytes, n_bytes, scratch, LANES=lanes,
                                                                   STEP=step, num_warps=warps)

    return run


def usable(device: Any) -> bool:
    """Whether :data:`MODE` can run on ``device``: a CUDA GPU where its kernel builds and runs (tried once, outside
    any recording; a failure warns and turns the prefetch off for the process)."""
    import torch

    if MODE == "off" or torch.device(device).type != "cuda" or _kernels() is None:
        return False
    return _tried(MODE, str(torch.device(device)))


@functools.cache
def _tried(mode: str, device: str) -> bool:
    global MODE
    import torch

    try:
        probe = torch.zeros(4096, dtype=torch.bfloat16, device=device)
        scratch = torch.zeros(1, dtype=torch.int32, device=device)
        _kernels()(probe, scratch, mode)
        torch.cuda.synchronize(device)
    except Exception as exc:  # a hint only: decoding goes on without it
        warnings.warn(f"the decode step's L2 prefetch ({mode!r}) failed to run ({type(exc).__name__}: {exc}); "
                      "decoding goes on without it", stacklevel=3)
        MODE = "off"
        return False
    return True


@functools.cache
def _side(device: str) -> Any:
    import torch

    return torch.cuda.Stream(device=device)


@functools.cache
def prefetch_op() -> Any:
    """``rlx::l2_prefetch(scratch, after, weights)``: fork a side stream from the current one and ask there for
    ``weights``' bytes; ``after`` (a tensor the step computed) places the call in the step, ``scratch`` (a (1,)
    int32 tensor, written only in theory) makes it an operation torch.compile keeps. Nothing off a GPU."""
    import torch

    schema = "(Tensor(a!) scratch, Tensor after, Tensor[] weights) -> ()"

    @torch.library.custom_op("rlx::l2_prefetch", mutates_args=("scratch",), schema=schema)
    def l2_prefetch(scratch: torch.Tensor, after: torch.Tensor, weights: list[torch.Tensor]) -> None:
        if MODE == "off" or not scratch.is_cuda:
            return
        run = _kernels()
        main = torch.cuda.current_stream(scratch.device)
        side = _side(str(scratch.device))
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for w in weights:
                run(w, scratch, MODE)
        if side not in _pending:
            _pending.append(side)

    @l2_prefetch.register_fake
    def _(scratch: torch.Tensor, after: torch.Tensor, weights: list[torch.Tensor]) -> None:
        return None

    return l2_prefetch


def join() -> None:
    """The current stream waits for every side stream forked since the last join (the end of a decode step)."""
    if not _pending:
        return
    import torch

    main = torch.cuda.current_stream()
    while _pending:
        main.wait_stream(_pending.pop())
