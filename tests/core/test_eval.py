"""Evaluation metrics (accuracy, mean@n, unbiased pass@k, majority@n per data source) and `rlx eval`."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlx.run.evaluation import (
    SampleRecord,
    correctness,
    default_ks,
    extract_answer,
    flatten,
    pass_at_k,
    records_from,
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


def test_maj_at_1_equals_acc_whatever_the_answers():
    """With one response per prompt the vote is that response, so maj@1 is acc: also when the response
    has no answer to extract (a reward that judges the whole text, say)."""
    records = [rec(0, "a", 1.0, True, None), rec(1, "a", 0.0, False, None), rec(2, "a", 1.0, True, "4"),
               rec(3, "b", 0.0, False, "5"), rec(4, "b", 1.0, True, None)]
    for source, m in summarize(records).items():
        assert m["maj@1"] == pytest.approx(m["acc"]), source
    # Responses without answers vote with their text; identical texts agree, and an answer wins a tie.
    texts = [SampleRecord(0, "a", 1.0, True, None, response="yes"), SampleRecord(0, "a", 1.0, True, None,
             response=" yes "), SampleRecord(0, "a", 0.0, False, "3"), SampleRecord(0, "a", 0.0, False, None,
             response="no")]
    assert summarize(texts)["a"]["maj@4"] == 1.0
    assert summarize(texts[2:])["a"]["maj@2"] == 0.0  # "3" (an answer) beats the text "no" at one vote each


def byte_tokenizer():
    """A byte-level BPE tokenizer over all 256 bytes, so any text survives encoding and decoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["#### 72"], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")


def scored_by(reward: str, responses: list[str], truth: str, source: str):
    """Responses of one prompt scored by a real reward through the reward worker, as evaluation does."""
    import torch

    from rlx.batch import Batch
    from rlx.registry import get_plugin_manager
    from rlx.run.reward_worker import RewardWorker

    tok = byte_tokenizer()
    ids = [tok(r, add_special_tokens=False)["input_ids"] for r in responses]
    width = max(len(i) for i in ids)
    resp = torch.full((len(ids), width), tok.pad_token_id)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, seq in enumerate(ids):
        resp[row, :len(seq)] = torch.tensor(seq)
        mask[row, :len(seq)] = 1
    n = len(responses)
    batch = Batch({"responses": resp, "response_mask": mask},
                  {"prompt_text": ["q"] * n, "ground_truth": [truth] * n, "data_source": [source] * n,
                   "extra_info": [{}] * n})
    fn = get_plugin_manager().get("reward", reward).load_factory()(None, None)
    batch.update(RewardWorker(fn, tok, reward).score(batch))
    assert batch["response_text"] == responses
    return records_from(batch, first_prompt=0, n=n)


def test_the_vote_uses_the_answer_the_reward_scored():
    # gsm8k scores the number after ####; a \boxed{} elsewhere in the text must not decide the vote.
    responses = ["#### 72", "#### 72.00", "\\boxed{9} #### 8", "\\boxed{9} #### 7", "\\boxed{9} #### 6"]
    records = scored_by("router", responses, "72", "openai/gsm8k")
    assert [r.answer for r in records] == ["72", "72", "8", "7", "6"]
    assert [r.correct for r in records] == [True, True, False, False, False]
    assert summarize(records)["all"]["maj@5"] == 1.0  # "72" (twice) wins; the boxed 9s are not the answers
    one = scored_by("gsm8k", ["\\boxed{9} #### 72"], "72", "openai/gsm8k")
    assert summarize(one)["all"]["maj@1"] == summarize(one)["all"]["acc"] == 1.0
    # math: equal values in different spellings are one answer.
    records = scored_by("math", ["\\boxed{0.5}", "\\boxed{\\frac{1}{2}}", "\\boxed{3}", "\\boxed{3.0}",
                                 "\\boxed{ 3 }"], "\\frac12", "math")
    assert [r.answer for r in records] == ["1/2", "1/2", "3", "3", "3"]
    assert summarize(records)["all"]["maj@5"] == 0.0


def test_composite_and_custom_rewards_report_the_answers_they_scored(tmp_path):
    from rlx.plugins.rewards.custom import CustomOptions
    from rlx.plugins.rewards.custom import build as build_custom
    from rlx.plugins.rewards.mix import MixOptions
    from rlx.plugins.rewards.mix import build as build_mix
    from rlx.protocols import RewardBatch
    from rlx.run.rewards import RewardRunner

    batch = RewardBatch(["q"] * 3, ["#### 1,200", "\\boxed{7} #### 5", "no answer"], ["1200", "5", "1"],
                        ["gsm8k"] * 3, [{}] * 3)
    mix = build_mix(MixOptions.model_validate({"components": [{"name": "format"}, {"name": "gsm8k"}]}), None)
    assert RewardRunner(mix, "mix").run(batch).answers == ["1200", "5", None]
    verl_style = tmp_path / "verl_style.py"
    verl_style.write_text("def compute_score(solution_str, ground_truth):\n"
                          "    pred = solution_str.split()[-1]\n"
                          "    return {'score': float(pred == ground_truth), 'acc': 1.0, 'pred': pred}\n")
    custom = build_custom(CustomOptions(path=str(verl_style)), None)
    assert RewardRunner(custom, "custom").run(batch).answers == ["1,200", "5", "answer"]


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
    from rlx.run.data import read_rows

    prompts = len(read_rows(["builtin:arith-test"]))
    assert prompts > 0 and (m["prompts"], m["samples"]) == (prompts, 4 * prompts)
    assert 0.0 <= m["pass@1"] <= m["pass@2"] <= m["pass@4"] <= 1.0
    assert m["pass@1"] == pytest.approx(m["acc"])
    # The JSON is what the samples file gives when summarised again.
    rows = [json.loads(line) for line in (tmp / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * prompts and {r["data_source"] for r in rows} == {"rlx/arith"}
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
    assert result["metrics"]["all"]["maj@1"] == result["metrics"]["all"]["acc"]
    missing = rlx("eval", "--model", "builtin:tiny-qwen2", "--data", "nope.parquet", cwd=tmp_path)
    assert missing.returncode == 2 and "--data nope.parquet: no such file" in missing.stderr
    assert "Traceback" not in missing.stderr
    bad_reward = rlx("eval", "--model", "builtin:tiny-qwen2", "--data", "builtin:arith-test", "--reward", "arth",
                     cwd=tmp_path)
    assert bad_reward.returncode == 2 and "Did you mean 'arith'?" in bad_reward.stderr


def test_eval_checks_its_output_files_before_the_work(tmp_path):
    (tmp_path / "file.txt").write_text("x")
    cases = [(("--output", "missing/res.json"), "--output missing/res.json: the folder 'missing' does not exist"),
             (("--samples", str(tmp_path)), f"--samples {tmp_path}: that is a folder"),
             (("--output", "file.txt/res.json"), "the folder 'file.txt' is a file, not a folder")]
    if os.geteuid() != 0:  # root may write anywhere
        (tmp_path / "locked").mkdir(mode=0o500)
        cases.append((("--output", "locked/res.json"), "cannot write there (permission denied)"))
    for args, message in cases:
        proc = rlx("eval", "--model", "builtin:tiny-qwen2", "--data", "builtin:arith-test", "--max-tokens", "2", *args,
                   cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert message in proc.stderr and "Traceback" not in proc.stderr
        assert "evaluated" not in proc.stderr  # no prompt was generated before the check
