"""``rlx::skinny_linear``: ``torch.nn.functional.linear`` for the decode step's few-row products, on a GPU a
Triton kernel when it measures faster than cuBLAS.

A decode step multiplies a handful of rows x (b, K) by each weight W (N, K) (as ``nn.Linear`` stores it): the
time is the weight's bytes over the memory bandwidth, and cuBLAS's kernels for these shapes are several times
that. The kernel here streams W through ``tl.dot`` in tiles of BLOCK_N rows x BLOCK_K columns, the rows of x
padded to a block of at least 16 (``tl.dot``'s smallest dimension; rows >= b are masked), with fp32
accumulation. Where the N tiles alone cannot fill the GPU the K dimension is split too (split-K): each split
writes its fp32 partial sums to a slab of a workspace (split, b, N), and a second small kernel adds the slabs
in a fixed order, adds the bias and casts (deterministic); the ``atomic`` candidates instead add their
partials with fp32 atomics into one zeroed (b, N) workspace. With no split the bias and the cast are the
kernel's own epilogue. ``swap`` candidates compute the tile as W x^T, so that the N tile, not the 16 rows, is
the matrix unit's M dimension. The workspace is allocated inside the call (a CUDA graph's memory pool
serves it), nothing synchronises with the host, so the op records in CUDA graphs.

Which of the :data:`CANDIDATES` (or cuBLAS itself) runs is measured per shape (b, N, K, dtype, bias or not)
at its first call outside a CUDA graph capture (:class:`Tuner`): cuBLAS and every candidate are recorded in
a CUDA graph of several calls, each on another copy of the weight so that it comes from memory rather than
from L2, as in the decode step, and the fastest is remembered; a candidate that fails to compile or whose
result differs from cuBLAS's is skipped. A first call during a capture uses cuBLAS (not remembered, so a
later call outside capture measures). :func:`tune` measures a list of shapes ahead of time (before the
engine records its graphs), :func:`choices` reads what was chosen. Off a GPU, in float32, or without Triton
the op is ``torch.nn.functional.linear``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CUBLAS = "cublas"
MAX_BLOCK_M = 64  # rows of x per program: b is padded up to a power of two in [16, 64]; larger b uses more programs


@dataclasses.dataclass(frozen=True)
class Config:
    """One way to run the kernel. ``waves``: split K so that the programs number about waves x the SM count
    (0: never split). ``swap``: compute W x^T (the N tile is the dot's first dimension). ``atomic``: split-K
    partial sums by fp32 atomics into one zeroed workspace (else one slab per split and an ordered sum)."""

    block_n: int
    block_k: int
    waves: float
    num_warps: int
    num_stages: int
    swap: bool = False
    atomic: bool = False

    @property
    def name(self) -> str:
        split = f"w{self.waves:g}" if self.waves else "nosplit"
        flags = ("-swap" if self.swap else "") + ("-atomic" if self.atomic else "")
        return f"n{self.block_n}k{self.block_k}-{split}-warps{self.num_warps}-stages{self.num_stages}{flags}"


# Memory-bound tiles: each stage of a program holds BLOCK_N x BLOCK_K weights (8-32 KB in half precision), and
# with 3-6 stages in flight a program keeps far more than the ~20 KB per SM that hides the memory latency at
# full bandwidth. Splits aim at one wave of programs (two for the smallest tile) so every SM streams.
CANDIDATES: tuple[Config, ...] = (
    Config(64, 128, 1, 4, 4),  # the middle: 16 KB weight tiles, one wave
    Config(64, 128, 1, 4, 4, swap=True),  # the same with the N tile as the MMA's M (wgmma wants M >= 64)
    Config(128, 128, 1, 4, 3, swap=True),  # wider N tiles, 32 KB per stage, fewer and longer programs
    Config(32, 256, 1, 4, 3),  # narrow N tiles for small N (o, down): more tiles before splitting K
    Config(64, 64, 2, 4, 6),  # short K steps, a deep pipeline, two waves of programs
    Config(128, 64, 0, 4, 4, swap=True),  # no split: large N (gate_up, the head) fills the GPU by itself
    Config(256, 64, 1, 8, 3, swap=True),  # big tiles on 8 warps
    Config(64, 128, 1, 4, 4, atomic=True),  # split-K by atomics: one zeroed workspace instead of a slab per split
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_m(rows: int) -> int:
    """The row block for ``rows`` rows: a power of two in [16, MAX_BLOCK_M]."""
    return min(MAX_BLOCK_M, max(16, 1 << max(0, rows - 1).bit_length()))


@dataclasses.dataclass(frozen=True)
class Launch:
    """A configuration resolved for one shape: its row block and split count."""

    config: Config
    block_m: int
    split: int

    @property
    def name(self) -> str:
        return f"{self.config.name}-m{self.block_m}-split{self.split}"


def resolve(config: Config, rows: int, n: int, k: int, sms: int) -> Launch:
    """``config`` for x (rows, k) @ W (n, k)^T on a GPU of ``sms`` SMs: the split count that brings the
    programs to about ``waves`` x ``sms`` (each split a whole number of BLOCK_K steps, none empty)."""
    bm = block_m(rows)
    tiles = _cdiv(rows, bm) * _cdiv(n, config.block_n)
    chunks = _cdiv(k, config.block_k)
    split = 1
    if config.waves > 0:
        split = max(1, min(chunks, _cdiv(math.ceil(config.waves * sms), tiles)))
    per = _cdiv(chunks, split) * config.block_k
    return Launch(config, bm, _cdiv(k, per))


def launches(rows: int, n: int, k: int, sms: int, candidates: Iterable[Config] = CANDIDATES) -> list[Launch]:
    """The candidates resolved for a shape, without duplicates (an auto split resolved to 1 equals no split)."""
    out: dict[tuple[Any, ...], Launch] = {}
    for config in candidates:
        launch = resolve(config, rows, n, k, sms)
        atomic = config.atomic and launch.split > 1
        kind = (config.block_n, config.block_k, config.num_warps, config.num_stages, config.swap, atomic,
                launch.block_m, launch.split)
        out.setdefault(kind, launch)
    return list(out.values())


def _k_per_split(launch: Launch, k: int) -> int:
    chunks = _cdiv(k, launch.config.block_k)
    return _cdiv(chunks, launch.split) * launch.config.block_k


@functools.cache
def _kernels() -> Any:
    """The two Triton kernels (the product, the split-K sum), or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def product(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, K_PER, s_xm, s_wn, s_ym,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
                EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr):
        # EPILOGUE 0: y (M, N) in the output dtype, bias added; 1: fp32 slab pid_k of y (split, M, N);
        # 2: fp32 atomic add into y (M, N).
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = pid_k * K_PER + tl.arange(0, BLOCK_K)
        row_ok = rows < M
        col_ok = cols < N
        x_ptrs = x_ptr + rows[:, None] * s_xm + ks[None, :]
        w_ptrs = w_ptr + cols[:, None] * s_wn + ks[None, :]
        if SWAP:  # noqa: SIM108 (statements, not expressions, in Triton's constexpr branches)
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in range(0, K_PER, BLOCK_K):
            k_ok = ks + i < K
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if SWAP:  # noqa: SIM108
                acc = tl.dot(w, tl.trans(x), acc)
            else:
                acc = tl.dot(x, tl.trans(w), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if SWAP:  # acc[n, m]: index the output transposed rather than move the accumulator
            offs = cols[:, None] + rows[None, :] * s_ym
            ok = col_ok[:, None] & row_ok[None, :]
        else:
            offs = rows[:, None] * s_ym + cols[None, :]
            ok = row_ok[:, None] & col_ok[None, :]
        if EPILOGUE == 0:
            if HAS_BIAS:
                bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                if SWAP:
                    acc += bias[:, None]
                else:
                    acc += bias[None, :]
            tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)
        elif EPILOGUE == 1:
            tl.store(y_ptr + pid_k * M * N + offs, acc, mask=ok)
        else:
            tl.atomic_add(y_ptr + offs, acc, mask=ok)

    @triton.jit
    def finish(ws_ptr, bias_ptr, y_ptr, M, N, SPLIT, s_ym, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        # y = sum over the SPLIT slabs of ws (SPLIT, M, N), in order, + bias, in y's dtype
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < M * N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(0, SPLIT):
            acc += tl.load(ws_ptr + s * M * N + offs, mask=ok, other=0.0)
        col = offs % N
        if HAS_BIAS:
            acc += tl.load(bias_ptr + col, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + (offs // N) * s_ym + col, acc.to(y_ptr.dtype.element_ty), mask=ok)

    return product, finish


FINISH_BLOCK = 1024


def run(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, launch: Launch,
        out: torch.Tensor | None = None) -> torch.Tensor:
    """x (b, K) @ w (N, K)^T + bias through the Triton kernel as ``launch`` says (x's and w's last dimension
    contiguous; ``out``, if given, a (b, N) tensor with a contiguous last dimension)."""
    import torch

    product, finish = _kernels()
    rows, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    config = launch.config
    per = _k_per_split(launch, k)
    grid = (_cdiv(rows, launch.block_m), _cdiv(n, config.block_n), launch.split)
    has_bias = bias is not None
    bias_arg = bias if bias is not None else w  # an unused pointer
    meta = {"BLOCK_M": launch.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k, "SWAP": config.swap,
            "num_warps": config.num_warps, "num_stages": config.num_stages}
    if launch.split == 1:
        product[grid](x, w, bias_arg, out, rows, n, k, per, x.stride(0), w.stride(0), out.stride(0),
                      EPILOGUE=0, HAS_BIAS=has_bias, **meta)
        return out
    if config.atomic:
        ws = torch.zeros((rows, n), dtype=torch.float32, device=x.device)
        product[grid](x, w, bias_arg, ws, rows, n, k, per, x.stride(0), w.stride(0), n,
                      EPILOGUE=2, HAS_BIAS=False, **meta)
        slabs = 1
    else:
        ws = torch.empty((launch.split, rows, n), dtype=torch.float32, device=x.device)
        product[grid](x, w, bias_arg, ws, rows, n, k, per, x.stride(0), w.stride(0), n,
                      EPILOGUE=1, HAS_BIAS=False, **meta)
        slabs = launch.split
    finish[(_cdiv(rows * n, FINISH_BLOCK),)](ws, bias_arg, out, rows, n, slabs, out.stride(0),
                                             HAS_BIAS=has_bias, BLOCK=FINISH_BLOCK, num_warps=4)
    return out


# -- choosing per shape -------------------------------------------------------------------------------

Key = tuple[int, int, int, str, bool]  # (b, N, K, dtype, has_bias)
Timer = Callable[[str, Callable[[Any], Any], Any], float]  # (name, fn(weight), weight) -> microseconds per call
Check = Callable[[str, Any, Any], None]  # (name, result, cuBLAS's result): raises if the result is wrong


@dataclasses.dataclass(frozen=True)
class Choice:
    """What runs for one shape: ``launch`` (None: cuBLAS), the measured microseconds per call of every
    option by name, and the options that failed (name -> error)."""

    launch: Launch | None
    times_us: dict[str, float]
    failed: dict[str, str]

    @property
    def name(self) -> str:
        return CUBLAS if self.launch is None else self.launch.name

    @property
    def speedup(self) -> float:
        """cuBLAS's time over the chosen one's."""
        return self.times_us[CUBLAS] / self.times_us[self.name]


def key_of(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> Key:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (rows, w.shape[0], w.shape[1], str(x.dtype).removeprefix("torch."), bias is not None)


def graph_timer(name: str, fn: Callable[[Any], Any], w: torch.Tensor, calls: int = 24, rounds: int = 5) -> float:
    """Microseconds per call of ``fn``, the median of ``rounds`` replays of a CUDA graph of ``calls`` calls
    (what the decode step's graph does: no launch overhead); the calls cycle through copies of ``w`` that
    together exceed twice the L2 cache, so each reads its weight from memory as the decode step does."""
    import torch

    props = torch.cuda.get_device_properties(w.device)
    nbytes = max(1, w.numel() * w.element_size())
    copies = max(1, min(64, _cdiv(2 * int(getattr(props, "L2_cache_size", 50 << 20)), nbytes)))
    weights = [w] + [w.clone() for _ in range(copies - 1)]
    calls = max(calls, copies)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(w.device)
    stream.wait_stream(torch.cuda.current_stream(w.device))
    with torch.cuda.stream(stream):
        fn(weights[0])  # compiles, and sets up cuBLAS on this stream, outside the capture
        stream.synchronize()
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            for i in range(calls):
                fn(weights[i % copies])
        finally:
            graph.capture_end()
    torch.cuda.current_stream(w.device).wait_stream(stream)
    graph.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph, weights
    return statistics.median(times)


def check_close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """A candidate's result against cuBLAS's: both are fp32 sums rounded once, so they differ by about an
    output ulp; anything past 1/64 of the largest output is a broken kernel, not rounding."""
    diff = float((got.float() - want.float()).abs().max()) if got.numel() else 0.0
    scale = float(want.float().abs().max()) if want.numel() else 0.0
    if got.shape != want.shape or not diff <= scale / 64 + 1e-6:
        raise ValueError(f"{name}: result differs from cuBLAS by {diff:.3g} (outputs up to {scale:.3g})")


class Tuner:
    """Per-shape choices between cuBLAS and the Triton candidates, measured at a shape's first call.
    ``timer``, ``capturing``, ``check`` and ``sms`` are injectable (tests use fakes on the CPU)."""

    def __init__(self, timer: Timer | None = None, capturing: Callable[[], bool] | None = None,
                 check: Check | None = check_close, sms: int | None = None,
                 candidates: Iterable[Config] = CANDIDATES) -> None:
        self.timer: Timer = timer or graph_timer
        self.capturing = capturing or _capturing
        self.check = check
        self.sms = sms
        self.candidates = tuple(candidates)
        self.table: dict[Key, Choice] = {}

    def choice(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> Choice | None:
        """The remembered choice for this shape, measured now if it is new; None (cuBLAS, not remembered)
        when it is new and a CUDA graph is being captured."""
        key = key_of(x, w, bias)
        found = self.table.get(key)
        if found is not None:
            return found
        if self.capturing():
            return None
        found = self.measure(_rows(x), w, _contiguous(bias))
        self.table[key] = found
        return found

    def measure(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> Choice:
        import torch

        rows, k = x.shape
        sms = self.sms or torch.cuda.get_device_properties(x.device).multi_processor_count
        failed: dict[str, str] = {}
        try:
            times = {CUBLAS: self.timer(CUBLAS, lambda weight: torch.nn.functional.linear(x, weight, bias), w)}
        except Exception as error:  # nothing to compare with: cuBLAS it is
            return Choice(None, {CUBLAS: math.inf}, {CUBLAS: _describe(error)})
        want = torch.nn.functional.linear(x, w, bias) if self.check is not None else None
        best: Launch | None = None
        for launch in launches(rows, w.shape[0], k, sms, self.candidates):
            try:
                if self.check is not None:
                    self.check(launch.name, run(x, w, bias, launch), want)
                times[launch.name] = self.timer(launch.name, functools.partial(_run_with, x, bias, launch), w)
            except Exception as error:  # a candidate that cannot compile or run here is skipped
                failed[launch.name] = _describe(error)
                continue
            if times[launch.name] < times[best.name if best else CUBLAS]:
                best = launch
        return Choice(best, times, failed)


def _describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def _run_with(x: torch.Tensor, bias: torch.Tensor | None, launch: Launch, w: torch.Tensor) -> torch.Tensor:
    return run(x, w, bias, launch)


def _capturing() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@functools.cache
def default_tuner() -> Tuner:
    """The process's tuner, which the op uses."""
    return Tuner()


def choices() -> dict[Key, Choice]:
    """The choices made so far: (b, N, K, dtype, has_bias) -> :class:`Choice`."""
    return dict(default_tuner().table)


def usable(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the Triton path applies: CUDA, half precision throughout, rows, W's K contiguous, Triton."""
    import torch

    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype and w.dim() == 2
            and x.dim() >= 1 and x.shape[-1] == w.shape[1] and x.numel() > 0 and w.numel() > 0
            and w.stride(1) == 1 and w.device == x.device
            and (bias is None or (bias.dtype == x.dtype and bias.shape == (w.shape[0],) and bias.device == x.device))
            and _kernels() is not None)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                  tuner: Tuner | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear(x, w, bias)``, through the shape's chosen kernel where :func:`usable`."""
    import torch

    if not usable(x, w, bias):
        return torch.nn.functional.linear(x, w, bias)
    choice = (tuner or default_tuner()).choice(x, w, bias)
    if choice is None or choice.launch is None:
        return torch.nn.functional.linear(x, w, bias)
    return run(_rows(x), w, _contiguous(bias), choice.launch).reshape(*x.shape[:-1], w.shape[0])


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, K) with a contiguous last dimension (a view where it can be)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _contiguous(bias: torch.Tensor | None) -> torch.Tensor | None:
    return bias if bias is None or bias.stride(0) == 1 else bias.contiguous()


def tune(shapes: Iterable[tuple[int, ...]], device: Any, dtype: Any) -> dict[Key, Choice]:
    """Measure ahead of time (outside any capture) the shapes (b, N, K) or (b, N, K, has_bias) in ``dtype``
    on ``device``, with random operands; returns their choices (none where the Triton path does not apply)."""
    import torch

    tuner = default_tuner()
    out: dict[Key, Choice] = {}
    generator = torch.Generator(device="cpu").manual_seed(0)
    for shape in shapes:
        rows, n, k = shape[:3]
        has_bias = bool(shape[3]) if len(shape) > 3 else False
        x = (torch.randn(rows, k, generator=generator) * 0.5).to(device=device, dtype=dtype)
        w = (torch.randn(n, k, generator=generator) * k ** -0.5).to(device=device, dtype=dtype)
        bias = (torch.randn(n, generator=generator) * 0.1).to(device=device, dtype=dtype) if has_bias else None
        if not usable(x, w, bias):
            continue
        choice = tuner.choice(x, w, bias)
        if choice is not None:
            out[key_of(x, w, bias)] = choice
        del x, w, bias
    return out


@functools.cache
def linear_op() -> Any:
    """``rlx::skinny_linear`` (registered once): :func:`skinny_linear` as an operator that torch.compile
    keeps opaque (it neither traces into the Triton launch nor into the per-shape choice). Fetch it outside
    the compiled function (as ``FusedWeights.attention`` holds ``attention_op()``): dynamo traces through
    ``functools.cache`` and would register it again."""
    import torch

    schema = "(Tensor x, Tensor w, Tensor? bias) -> Tensor"  # spelled out: annotations are strings here

    @torch.library.custom_op("rlx::skinny_linear", mutates_args=(), schema=schema)
    def op(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return skinny_linear(x, w, bias)

    @op.register_fake
    def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], w.shape[0]))

    return op
