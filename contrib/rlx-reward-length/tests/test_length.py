"""Tests of the rlx-reward-length plugin, installed or straight from its source folder."""

from __future__ import annotations

import doctest
import importlib
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlx.protocols import RewardBatch, RewardOutput
from rlx.registry import PluginManager

ROOT = Path(__file__).resolve().parents[1]

try:
    rlx_reward_length = importlib.import_module("rlx_reward_length")
except ImportError:  # not installed: use the source folder
    sys.path.insert(0, str(ROOT))
    rlx_reward_length = importlib.import_module("rlx_reward_length")

LengthOptions = rlx_reward_length.LengthOptions


def reward_batch(lengths: list[int]) -> RewardBatch:
    n = len(lengths)
    return RewardBatch(["q"] * n, ["a"] * n, [None] * n, ["src"] * n, [{}] * n, response_lengths=lengths)


def test_docstring_example():
    result = doctest.testmod(rlx_reward_length)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(
    ("length", "expected"),
    [(64, 1.0), (48, 1.0), (80, 1.0), (88, 0.5), (40, 0.5), (96, 0.0), (32, 0.0), (0, 0.0), (500, 0.0)],
)
def test_score_is_flat_then_linear_then_zero(length, expected):
    assert rlx_reward_length.score(length, LengthOptions()) == pytest.approx(expected)


def test_zero_tolerance_scores_only_the_exact_length():
    opts = LengthOptions(target_tokens=5, tolerance=0)
    assert [rlx_reward_length.score(n, opts) for n in (4, 5, 6)] == [0.0, 1.0, 0.0]


def test_reward_fn_returns_scores_and_in_range_metric():
    fn = rlx_reward_length.build(LengthOptions(target_tokens=4, tolerance=2), None)
    out = fn(reward_batch([4, 6, 7, 9]))
    assert isinstance(out, RewardOutput)
    assert out.scores == [1.0, 1.0, 0.5, 0.0]
    assert out.extra == {"length/in_range": [1.0, 1.0, 0.0, 0.0]}


def test_reward_fn_without_lengths_is_a_clear_error():
    fn = rlx_reward_length.build(None, None)
    with pytest.raises(ValueError, match="response_lengths"):
        fn(RewardBatch(["q"], ["a"], [None], ["src"], [{}]))


def test_options_forbid_unknown_keys_reject_negatives_and_describe_every_field():
    with pytest.raises(ValidationError):
        LengthOptions(target=10)
    with pytest.raises(ValidationError):
        LengthOptions(tolerance=-1)
    assert all(f.description for f in LengthOptions.model_fields.values())


def test_registers_a_reward_named_length():
    pm = PluginManager()
    pm.register(rlx_reward_length, name="length", distribution="rlx-reward-length", version="0.1.0")
    comp = pm.get("reward", "length")
    assert comp.distribution == "rlx-reward-length"
    assert comp.load_config_model() is LengthOptions
    fn = comp.load_factory()(comp.load_config_model()(target_tokens=3, tolerance=1), None)
    assert fn(reward_batch([3, 5, 9])).scores == [1.0, 0.0, 0.0]


def test_pyproject_declares_the_rlx_entry_point():
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["rlx"] == {"length": "rlx_reward_length"}
    assert "rlx>=0.1.0,<0.2" in meta["project"]["dependencies"]  # a range of rlx releases, not any
