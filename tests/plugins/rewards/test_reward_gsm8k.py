"""The gsm8k rule reward: answer extraction, matching, scoring and the registered component."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from rlx.plugins.rewards import gsm8k
from rlx.plugins.rewards.gsm8k import Gsm8kOptions, answers_match, compute_score, extract_answer
from rlx.protocols import RewardBatch, RewardOutput
from rlx.registry import PluginManager


# --- extract_answer: strict ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("She has 72 apples.\n#### 72", "72"),
        ("#### 1,234", "1234"),
        ("#### 1,234,567", "1234567"),
        ("####-5", "-5"),
        ("#### -5", "-5"),
        ("#### - 5", "-5"),
        ("#### $18.00", "18.00"),
        ("#### -$3", "-3"),
        ("#### $-3", "-3"),
        ("#### 3.5", "3.5"),
        ("#### 72.", "72"),
        ("#### 72 apples", "72"),
        ("####\n  42", "42"),
        ("#### +7", "7"),
        ("#### 0", "0"),
        ("#### 10\nwait, no.\n#### 12", "12"),
        ("#### 10 then #### 1,000", "1000"),
        ("The answer is 72.", None),
        ("", None),
        ("#### seventy-two", None),
        ("#### 5 and later a bare ####", None),
    ],
)
def test_extract_strict(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected
    assert extract_answer(text, "strict") == expected


# --- extract_answer: flexible ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 72.", "72"),
        ("3 apples plus 4 apples is 7 apples", "7"),
        ("Total: $1,234.50.", "1234.50"),
        ("It dropped to -5 degrees", "-5"),
        ("pages 3-5", "5"),
        ("#### 12 and then 13", "13"),
        ("x = 0.25", "0.25"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_flexible(text: str, expected: str | None) -> None:
    assert extract_answer(text, "flexible") == expected


def test_extract_rejects_unknown_method() -> None:
    with pytest.raises(ValueError, match="strict"):
        extract_answer("#### 1", "fuzzy")  # type: ignore[arg-type]


# --- answers_match ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("pred", "truth", "expected"),
    [
        ("18.00", "18", True),
        ("18", 18, True),
        ("18.0", 18.0, True),
        ("18.5", 18.5, True),
        ("1234", "1,234", True),
        ("1,234", "1234", True),
        ("-5", -5, True),
        ("0.1", 0.1, True),
        (" 7 ", "7", True),
        ("17", "18", False),
        ("18", 18.5, False),
        ("-5", "5", False),
        ("abc", " abc ", True),
        ("abc", "abd", False),
        ("18", "eighteen", False),
        (None, "18", False),
        ("18", None, False),
    ],
)
def test_answers_match(pred, truth, expected: bool) -> None:
    assert answers_match(pred, truth) is expected


# --- compute_score ---------------------------------------------------------------------------
def test_strict_correct_and_wrong() -> None:
    assert compute_score("so 6*12 = 72\n#### 72", "72") == 1.0
    assert compute_score("#### 71", "72") == 0.0
    assert compute_score("#### 1,234", 1234) == 1.0
    assert compute_score("#### $18.00", 18) == 1.0
    assert compute_score("#### -5", "-5") == 1.0
    assert compute_score("#### 5", "-5") == 0.0


def test_last_marker_wins() -> None:
    assert compute_score("#### 10\nactually\n#### 12", "12") == 1.0
    assert compute_score("#### 12\nactually\n#### 10", "12") == 0.0


def test_format_score_only_with_marker() -> None:
    kw = {"format_score": 0.1}
    assert compute_score("#### 71", "72", **kw) == 0.1
    assert compute_score("#### 72", "72", **kw) == 1.0
    # No marker: the flexible fallback gives full credit when right, nothing (not 0.1) when wrong.
    assert compute_score("the answer is 72", "72", **kw) == 1.0
    assert compute_score("the answer is 71", "72", **kw) == 0.0
    assert compute_score("I don't know", "72", **kw) == 0.0


def test_flexible_fallback() -> None:
    assert compute_score("The answer is 72.", "72") == 1.0
    assert compute_score("The answer is 72.", "72", fallback_flexible=False) == 0.0
    assert compute_score("no number at all", "72") == 0.0
    assert compute_score("", "72") == 0.0
    # A marker with no number after it falls back too.
    assert compute_score("#### seventy-two, i.e. 72", "72") == 1.0


def test_method_flexible() -> None:
    assert compute_score("#### 72 and then 5", "5", method="flexible") == 1.0
    assert compute_score("#### 72 and then 5", "72", method="flexible") == 0.0
    assert compute_score("#### 71", "72", method="flexible", format_score=0.5) == 0.0
    assert compute_score("nothing", "72", method="flexible") == 0.0


def test_ground_truth_types() -> None:
    assert compute_score("#### 72", 72) == 1.0
    assert compute_score("#### 72", 72.0) == 1.0
    assert compute_score("#### 2.5", 2.5) == 1.0
    assert compute_score("#### 72", " 72 ") == 1.0
    # A full GSM8K solution as ground truth: its #### answer is used.
    assert compute_score("#### 72", "48 + 24 = 72\n#### 72") == 1.0


def test_custom_correct_score() -> None:
    assert compute_score("#### 72", "72", correct_score=2.0) == 2.0
    assert compute_score("72", "72", correct_score=2.0) == 2.0


# --- options ---------------------------------------------------------------------------------
def test_options_defaults_and_validation() -> None:
    opts = Gsm8kOptions()
    assert (opts.method, opts.fallback_flexible, opts.format_score, opts.correct_score) == (
        "strict", True, 0.0, 1.0)
    with pytest.raises(ValidationError):
        Gsm8kOptions(method="fuzzy")
    with pytest.raises(ValidationError):
        Gsm8kOptions(unknown=1)
    for name, f in Gsm8kOptions.model_fields.items():
        assert f.description, name


# --- component -------------------------------------------------------------------------------
def _batch(responses: list[str], truths: list) -> RewardBatch:
    n = len(responses)
    return RewardBatch(
        prompts=["q"] * n,
        responses=responses,
        ground_truths=truths,
        data_sources=["openai/gsm8k"] * n,
        extra_infos=[{} for _ in range(n)],
    )


def _component():
    pm = PluginManager()
    pm.register(gsm8k)
    return pm.get("reward", "gsm8k")


def test_component_registered() -> None:
    comp = _component()
    assert comp.kind == "reward"
    assert comp.load_config_model() is Gsm8kOptions
    assert "####" in comp.summary


def test_build_scores_batch() -> None:
    fn = _component().load_factory()(Gsm8kOptions(), None)
    batch = _batch(
        ["#### 72", "#### 71", "the answer is 5", "no idea", "#### 1,234", "#### $18.00"],
        ["72", 72, 5, "3", 1234, 18.0],
    )
    out = fn(batch)
    assert isinstance(out, RewardOutput)
    assert out.scores == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    assert out.extra["gsm8k/strict_found"] == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert out.extra["gsm8k/correct"] == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    assert all(len(v) == len(batch) for v in out.extra.values())


def test_build_with_options() -> None:
    factory = _component().load_factory()
    batch = _batch(["#### 71", "#### 72", "72"], ["72", "72", "72"])
    out = factory(Gsm8kOptions(format_score=0.2, fallback_flexible=False), None)(batch)
    assert out.scores == [0.2, 1.0, 0.0]
    assert out.extra["gsm8k/correct"] == [0.0, 1.0, 0.0]
    out = factory(Gsm8kOptions(method="flexible"), None)(batch)
    assert out.scores == [0.0, 1.0, 1.0]
    assert out.extra["gsm8k/strict_found"] == [1.0, 1.0, 0.0]


def test_build_without_options_and_empty_batch() -> None:
    fn = gsm8k.build(None, None)
    assert fn(_batch(["#### 3"], ["3"])).scores == [1.0]
    empty = fn(_batch([], []))
    assert empty.scores == []
    assert empty.extra == {"gsm8k/strict_found": [], "gsm8k/correct": []}


@pytest.mark.parametrize(("answer", "expected"), [
    ("18.00", "18"), ("18", "18"), ("1234", "1234"), ("-0", "0"), ("0.50", "0.5"), ("1e3", "1000"),
    ("100", "100"), (None, None),
])
def test_canonical_answer_is_one_spelling_per_number(answer, expected) -> None:
    assert gsm8k.canonical_answer(answer) == expected


def test_the_answers_are_the_numbers_that_were_scored() -> None:
    responses = ["\\boxed{9} #### 1,234", "first 3 then 4", "no number", "#### 5.0"]
    batch = RewardBatch([""] * 4, responses, ["1234"] * 4, ["gsm8k"] * 4, [{}] * 4)
    assert gsm8k.build(None, None)(batch).answers == ["1234", "4", None, "5"]  # type: ignore[attr-defined]
    strict_only = gsm8k.build(Gsm8kOptions(fallback_flexible=False), None)(batch)
    assert strict_only.answers == ["1234", None, None, "5"]  # type: ignore[attr-defined]
    flexible = gsm8k.build(Gsm8kOptions(method="flexible"), None)(batch)
    assert flexible.answers == ["1234", "4", None, "5"]  # type: ignore[attr-defined]


def test_build_rejects_mismatched_lengths() -> None:
    fn = gsm8k.build(None, None)
    with pytest.raises(ValueError, match="ground truths"):
        fn(_batch(["#### 1", "#### 2"], ["1"]))


def test_module_is_light() -> None:
    code = "import sys, rlx.plugins.rewards.gsm8k; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
