"""Reward modeling (issue 12): the loss, preference rows, `rlx rm train`, `rlx eval --reward-model`, and
`rlx data prepare/validate` for preference pairs."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlx.plugins.reward_modeling.trainer import (
    RewardModelWorker,
    TokenPair,
    conversation_ids,
    pair_sums,
    pairwise_loss,
)
from rlx.plugins.tasks import builtin
from rlx.plugins.tasks.datasets import preference_pair

# `rlx rm` is registered in cli/main.py by the lead; until then (and after) this runs it the same way.
# The built-in run's pairwise validation accuracy at its last step (preset rm_tiny, 300 steps) was
# 0.985, 0.97, 0.965, 0.945, 0.97 and 0.94 over seeds 1-6, and 0.875 with the preset's seed (42), whose
# loss stays flat longest; the learning test asks for clearly less than the worst.
THRESHOLD = 0.75
SHIM = ("import sys\nfrom rlx.cli import main, rm\n"
        "if not any(g.name == 'rm' for g in main.app.registered_groups):\n"
        "    main.app.add_typer(rm.app, name='rm')\n"
        "main.run(sys.argv[1:])\n")


@pytest.fixture
def rlx(tmp_path):
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    env.pop("RLX_STRICT_PLUGINS", None)
    env.pop("RLX_DISABLE_PLUGINS", None)

    def call(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", SHIM, *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=timeout)

    return call


def assert_user_error(proc: subprocess.CompletedProcess, *words: str) -> str:
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stdout, err)
    assert "Traceback" not in err and "Traceback" not in proc.stdout, err
    assert err.count("Error:") == 1, err
    for w in words:
        assert w in err, f"{w!r} not in:\n{err}"
    return err


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pref_rows(count: int, split: str = "train") -> list[dict]:
    return builtin.arith_pref_rows(split, count, seed=5)


# -- the loss, worked by hand ---------------------------------------------------------------------
def test_pairwise_loss_matches_hand_computed_values():
    chosen = torch.tensor([2.0, 0.0, -1.0])
    rejected = torch.tensor([1.0, 0.0, 1.0])
    margin = torch.tensor([0.5, 0.0, 0.0])
    # -log sigmoid(x) = log(1 + e^-x):  x = 2 - 1 - 0.5 = 0.5 -> 0.474077;  x = 0 -> log 2 = 0.693147;
    # x = -2 -> log(1 + e^2) = 2.126928.  Centering 0.1 * (r_c + r_r)^2: 0.9, 0, 0.
    plain = pairwise_loss(chosen, rejected)
    assert plain.tolist() == pytest.approx([math.log(1 + math.exp(-1.0)), 0.693147, 2.126928], abs=1e-6)
    with_margin = pairwise_loss(chosen, rejected, margin)
    assert with_margin.tolist() == pytest.approx([0.474077, 0.693147, 2.126928], abs=1e-6)
    full = pairwise_loss(chosen, rejected, margin, center_coef=0.1)
    assert full.tolist() == pytest.approx([0.474077 + 0.9, 0.693147, 2.126928], abs=1e-6)
    sums = pair_sums(chosen, rejected, full)
    assert sums["accuracy"] == 1.5  # a win, a tie (half), a loss
    assert sums["margin"] == pytest.approx(1.0 + 0.0 - 2.0)
    assert sums["chosen"] == pytest.approx(1.0) and sums["rejected"] == pytest.approx(2.0)
    assert sums["loss"] == pytest.approx(0.474077 + 0.9 + 0.693147 + 2.126928, abs=1e-5)


def test_loss_gradient_pushes_chosen_up_and_centers():
    chosen = torch.tensor([0.3], requires_grad=True)
    rejected = torch.tensor([0.1], requires_grad=True)
    pairwise_loss(chosen, rejected, center_coef=0.5).sum().backward()
    s = 1 / (1 + math.exp(-0.2))  # d/dx -log sigmoid(x) = -(1 - sigmoid(x))
    assert chosen.grad.item() == pytest.approx(-(1 - s) + 2 * 0.5 * 0.4, abs=1e-6)
    assert rejected.grad.item() == pytest.approx((1 - s) + 2 * 0.5 * 0.4, abs=1e-6)


# -- preference rows ------------------------------------------------------------------------------
def test_preference_row_forms():
    text, problems = preference_pair({"prompt": "Hi?", "chosen": "Hello!", "rejected": "Go away."})
    assert not problems
    assert text.prompt == [{"role": "user", "content": "Hi?"}]
    assert text.chosen == [{"role": "assistant", "content": "Hello!"}]
    user = [{"role": "user", "content": "Hi?"}]
    # Conversational (prompt + reply messages) and UltraFeedback-style (each reply repeats the prompt).
    conv, _ = preference_pair({"prompt": user, "chosen": [{"role": "assistant", "content": "Hello!"}],
                               "rejected": [{"role": "assistant", "content": "Go away."}]})
    full, _ = preference_pair({"prompt": "Hi?", "chosen": [*user, {"role": "assistant", "content": "Hello!"}],
                               "rejected": [*user, {"role": "assistant", "content": "Go away."}]})
    implicit, _ = preference_pair({"chosen": [*user, {"role": "assistant", "content": "Hello!"}],
                                   "rejected": [*user, {"role": "assistant", "content": "Go away."}]})
    for pair in (conv, full, implicit):
        assert pair is not None
        assert (pair.prompt, pair.chosen, pair.rejected) == (text.prompt, text.chosen, text.rejected)
    with_margin, _ = preference_pair({"prompt": "a", "chosen": "b", "rejected": "c", "m": 2}, margin_key="m")
    assert with_margin.margin == 2.0


@pytest.mark.parametrize("row, words", [
    ({"prompt": "q", "rejected": "b"}, ["missing 'chosen'"]),
    ({"prompt": "q", "chosen": "a", "rejected": "  "}, ["'rejected' is empty"]),
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, ["identical"]),
    ({"chosen": "a", "rejected": "b"}, ["missing 'prompt'"]),
    ({"prompt": "q", "chosen": 3, "rejected": "b"}, ["'chosen' must be text or a list of chat messages"]),
    ({"prompt": "q", "chosen": [{"role": "assistant"}], "rejected": "b"}, ["chosen[0] must be"]),
])
def test_preference_row_problems(row, words):
    pair, problems = preference_pair(row)
    assert pair is None
    for w in words:
        assert any(w in p for p in problems), problems


def test_bad_margin_is_a_problem():
    _, problems = preference_pair({"prompt": "q", "chosen": "a", "rejected": "b", "margin": float("nan")},
                                  margin_key="margin")
    assert any("margin" in p for p in problems)


# -- the worker: exact gradient accumulation --------------------------------------------------------
def _worker(micro: int) -> RewardModelWorker:
    from rlx.plugins.modeling.worker import TorchBackendOptions
    from rlx.protocols import RoleSpec

    spec = RoleSpec(role="reward_model", model_path=builtin.resolve("builtin:tiny-qwen2"), trainable=True,
                    lr=1e-3, micro_batch_size=micro, seed=3, total_steps=10)
    worker = RewardModelWorker(spec, TorchBackendOptions(num_threads=1), "cpu")
    worker.set_pad_token_id(0)
    return worker


def test_micro_batches_accumulate_the_mean_loss_gradient():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(builtin.resolve("builtin:tiny-qwen2"))
    pairs = []
    for row in pref_rows(5):
        p, _ = preference_pair(row)
        pairs.append(TokenPair(conversation_ids(tok, p.prompt, p.chosen), conversation_ids(tok, p.prompt, p.rejected),
                               margin=0.25))
    grads = []
    for micro in (5, 2):  # one pass, and three micro-batches of unequal sizes
        w = _worker(micro)
        w.set_pad_token_id(tok.pad_token_id)
        w.optimizer_step = lambda: (0.0, True, 0.0)  # keep the gradient to compare it
        metrics = w.train_pairs(pairs, center_coef=0.1)
        grads.append(torch.cat([p.grad.flatten() for p in w.model.parameters() if p.grad is not None]))
        assert 0.0 <= metrics["accuracy"] <= 1.0
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)


# -- the command ------------------------------------------------------------------------------------
def test_rm_train_resume_and_eval(rlx, tmp_path):
    """A short run writes checkpoints and hf_model; a resumed run repeats the uninterrupted run's steps;
    `rlx eval --reward-model` scores the held-out pairs through the reward_model reward and agrees with the
    run's own validation."""
    common = ["trainer.total_steps=4", "trainer.test_freq=4", "trainer.loggers=[jsonl]", "data.train_batch_size=8",
              "rm.micro_batch_size_per_device=4", "data.val_batch_size=50"]
    whole = rlx("rm", "train", f"trainer.output_dir={tmp_path / 'whole'}", *common)
    assert whole.returncode == 0, whole.stderr
    assert "Validation pairwise accuracy" in whole.stdout
    part = rlx("rm", "train", f"trainer.output_dir={tmp_path / 'part'}", *common, "trainer.total_steps=2")
    assert part.returncode == 0, part.stderr
    resumed = rlx("rm", "train", "--resume", f"trainer.output_dir={tmp_path / 'part'}", *common)
    assert resumed.returncode == 0, resumed.stderr
    assert "Resuming from" in resumed.stdout

    def losses(run: str) -> dict[int, float]:
        lines = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return {d["step"]: d["train/loss"] for d in lines}

    assert losses("part") == pytest.approx(losses("whole"), rel=1e-5)
    final = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()][-1]
    model = tmp_path / "whole" / "hf_model"
    config = json.loads((model / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and len(config["id2label"]) == 1
    ev = rlx("eval", "--reward-model", str(model), "--data", "builtin:arith-pref-test", "--json")
    assert ev.returncode == 0, ev.stderr
    result = json.loads(ev.stdout)
    assert result["pairs"] == 200
    assert result["accuracy"] == pytest.approx(final["val/accuracy"], abs=1e-6)
    assert result["margin"] == pytest.approx(final["val/margin"], abs=1e-4)


def test_rm_train_bad_rows_exit_2(rlx, tmp_path):
    rows = pref_rows(4)
    rows[1].pop("chosen")
    rows[3]["rejected"] = ""
    bad = write_parquet(tmp_path / "bad.parquet", rows)
    err = assert_user_error(rlx("rm", "train", "--preset", "rm_tiny", f"data.train_files={bad}"),
                            "row 1: missing 'chosen'", "row 3: 'rejected' is empty", "2 of 4")
    assert "rlx data validate" in err


def test_rm_train_empty_validation_file_exit_2(rlx, tmp_path):
    empty = write_jsonl(tmp_path / "val.jsonl", [])
    assert_user_error(rlx("rm", "train", "--preset", "rm_tiny", f"data.val_files={empty}"),
                      "data.val_files", "holds no preference pairs")


def test_rm_train_model_neither_classifier_nor_causal_lm_exit_2(rlx, tmp_path):
    folder = tmp_path / "tagger"
    shutil.copytree(builtin.resolve("builtin:tiny-qwen2"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["Qwen2ForTokenClassification"]
    (folder / "config.json").write_text(json.dumps(config))
    assert_user_error(rlx("rm", "train", "--preset", "rm_tiny", "--model", str(folder)),
                      "neither a sequence classifier nor a causal LM", "Qwen2ForTokenClassification")


def test_rm_train_config_errors_exit_2(rlx, tmp_path):
    assert_user_error(rlx("rm", "train", "rm.center_rewards_coefficient=-1", "rm.bogus=1", "--backend", "fsdp2"),
                      "rm.center_rewards_coefficient", "rm.bogus: unknown key", "backend.name")


def test_eval_reward_model_rejects_a_causal_lm(rlx):
    assert_user_error(rlx("eval", "--reward-model", builtin.resolve("builtin:tiny-qwen2"),
                          "--data", "builtin:arith-pref-test"), "no trained reward head")


# -- rlx data prepare / validate --------------------------------------------------------------------
def test_data_prepare_preference_drops_and_counts(rlx, tmp_path):
    user = [{"role": "user", "content": "What is 1+1?"}]
    rows = [
        {"question": "What is 1+1?", "good": "2", "bad": "3"},
        {"question": "What is 2+2?", "good": "4", "bad": "4"},  # identical
        {"question": "What is 3+3?", "bad": "5"},  # missing side
        {"question": "What is 4+4?", "good": " ", "bad": "9"},  # empty side
        {"question": "What is 1+2?", "good": "3 " * 40, "bad": "1"},  # over-long with --max-length 40
    ]
    src = write_jsonl(tmp_path / "train.jsonl", rows)
    proc = rlx("data", "prepare", "preference", "--source", str(src), "--out", str(tmp_path / "out"),
               "--prompt-key", "question", "--chosen-key", "good", "--rejected-key", "bad",
               "--tokenizer", "builtin:tiny-qwen2", "--max-length", "40")
    assert proc.returncode == 0, proc.stderr
    assert "train: 1 pairs" in proc.stdout
    for words in ("1 empty side", "1 identical", "1 missing side", "1 over-long"):
        assert words in proc.stdout, proc.stdout
    written = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert written == [{"prompt": user, "chosen": [{"role": "assistant", "content": "2"}],
                        "rejected": [{"role": "assistant", "content": "3"}], "data_source": "preference"}]
    ok = rlx("data", "validate", str(tmp_path / "out" / "train.parquet"))
    assert ok.returncode == 0 and "all usable" in ok.stdout, ok.stderr


def test_data_prepare_preference_from_a_dataset_folder(rlx, tmp_path):
    """The hub path (`datasets.load_dataset`) on a local folder in TRL's conversational form."""
    pytest.importorskip("datasets")
    folder = tmp_path / "hub_copy"
    folder.mkdir()
    user = [{"role": "user", "content": "What is 2+2?"}]
    write_jsonl(folder / "train.jsonl", [
        {"prompt": user, "chosen": [{"role": "assistant", "content": "4"}],
         "rejected": [{"role": "assistant", "content": "5"}], "score_gap": 1.5},
        {"prompt": user, "chosen": [{"role": "assistant", "content": "4"}],
         "rejected": [{"role": "assistant", "content": "6"}], "score_gap": 3.0}])
    proc = rlx("data", "prepare", "preference", "--dataset", str(folder), "--out", str(tmp_path / "out"),
               "--margin-key", "score_gap")
    assert proc.returncode == 0, proc.stderr
    assert "train: 2 pairs" in proc.stdout and "data.margin_key=margin" in proc.stdout
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [r["margin"] for r in rows] == [1.5, 3.0]
    assert rows[1]["rejected"] == [{"role": "assistant", "content": "6"}] and rows[0]["prompt"] == user

def test_data_validate_preference_rows(rlx, tmp_path):
    rows = pref_rows(3)
    rows[0]["rejected"] = rows[0]["chosen"]
    rows[2]["chosen"] = None
    f = write_parquet(tmp_path / "pairs.parquet", rows)
    err = assert_user_error(rlx("data", "validate", str(f)), "2 of 3 rows")
    assert "preference row" in err
    long = write_parquet(tmp_path / "long.parquet", pref_rows(3))
    counted = rlx("data", "validate", str(long), "--tokenizer", "builtin:tiny-qwen2", "--max-length", "5")
    assert counted.returncode == 0, counted.stderr
    assert "3 pairs have a side longer than 5 tokens" in counted.stdout
    assert f"{f}: row 0: 'chosen' and 'rejected' are identical" in rlx("data", "validate", str(f)).stdout


def test_builtin_preference_set():
    rows = builtin.arith_pref_rows("train", 300, seed=0)
    for row in rows:
        _pair, problems = preference_pair(row)
        assert not problems
        a, b = row["prompt"][0]["content"][len("What is "):-1].split("+")
        assert row["chosen"] == str(int(a) + int(b)) != row["rejected"]
    assert len({r["rejected"] for r in rows}) == 10  # every digit is some pair's wrong reply


def test_rm_then_ppo_example_logs_the_reward_model_component(tmp_path):
    example = Path(__file__).resolve().parents[3] / "examples" / "rm_then_ppo.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(example), "--out", str(tmp_path), "--rm-steps", "3", "--ppo-steps", "1"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "rm" / "hf_model" / "model.safetensors").is_file()
    step = json.loads((tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()[-1])
    assert step["reward/mean"] == pytest.approx(0.7 * step["reward/arith/score"] + 0.3 * step["reward/rm/score"],
                                                abs=1e-5)
    assert "reward model" in proc.stdout

@pytest.mark.learning
def test_builtin_reward_model_learns(rlx, tmp_path):
    """`rlx rm train` with no arguments (preset rm_tiny): pairwise validation accuracy from chance (0.5) to
    well above it. Measured at the preset's last step over seeds (docs/reward-modeling.md): 0.875-0.985;
    the threshold leaves a wide margin below the worst seed."""
    proc = rlx("rm", "train", f"trainer.output_dir={tmp_path / 'run'}", "trainer.val_before_train=true",
               timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = [d["val/accuracy"] for d in lines if "val/accuracy" in d]
    assert 0.35 < val[0] < 0.65  # before training: chance
    assert val[-1] >= THRESHOLD, val
