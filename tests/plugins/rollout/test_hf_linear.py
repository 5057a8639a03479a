"""``rlx::skinny_linear`` (plugins/rollout/hf_linear.py): torch's linear off the GPU, the per-shape choice
between cuBLAS and the Triton candidates (with a fake timer, on the CPU), and on a GPU the op itself."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlx.plugins.rollout import hf_linear
from rlx.plugins.rollout.hf_linear import CANDIDATES, CUBLAS, Tuner, launches, linear_op, resolve


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 8, 13, 64])
def test_cpu_op_is_torch_linear(dtype: torch.dtype, with_bias: bool, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 40, generator=g).to(dtype)
    w = torch.randn(24, 40, generator=g).to(dtype)
    bias = torch.randn(24, generator=g).to(dtype) if with_bias else None
    got = linear_op()(x, w, bias)
    assert got.dtype == dtype and torch.equal(got, torch.nn.functional.linear(x, w, bias))


def test_cpu_op_keeps_leading_dimensions_and_compiles() -> None:
    x = torch.randn(2, 3, 16)
    w, bias = torch.randn(8, 16), torch.randn(8)
    assert torch.equal(linear_op()(x, w, bias), torch.nn.functional.linear(x, w, bias))

    op = linear_op()  # fetched outside the compiled function: dynamo traces through functools.cache

    def step(x: torch.Tensor) -> torch.Tensor:  # the fake impl gives torch.compile the output's shape
        return op(x, w, bias).relu() + 1

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    for rows in (8, 13):
        x = torch.randn(rows, 16)
        assert torch.equal(compiled(x), step(x))


def test_resolve_splits_only_to_fill_the_gpu() -> None:
    base = CANDIDATES[0]  # BLOCK_N 64, BLOCK_K 128, one wave
    o = resolve(base, 64, 896, 896, 132)  # 14 N tiles, 7 K steps: split to all 7
    assert (o.block_m, o.split) == (64, 7)
    down = resolve(base, 64, 896, 4864, 132)  # 38 K steps: 10 splits of 4 steps, none empty
    assert down.split == 10
    gate_up = resolve(base, 64, 9728, 896, 132)  # 152 N tiles already fill 132 SMs
    assert gate_up.split == 1
    assert resolve(base, 8, 896, 896, 132).block_m == 16  # rows padded to tl.dot's 16
    assert resolve(base, 512, 896, 896, 132).block_m == 64  # more rows: more row blocks
    no_split = next(c for c in CANDIDATES if c.waves == 0)
    assert resolve(no_split, 8, 576, 1536, 132).split == 1
    for rows, n, k in [(1, 40, 30), (8, 576, 1536), (100, 1152, 896), (1024, 9728, 896)]:
        for launch in launches(rows, n, k, 132):  # every split has at least one K column
            assert (launch.split - 1) * hf_linear._k_per_split(launch, k) < k


def test_launches_dedupe_an_auto_split_that_resolves_to_one() -> None:
    names = [launch.name for launch in launches(1024, 9728, 896, 132)]
    assert len(names) == len(set(names))
    kinds = {(la.config.block_n, la.config.block_k, la.config.num_warps, la.config.num_stages, la.config.swap,
              la.split) for la in launches(1024, 9728, 896, 132)}
    assert len(kinds) == len(names)


class FakeTimer:
    """Microseconds by option name (default 10), counting calls; an option named in ``broken`` raises."""

    def __init__(self, times: dict[str, float], broken: tuple[str, ...] = ()) -> None:
        self.times, self.broken = times, broken
        self.calls: list[str] = []

    def __call__(self, name: str, fn: Any, w: torch.Tensor) -> float:
        self.calls.append(name)
        if name in self.broken:
            raise RuntimeError("out of resource: shared memory")
        return self.times.get(name, 10.0)


def _operands(rows: int = 64, n: int = 896, k: int = 896) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, k).to(torch.bfloat16), torch.randn(n, k).to(torch.bfloat16)


def test_tuner_picks_the_fastest_and_remembers_it() -> None:
    x, w = _operands()
    options = [launch.name for launch in launches(64, 896, 896, 132)]
    assert len(options) >= 4
    timer = FakeTimer({CUBLAS: 5.0, options[2]: 3.0, options[3]: 4.0})
    tuner = Tuner(timer=timer, capturing=lambda: False, check=None, sms=132)
    choice = tuner.choice(x, w, None)
    assert choice is not None and choice.name == options[2] and choice.launch is not None
    assert set(timer.calls) == {CUBLAS, *options} and len(timer.calls) == len(options) + 1
    assert choice.times_us[CUBLAS] == 5.0 and choice.speedup == pytest.approx(5.0 / 3.0)
    assert tuner.table == {(64, 896, 896, "bfloat16", False): choice}
    again = tuner.choice(x, w, None)
    assert again is choice and len(timer.calls) == len(options) + 1  # measured once


def test_tuner_keeps_cublas_when_nothing_beats_it() -> None:
    x, w = _operands(8, 576, 576)
    timer = FakeTimer({CUBLAS: 2.0})
    choice = Tuner(timer=timer, capturing=lambda: False, check=None, sms=132).choice(x, w, torch.zeros(576))
    assert choice is not None and choice.launch is None and choice.name == CUBLAS and choice.speedup == 1.0
    tie = Tuner(timer=FakeTimer({}), capturing=lambda: False, check=None, sms=132).choice(x, w, None)
    assert tie is not None and tie.launch is None  # a tie is cuBLAS's


def test_tuner_skips_candidates_that_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w = _operands()
    options = [launch.name for launch in launches(64, 896, 896, 132)]
    timer = FakeTimer({CUBLAS: 5.0, options[0]: 1.0, options[1]: 2.0}, broken=(options[0],))
    choice = Tuner(timer=timer, capturing=lambda: False, check=None, sms=132).choice(x, w, None)
    assert choice is not None and choice.name == options[1]
    assert list(choice.failed) == [options[0]] and "shared memory" in choice.failed[options[0]]
    assert options[0] not in choice.times_us

    def wrong(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if name == options[1]:
            raise ValueError("result differs")

    # a check that rejects a result: that candidate is skipped even though it timed fastest
    checked = Tuner(timer=FakeTimer({CUBLAS: 5.0, options[1]: 1.0}), capturing=lambda: False, check=wrong,
                    sms=132)
    monkeypatch.setattr(hf_linear, "run", lambda *args, **kwargs: torch.zeros(1))  # no kernel on the CPU
    choice = checked.choice(x, w, None)
    assert choice is not None and choice.launch is None and options[1] in choice.failed


def test_tuner_never_times_during_capture() -> None:
    x, w = _operands()
    capturing = [True]
    timer = FakeTimer({CUBLAS: 5.0})
    tuner = Tuner(timer=timer, capturing=lambda: capturing[0], check=None, sms=132)
    assert tuner.choice(x, w, None) is None  # cuBLAS this time
    assert timer.calls == [] and tuner.table == {}
    capturing[0] = False
    choice = tuner.choice(x, w, None)  # measured at the first call outside capture
    assert choice is not None and timer.calls
    capturing[0] = True
    calls = len(timer.calls)
    assert tuner.choice(x, w, None) is choice and len(timer.calls) == calls  # known shapes keep their choice


def test_tuner_falls_back_to_cublas_when_its_timing_fails() -> None:
    x, w = _operands(8, 576, 576)
    choice = Tuner(timer=FakeTimer({}, broken=(CUBLAS,)), capturing=lambda: False, check=None,
                   sms=132).choice(x, w, None)
    assert choice is not None and choice.launch is None and CUBLAS in choice.failed


def test_key_and_tune_off_the_gpu() -> None:
    x, w = _operands(8, 96, 64)
    assert hf_linear.key_of(x.view(2, 4, 64), w, torch.zeros(96)) == (8, 96, 64, "bfloat16", True)
    assert hf_linear.tune([(8, 96, 64), (16, 96, 64, True)], "cpu", torch.bfloat16) == {}  # not usable: nothing


# -- on a GPU ---------------------------------------------------------------------------------------

QWEN = [(1152, 896, True), (896, 896, False), (9728, 896, False), (896, 4864, False)]
SMOL = [(960, 576, False), (576, 576, False), (3072, 576, False), (576, 1536, False)]


def _gpu_triton() -> None:
    pytest.importorskip("triton")
    if hf_linear._kernels() is None:
        pytest.skip("triton's kernels did not build")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_every_candidate_matches_cublas(dtype: torch.dtype) -> None:
    _gpu_triton()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for rows in (8, 64, 100):
        for n, k, with_bias in QWEN + SMOL:
            x = torch.randn(rows, k, device="cuda", dtype=dtype)
            w = torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5
            bias = torch.randn(n, device="cuda", dtype=dtype) if with_bias else None
            want = (x.double() @ w.double().T + (bias.double() if bias is not None else 0)).to(dtype)
            for launch in launches(rows, n, k, sms):
                got = hf_linear.run(x, w, bias, launch)
                torch.testing.assert_close(got, want, msg=lambda m, la=launch: f"{la.name}: {m}")


@pytest.mark.gpu
def test_gpu_tune_choices_are_never_slower_than_cublas() -> None:
    _gpu_triton()
    shapes = [(b, n, k, bias) for b in (8, 64) for n, k, bias in SMOL[:2] + QWEN[:1]]
    chosen = hf_linear.tune(shapes, "cuda", torch.bfloat16)
    assert len(chosen) == len(shapes)
    for key, choice in chosen.items():
        assert hf_linear.choices()[key] is choice
        assert choice.times_us[choice.name] <= choice.times_us[CUBLAS]
        assert len(choice.times_us) + len(choice.failed) >= 2


@pytest.mark.gpu
def test_gpu_op_in_a_cuda_graph() -> None:
    _gpu_triton()
    w = torch.randn(704, 576, device="cuda", dtype=torch.bfloat16) * 0.04
    bias = torch.randn(704, device="cuda", dtype=torch.bfloat16)
    op = linear_op()
    for rows in (24, 40):  # 24: first met during capture (cuBLAS); 40: tuned ahead of time
        if rows == 40:
            hf_linear.tune([(rows, 704, 576, True)], "cuda", torch.bfloat16)
        x = torch.randn(rows, 576, device="cuda", dtype=torch.bfloat16)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            op(x, w, bias)  # warm-up (a 24-row shape gets measured here, outside the capture)
        torch.cuda.current_stream().wait_stream(stream)
        key = (rows, 704, 576, "bfloat16", True)
        if rows == 24:
            hf_linear.default_tuner().table.pop(key, None)  # forget it: the capture is its first call
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = op(x, w, bias)
        if rows == 24:
            assert key not in hf_linear.choices()
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w, bias))
