"""Model FLOPs of a batch and the accelerator's peak rate: what ``perf/mfu/*`` in the step metrics is made of.

FLOPs of a forward pass over a sequence of ``s`` tokens of a decoder-only transformer (the usual count,
as Megatron, verl and most papers make it): 2 x the weights each token meets in a matrix multiplication
(attention projections, MLP, output layer; not the embedding lookup), plus 4 x layers x query width x s
per token for the attention scores and the weighted values (the causal half is counted in full). A
backward pass costs twice the forward, so a training pass is 3 x the forward.

The peak rate is the dense bf16 matrix rate of the device's datasheet (no sparsity), looked up by the
name CUDA reports; an unknown device gives no MFU (set ``trainer.peak_tflops`` to supply one).

:func:`read_metrics` reads a run's step metrics back (the ``jsonl`` logger's ``metrics.jsonl``), for
``rlx replay``, ``rlx plot`` and tests.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
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


def read_metrics(path: str | os.PathLike[str], dedupe: bool = False) -> list[dict[str, Any]]:
    """Read a file written by the ``jsonl`` logger: one dict per logged step, in file order.

    ``path`` is the ``.jsonl`` file, or a run's output folder (then its ``metrics.jsonl`` is read).
    Values are as stored: floats, or None where the metric was NaN or infinite. Blank lines are
    skipped, and so is a last line cut short by a crash; any other malformed line is an error.
    With ``dedupe=True`` only the last record of each step is kept (files written by rlx 0.1.0 could
    hold a step twice after a resume) and the result is sorted by step.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    lines = p.read_text(encoding="utf-8").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    records: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:  # the line being written when the run died
                break
            raise ValueError(f"{p}:{i + 1}: not a JSON object: {exc}") from exc
        if not isinstance(obj, dict):
            raise ValueError(f"{p}:{i + 1}: expected a JSON object, got {type(obj).__name__}")
        records.append(obj)
    if dedupe:
        by_step: dict[Any, dict[str, Any]] = {}
        for rec in records:
            by_step[rec.get("step")] = rec
        records = sorted(by_step.values(), key=lambda r: (r.get("step") is None, r.get("step") or 0))
    return records
