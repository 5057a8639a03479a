"""Evaluation metrics (accuracy, mean@n, unbiased pass@k, majority@n per data source) and `rlx eval`."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlx.evaluation import (
    SampleRecord,
    correctness,
    default_ks,
    extract_answer,
    flatten,
    pass_at_k,
    summarize,
)


# -- pass@k ---------------------------------------------------------------------------------------
def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The fraction of k-subsets of n samples (c of them correct) that hold a correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 7))
def test_pass_at_k_is_the_exact_combinatorial_probability(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_edges_and_large_n():
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert 0.0 < pass_at_k(1000, 1, 10) == pytest.approx(0.01) and pass_at_k(1000, 1, 1000) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    assert default_ks(1) == [1] and default_ks(8) == [1, 2, 4, 8] and default_ks(6) == [1, 2, 4, 6]


# -- answers and correctness ------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "expected"), [
    ("so the answer is \\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{ 12.50 }", "12.5"),
    ("She has 5 apples, then 7.\n#### 1,200 apples", "1200"),
    ("#### $-3", "-3"),
    ("first 3 then 4", "4"),
    ("7", "7"),
    ("no number", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_correctness_uses_the_rewards_correct_flags_else_a_threshold():
    scores = [1.0, 0.1, 0.8, 1.0]
    assert correctness(scores, {}) == [True, False, False, True]
    assert correctness(scores, {}, threshold=0.5) == [True, False, True, True]
    # routed rewards: one flag per reward, 0.0 where the other reward scored the response
    extras = {"gsm8k/correct": [1.0, 0.0, 0.0, 0.0], "math/correct": [0.0, 0.0, 1.0, 0.0], "router/gsm8k": [1] * 4}
    assert correctness(scores, extras) == [True, False, True, False]
    assert correctness(scores, {**extras, "failed": [1.0, 0.0, 0.0, 0.0]}) == [False, False, True, False]


# -- the metrics --------------------------------------------------------------------------------------
def rec(prompt: int, source: str, score: float, correct: bool, answer: str | None) -> SampleRecord:
    return SampleRecord(prompt, source, score, correct, answer)


RECORDS = [
    # prompt 0 (a): 1 of 3 correct; the majority answer "5" is wrong
    rec(0, "a", 0.0, False, "5"), rec(0, "a", 0.0, False, "5"), rec(0, "a", 1.0, True, "7"),
    # prompt 1 (a): 2 of 3 correct; majority "3" is right
    rec(1, "a", 1.0, True, "3"), rec(1, "a", 1.0, True, "3"), rec(1, "a", 0.2, False, None),
    # prompt 2 (b): none correct, no answers at all
    rec(2, "b", 0.1, False, None), rec(2, "b", 0.1, False, None), rec(2, "b", 0.1, False, None),
]


def test_summarize_per_source_and_overall():
    s = summarize(RECORDS)
    a, b, total = s["a"], s["b"], s["all"]
    assert (a["prompts"], a["samples"]) == (2.0, 6.0)
    assert a["acc"] == pytest.approx(3 / 6)
    assert a["mean@3"] == pytest.approx(3.2 / 6) == a["reward/mean"]
    assert a["pass@1"] == pytest.approx((1 / 3 + 2 / 3) / 2)
    assert a["pass@2"] == pytest.approx(((1 - 1 / 3) + 1.0) / 2)
    assert a["pass@3"] == pytest.approx(1.0)
    assert a["maj@3"] == pytest.approx(0.5)
    assert b["acc"] == 0.0 and b["pass@3"] == 0.0 and b["maj@3"] == 0.0
    assert total["prompts"] == 3.0 and total["maj@3"] == pytest.approx(1 / 3)
    assert total["pass@2"] == pytest.approx(((1 - 1 / 3) + 1.0 + 0.0) / 3)
    assert sorted(s) == ["a", "all", "b"]
    assert summarize(RECORDS, ks=[2])["a"].keys() >= {"pass@2"} and "pass@1" not in summarize(RECORDS, ks=[2])["a"]
    assert summarize([]) == {}


def test_flatten_names_metrics_like_the_training_logs():
    flat = flatten(summarize(RECORDS), prefix="val")
    assert flat["val/acc"] == pytest.approx(3 / 9)
    assert flat["val/a/maj@3"] == pytest.approx(0.5)
    assert "val/a/prompts" not in flat and "val/reward/mean" in flat and "val/b/reward/mean" in flat


# -- `rlx eval` ---------------------------------------------------------------------------------------
def rlx(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlx", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"})


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    proc = rlx("eval", "--model", "builtin:tiny-qwen2", "--data", "builtin:arith-test", "--n", "4",
               "--temperature", "1.0", "--max-tokens", "4", "--output", str(tmp / "res.json"), "--samples",
               str(tmp / "samples.jsonl"), "trainer.seed=3", cwd=tmp)
    return proc, tmp


def test_eval_prints_a_table_and_writes_json_and_samples(eval_run):
    proc, tmp = eval_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    for word in ("data_source", "acc", "mean@4", "pass@1", "pass@2", "pass@4", "maj@4", "rlx/arith", "all"):
        assert word in proc.stdout, word
    result = json.loads((tmp / "res.json").read_text())
    assert (result["n"], result["temperature"], result["reward"], result["k"]) == (4, 1.0, "router", [1, 2, 4])
    m = result["metrics"]["rlx/arith"]
    assert (m["prompts"], m["samples"]) == (64, 256)
    assert 0.0 <= m["pass@1"] <= m["pass@2"] <= m["pass@4"] <= 1.0
    assert m["pass@1"] == pytest.approx(m["acc"])
    # The JSON is what the samples file gives when summarised again.
    rows = [json.loads(line) for line in (tmp / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 256 and {r["data_source"] for r in rows} == {"rlx/arith"}
    again = summarize([SampleRecord(**r) for r in rows], ks=[1, 2, 4])
    assert again.keys() == result["metrics"].keys()
    for source, metrics in again.items():
        assert metrics == pytest.approx(result["metrics"][source])
    assert all(r["score"] == 1.0 for r in rows if r["correct"])  # arith: correct means exactly right


def test_eval_json_flag_and_errors(eval_run, tmp_path):
    proc = rlx("eval", "--model", "builtin:tiny-qwen2", "--data", "builtin:arith-test", "--max-tokens", "2",
               "--json", "--k", "1", "--reward", "arith", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["n"] == 1 and result["reward"] == "arith" and set(result["metrics"]) == {"rlx/arith", "all"}
    assert set(result["metrics"]["all"]) == {"prompts", "samples", "acc", "mean@1", "reward/mean", "pass@1", "maj@1"}
    missing = rlx("eval", "--model", "builtin:tiny-qwen2", "--data", "nope.parquet", cwd=tmp_path)
    assert missing.returncode == 2 and "--data nope.parquet: no such file" in missing.stderr
    assert "Traceback" not in missing.stderr
    bad_reward = rlx("eval", "--model", "builtin:tiny-qwen2", "--data", "builtin:arith-test", "--reward", "arth",
                     cwd=tmp_path)
    assert bad_reward.returncode == 2 and "Did you mean 'arith'?" in bad_reward.stderr
