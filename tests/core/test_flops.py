"""Model FLOPs and MFU (``rlx.run.metrics``) against hand-computed values."""

from __future__ import annotations

import pytest

from rlx.run.metrics import FlopsCounter, mfu_metrics, peak_tflops

# hidden 4, one layer, vocabulary 10, 2 query heads and 1 key/value head of width 2, MLP width 8
CONFIG = {"hidden_size": 4, "num_hidden_layers": 1, "vocab_size": 10, "num_attention_heads": 2, "head_dim": 2,
          "num_key_value_heads": 1, "intermediate_size": 8}


def test_forward_flops_by_hand() -> None:
    c = FlopsCounter(CONFIG)
    # weights a token meets: q 4x4, k and v 4x2 each, o 4x4, MLP 3 x 4x8, output 4x10 -> 184; 2 FLOPs each
    assert c.per_token == 368
    # scores and weighted values: 2 x 2 FLOPs x query width 4 per position attended, one layer
    assert c.attention == 16
    assert c.forward([3, 5]) == 368 * 8 + 16 * (9 + 25)


def test_mixture_of_experts_counts_the_experts_a_token_meets() -> None:
    dense = FlopsCounter(CONFIG).per_token
    moe = FlopsCounter({**CONFIG, "num_experts_per_tok": 2, "moe_intermediate_size": 8})
    assert moe.per_token - dense == 2 * 3 * 4 * 8  # one more expert's MLP


def test_mfu_is_training_flops_over_devices_times_peak() -> None:
    c = FlopsCounter(CONFIG)
    fwd = c.forward([3, 5])
    m = mfu_metrics(c, [3, 5], {"timing/update_actor": 2.0, "timing/old_log_prob": 0.5},
                    {"update_actor": 3.0, "old_log_prob": 1.0, "ref": 1.0}, devices=2, peak=1e-9)
    assert m["perf/mfu/update_actor"] == pytest.approx(3 * fwd / 2.0 / (2 * 1e-9 * 1e12))
    assert m["perf/mfu/old_log_prob"] == pytest.approx(fwd / 0.5 / (2 * 1e-9 * 1e12))
    assert "perf/mfu/ref" not in m  # not timed this step (no reference)
    assert mfu_metrics(c, [3, 5], {"timing/update_actor": 2.0}, {"update_actor": 3.0}, devices=1, peak=None) == {}


@pytest.mark.parametrize(("name", "rate"), [
    ("NVIDIA H200", 989.0), ("NVIDIA H20", 148.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 80GB HBM3", 989.0),
    ("NVIDIA GH200 480GB", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A10G", 70.0), ("Some GPU", None)])
def test_peak_rate_by_device_name(name: str, rate: float | None) -> None:
    assert peak_tflops(name) == rate


def test_a_config_without_the_sizes_is_refused() -> None:
    with pytest.raises(ValueError):
        FlopsCounter({"hidden_size": 4})
