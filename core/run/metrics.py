"""Model FLOPs of a batch and the accelerator's peak rate: what ``perf/mfu/*`` in the step metrics is made of.

FLOPs of a forward pass over a sequence of ``s`` tokens of a decoder-only transformer (the usual count,
as Megatron, verl and most papers make it): 2 x the weights each token meets in a matrix multiplication
(attention projections, MLP, output layer; not the embedding lookup), plus 4 x layers x query width x s
per token for the attention scores and the weighted values (the causal half is counted in full). A
backward pass costs twice the forward, so a training pass is 3 x the forward.

The peak rate is the dense bf16 matrix rate of the device's datasheet (no sparsity), looked up by the
name CUDA reports; an unknown device gives no MFU (set ``trainer.peak_tflops`` to supply one).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# Dense bf16 tensor-core TFLOP/s from the vendors' datasheets (SXM parts; the PCIe H100 is lower).
PEAK_BF16_TFLOPS: Mapping[str, float] = {
    "B200": 2250.0, "H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "H800": 989.0, "H20": 148.0,
    "GH200": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0, "L40": 181.0, "L20": 119.5, "A10G": 70.0,
    "A10": 125.0, "RTX 4090": 165.0, "RTX 3090": 71.0, "MI300X": 1307.0, "MI250X": 383.0,
}


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 rate of a device by (part of) its CUDA name, the most specific match first."""
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key.lower() in device_name.lower():
            return PEAK_BF16_TFLOPS[key]
    return None


class FlopsCounter:
    """Forward FLOPs of batches of sequences for one model config (a ``transformers`` config or a dict)."""

    def __init__(self, config: Any) -> None:
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        h, layers, vocab = get("hidden_size"), get("num_hidden_layers"), get("vocab_size")
        if not (h and layers and vocab):
            raise ValueError("the model config has no hidden_size, num_hidden_layers or vocab_size")
        heads = get("num_attention_heads") or 1
        head_dim = get("head_dim") or h // heads
        kv_heads = get("num_key_value_heads") or heads
        experts = get("num_experts_per_tok") or 1  # a mixture of experts: the experts a token passes through
        inter = (get("moe_intermediate_size") if experts > 1 else None) or get("intermediate_size") or 4 * h
        q, kv = heads * head_dim, kv_heads * head_dim
        self.per_token = 2 * (layers * (h * q + 2 * h * kv + q * h + 3 * h * inter * experts) + h * vocab)
        self.attention = 4 * layers * q  # times the sequence length, per token

    def forward(self, lengths: Iterable[int]) -> float:
        """Forward FLOPs of sequences of the given lengths (prompt + response tokens each)."""
        lengths = [int(n) for n in lengths]
        return float(self.per_token * sum(lengths) + self.attention * sum(n * n for n in lengths))


def mfu_metrics(counter: FlopsCounter, lengths: Iterable[int], times: Mapping[str, float], passes: Mapping[str, float],
                devices: int, peak: float | None) -> dict[str, float]:
    """``perf/mfu/<stage>`` for the timed stages: ``passes[stage]`` forward-equivalents of the batch (3 per
    training epoch, 1 per log-prob pass) over the stage's seconds, ``devices`` x ``peak`` TFLOP/s."""
    if not peak or devices < 1:
        return {}
    fwd = counter.forward(lengths)
    out: dict[str, float] = {}
    for stage, n in passes.items():
        seconds = times.get(f"timing/{stage}")
        if seconds:
            out[f"perf/mfu/{stage}"] = n * fwd / seconds / (devices * peak * 1e12)
    return out
