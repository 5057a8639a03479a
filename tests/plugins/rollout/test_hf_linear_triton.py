"""The Triton kernel of ``rlx::skinny_linear`` against a float64 reference: every candidate configuration,
split-K and not, bias and not, ragged rows/N/K. On a GPU it runs the real kernels; without one it needs
Triton's interpreter, which must be chosen before triton is imported (this file sets TRITON_INTERPRET=1 then):

    TRITON_INTERPRET=1 PYTHONPATH=/tmp/triton_site python -m pytest -q tests/plugins/rollout/test_hf_linear_triton.py

The interpreter checks the arithmetic and the masks only: not speed, shared memory or tl.dot's hardware rules.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

triton = pytest.importorskip("triton")

from rlx.plugins.rollout import hf_linear  # noqa: E402
from rlx.plugins.rollout.hf_linear import CANDIDATES, Config, Launch, Tuner, block_m, launches, resolve, run  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and not INTERPRET,
                                reason="no GPU, and TRITON_INTERPRET is not 1 (Triton's interpreter runs on the CPU)")


@pytest.fixture(autouse=True)
def bf16_in_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Two bfloat16 gaps of Triton's interpreter (3.9), which keeps bfloat16 as uint16 bits, made to do what
    the GPU does: its tl.dot multiplies those bits as integers (triton-lang/triton#11584, "not supported
    yet"): bfloat16 operands are widened to float32 first, exactly (a bfloat16 is the top half of a float32);
    and its float32 -> bfloat16 cast truncates, where the GPU's default ``.to`` rounds to nearest even."""
    if INTERPRET:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter

        builder = interpreter.InterpreterBuilder
        dot, cast = builder.create_dot, builder.cast_impl

        def widen(h: Any) -> Any:
            if h.dtype == tl.bfloat16:
                return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
            return h

        def create_dot(self: Any, a: Any, b: Any, d: Any, *rest: Any) -> Any:
            return dot(self, widen(a), widen(b), d, *rest)

        def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
                values = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
                bits = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
                return interpreter.TensorHandle(bits, tl.bfloat16)
            return cast(self, src, dst_type)

        monkeypatch.setattr(builder, "create_dot", create_dot)
        monkeypatch.setattr(builder, "cast_impl", cast_impl)
    yield


def _operands(rows: int, n: int, k: int, dtype: torch.dtype, with_bias: bool,
              seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x (rows, k) and w (n, k) as views into larger NaN-filled buffers (row strides k+3, k+9), so a load
    past K or past the rows reads NaN into the result."""
    g = torch.Generator().manual_seed(seed)
    x_big = torch.full((rows + 2, k + 3), float("nan"), dtype=dtype)
    w_big = torch.full((n + 3, k + 9), float("nan"), dtype=dtype)
    x_big[:rows, :k] = torch.randn(rows, k, generator=g).to(dtype)
    w_big[:n, :k] = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    bias = (torch.randn(n, generator=g) * 0.5).to(dtype).to(DEVICE) if with_bias else None
    x_big, w_big = x_big.to(DEVICE), w_big.to(DEVICE)
    return x_big[:rows, :k], w_big[:n, :k], bias


def assert_rounded(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``got`` is the exact x @ w^T + bias rounded once to its dtype, up to fp32 accumulation: each element
    within half an output ulp of the float64 result, plus twice the bound of a K-term fp32 sum's error."""
    xd, wd = x.double().cpu(), w.double().cpu()
    ref = xd @ wd.T
    mag = xd.abs() @ wd.abs().T
    if bias is not None:
        ref = ref + bias.double().cpu()
        mag = mag + bias.double().cpu().abs()
    half_ulp = 2.0 ** -8 if got.dtype == torch.bfloat16 else 2.0 ** -11
    tol = half_ulp * ref.abs() + 2 * (x.shape[1] + 8) * 2.0 ** -24 * mag + 2.0 ** -24
    err = (got.double().cpu() - ref).abs()
    assert not torch.isnan(err).any(), "NaN in the result: a load past the masks"
    worst = int((err - tol).argmax())
    assert (err <= tol).all(), f"element {divmod(worst, got.shape[1])}: err {err.flatten()[worst]:.3g} > tol " \
                               f"{tol.flatten()[worst]:.3g} (value {ref.flatten()[worst]:.4g})"


def _check(launch: Launch, rows: int, n: int, k: int, dtype: torch.dtype, with_bias: bool, seed: int) -> None:
    x, w, bias = _operands(rows, n, k, dtype, with_bias, seed)
    out_big = torch.full((rows + 3, n + 7), float("nan"), dtype=dtype, device=DEVICE)
    got = run(x, w, bias, launch, out=out_big[:rows, :n])
    assert got.data_ptr() == out_big.data_ptr()
    assert_rounded(got, x, w, bias)
    assert torch.isnan(out_big[rows:]).all() and torch.isnan(out_big[:, n:]).all(), "a store past the masks"
    plain = run(x.contiguous(), w.contiguous(), bias, launch)  # its own (contiguous) output
    assert plain.shape == (rows, n) and plain.dtype == dtype and torch.equal(plain, got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("config", CANDIDATES, ids=[c.name for c in CANDIDATES])
def test_candidate(config: Config, dtype: torch.dtype) -> None:
    """Each candidate unsplit and split in 2 and 3 (its own row blocks), N and K not multiples of its tile
    (a partial last N tile, a partial last K step), bias and not, b in {1, 8, 16, 64, 100}."""
    n, k = 2 * config.block_n + 5, 3 * config.block_k - 37
    for rows in (1, 8, 16, 64, 100):
        for split in (1, 2, 3):
            launch = Launch(config, block_m(rows), split)
            assert hf_linear._k_per_split(launch, k) * (split - 1) < k  # no empty split
            _check(launch, rows, n, k, dtype, with_bias=(rows + split) % 2 == 0, seed=rows * 10 + split)


@pytest.mark.parametrize("rows", [1, 8, 100])
def test_resolved_launches_on_small_shapes(rows: int) -> None:
    """What :func:`launches` resolves for a GPU of 16 SMs (so small shapes split), on odd shapes."""
    for n, k, with_bias in [(40, 72, True), (24, 520, False), (136, 48, True)]:
        for i, launch in enumerate(launches(rows, n, k, 16)):
            _check(launch, rows, n, k, torch.bfloat16, with_bias, seed=i)


@pytest.mark.parametrize(("n", "k", "with_bias"), [(960, 576, True), (576, 576, False), (576, 1536, False),
                                                  (896, 896, False)], ids=["smol-qkv", "smol-o", "smol-down",
                                                                           "qwen-o"])
def test_real_shapes(n: int, k: int, with_bias: bool) -> None:
    """Real layer shapes at b=8 with the split an H200 (132 SMs) gets (one candidate each: the interpreter is
    slow; the GPU test of test_hf_linear.py runs them all)."""
    launch = resolve(CANDIDATES[2], 8, n, k, 132)
    assert launch.split > 1
    _check(launch, 8, n, k, torch.bfloat16, with_bias, seed=n + k)


def test_tuner_with_the_kernels() -> None:
    """The tuner's whole path with real kernels: every candidate runs, passes the check against torch's
    result, is timed (wall clock here) and the fastest is kept."""
    x, w, bias = _operands(8, 72, 200, torch.float16, True, seed=3)
    x, w = x.contiguous(), w.contiguous()

    def wall_clock(name: str, fn: Any, weight: torch.Tensor) -> float:
        start = time.perf_counter()
        fn(weight)
        return (time.perf_counter() - start) * 1e6

    ran: list[str] = []

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        ran.append(name)
        hf_linear.check_close(name, got, want)

    tuner = Tuner(timer=wall_clock, capturing=lambda: False, check=check, sms=8)
    choice = tuner.choice(x, w, bias)
    assert choice is not None and choice.failed == {}
    assert ran == [launch.name for launch in launches(8, 72, 200, 8)]
    assert set(choice.times_us) == {hf_linear.CUBLAS, *ran}
    assert choice.times_us[choice.name] == min(choice.times_us.values())


def test_check_close_rejects_a_wrong_result() -> None:
    x, w, bias = _operands(8, 40, 72, torch.bfloat16, False, seed=5)
    want = torch.nn.functional.linear(x, w)
    launch = resolve(CANDIDATES[0], 8, 40, 72, 8)
    hf_linear.check_close("ok", run(x, w, bias, launch), want)
    short = run(x[:, :64], w[:, :64], bias, launch)  # a kernel that forgot the last K columns
    with pytest.raises(ValueError, match="differs from cuBLAS"):
        hf_linear.check_close("short", short, want)
