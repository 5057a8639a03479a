"""The geo3k reward (verl's Geometry3K score) and its route from the router."""

from __future__ import annotations

import pytest

from rlx.plugins.rewards.geo3k import Geo3kOptions, build
from rlx.protocols import RewardBatch


def batch(responses: list[str], truth: str = "\\frac{3}{2}") -> RewardBatch:
    n = len(responses)
    return RewardBatch([""] * n, responses, [truth] * n, ["hiyouga/geometry3k"] * n, [{}] * n)


def test_answer_and_format_weighted_as_verls_score():
    out = build(Geo3kOptions(backend="builtin"), None)(batch([
        "<think>half of 3</think> The answer is \\boxed{\\frac{3}{2}}",  # right, formatted: 0.9 + 0.1
        "\\boxed{1.5}",  # right (equivalent), no think block: 0.9
        "<think>x</think>\\boxed{2}",  # wrong, formatted: 0.1
        "<think>x</think> 3/2",  # no box: neither
        "\\boxed{3/2} <think>late</think>",  # the format wants the think block first
    ]))
    assert out.scores == pytest.approx([1.0, 0.9, 0.1, 0.0, 0.9])
    assert out.extra["geo3k/correct"] == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert out.extra["geo3k/format"] == [1.0, 0.0, 1.0, 0.0, 0.0]
    weighted = build(Geo3kOptions(backend="builtin", format_score=0.5), None)(batch(["<think>a</think>\\boxed{7}"]))
    assert weighted.scores == [0.5]


def test_the_router_sends_geometry3k_rows_to_it():
    from rlx.plugins.rewards.router import DEFAULT_ROUTES

    assert DEFAULT_ROUTES["hiyouga/geometry3k"] == "geo3k"
    assert DEFAULT_ROUTES["rlx/colors"] == "arith"
