"""`rlx data prepare/validate/inspect` on small fixture files in the original layouts, written here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlx.cli.main import run
from rlx.plugins.tasks.datasets import GSM8K_INSTRUCTION, MATH_INSTRUCTION, gsm8k_answer, split_of
from rlx.run.data import read_rows, row_problems

GSM8K_TRAIN = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                 "How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
               "$<<0.2*50=10>>10.\n#### 10"},
    {"question": "A broken record with no final answer.", "answer": "It goes on and on."},
]
GSM8K_TEST = [{"question": "A farm has 1,200 hens and buys 34 more. How many hens now?",
               "answer": "1,200 + 34 = 1,234\n#### 1,234"}]
MATH_LIGHTEVAL = [
    {"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "level": "Level 1", "type": "Prealgebra",
     "solution": "We have $\\frac{1}{2} + \\frac{1}{4} = \\boxed{\\frac{3}{4}}$."},
    {"problem": "Find $x$ if $2x = 10$.", "level": "Level 1", "type": "Algebra",
     "solution": "Dividing, $x = \\boxed{5}$."},
    {"problem": "A solution without a box.", "level": "Level 5", "type": "Algebra", "solution": "It is 3."},
]
MATH_500 = [{"problem": "Compute $\\sqrt{16}$.", "solution": "$\\sqrt{16} = \\boxed{4}$", "answer": "4",
             "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"}]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """`rlx ARGS` in this process: (exit status, stdout, stderr)."""
    try:
        run(list(args))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def rows_of(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


# -- prepare ------------------------------------------------------------------------------------
def test_prepare_gsm8k_from_the_original_jsonl(tmp_path, capsys):
    train = write_jsonl(tmp_path / "src" / "train.jsonl", GSM8K_TRAIN)
    test = write_jsonl(tmp_path / "src" / "test.jsonl", GSM8K_TEST)
    code, out, err = cli(capsys, "data", "prepare", "gsm8k", "--out", str(tmp_path / "out"), "--source", str(train),
                         "--source", str(test))
    assert code == 0, err
    assert "train: 2 rows" in out and "(1 skipped: no usable answer)" in out and "test: 1 rows" in out
    # the next command names a model: without one `rlx train` stops with "no model given"
    assert "rlx train --reward gsm8k --model Qwen/Qwen2.5-0.5B-Instruct data.train_files=" in out
    rows = rows_of(tmp_path / "out" / "train.parquet")
    assert rows[0] == {
        "prompt": [{"role": "user", "content": GSM8K_TRAIN[0]["question"] + " " + GSM8K_INSTRUCTION}],
        "data_source": "openai/gsm8k", "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 0, "question": GSM8K_TRAIN[0]["question"],
                       "answer": GSM8K_TRAIN[0]["answer"]},
    }
    assert "####" in GSM8K_INSTRUCTION
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["72", "10"]
    assert rows_of(tmp_path / "out" / "test.parquet")[0]["reward_model"]["ground_truth"] == "1234"
    assert all(not row_problems(r) for r in rows)  # what training reads
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["test.parquet", "train.parquet"]


def test_prepare_gsm8k_from_a_folder_of_hub_parquet_files(tmp_path, capsys):
    src = tmp_path / "gsm8k" / "main"
    write_parquet(src / "train-00000-of-00001.parquet", GSM8K_TRAIN)
    write_parquet(src / "test-00000-of-00001.parquet", GSM8K_TEST)
    code, _, err = cli(capsys, "data", "prepare", "gsm8k", "-o", str(tmp_path / "out"), "--source",
                       str(tmp_path / "gsm8k"), "--limit", "1", "--instruction", "", "--data-source", "gsm8k")
    assert code == 0, err
    rows = rows_of(tmp_path / "out" / "train.parquet")
    assert len(rows) == 1 and rows[0]["prompt"][0]["content"] == GSM8K_TRAIN[0]["question"]
    assert rows[0]["data_source"] == "gsm8k"


def test_prepare_math_lighteval_and_math500_layouts(tmp_path, capsys):
    write_parquet(tmp_path / "lighteval" / "train-00000.parquet", MATH_LIGHTEVAL)
    code, out, err = cli(capsys, "data", "prepare", "math", "--out", str(tmp_path / "out"), "--source",
                         str(tmp_path / "lighteval"))
    assert code == 0, err
    rows = rows_of(tmp_path / "out" / "train.parquet")
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["\\frac{3}{4}", "5"]
    assert rows[0]["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert rows[0]["prompt"][0]["content"].endswith(MATH_INSTRUCTION) and "\\boxed{}" in MATH_INSTRUCTION
    assert rows[0]["extra_info"]["level"] == "Level 1" and rows[0]["extra_info"]["type"] == "Prealgebra"
    assert "1 skipped" in out
    m500 = write_jsonl(tmp_path / "m500.jsonl", MATH_500)
    code, out, err = cli(capsys, "data", "prepare", "math", "--out", str(tmp_path / "out500"), "--source",
                         f"test={m500}", "--data-source", "HuggingFaceH4/MATH-500")
    assert code == 0, err
    (row,) = rows_of(tmp_path / "out500" / "test.parquet")
    assert row["reward_model"]["ground_truth"] == "4" and row["data_source"] == "HuggingFaceH4/MATH-500"
    assert row["extra_info"]["unique_id"] == "test/algebra/1.json"


def test_prepared_rows_are_scored_by_the_routed_rewards(tmp_path, capsys):
    """What prepare writes is what the default router and the rewards expect."""
    from rlx.plugins.rewards.router import DEFAULT_ROUTES

    write_jsonl(tmp_path / "train.jsonl", GSM8K_TRAIN)
    write_parquet(tmp_path / "m" / "train.parquet", MATH_LIGHTEVAL)
    assert cli(capsys, "data", "prepare", "gsm8k", "--out", str(tmp_path / "g"), "--source",
               str(tmp_path / "train.jsonl"))[0] == 0
    assert cli(capsys, "data", "prepare", "math", "--out", str(tmp_path / "mo"), "--source",
               str(tmp_path / "m"))[0] == 0
    g, m = rows_of(tmp_path / "g" / "train.parquet")[0], rows_of(tmp_path / "mo" / "train.parquet")[0]
    assert DEFAULT_ROUTES[g["data_source"]] == "gsm8k" and DEFAULT_ROUTES[m["data_source"]] == "math"
    from rlx.plugins.rewards import gsm8k
    from rlx.plugins.rewards import math as math_reward
    from rlx.protocols import RewardBatch

    assert gsm8k.build(None, None)(RewardBatch([""], ["... #### 72"], [g["reward_model"]["ground_truth"]],
                                               [g["data_source"]], [{}])).scores == [1.0]
    fn = math_reward.build(math_reward.MathOptions(backend="builtin"), None)
    assert fn(RewardBatch([""], ["so \\boxed{0.75}"], [m["reward_model"]["ground_truth"]], [""], [{}])).scores == [1.0]


def test_prepare_errors(tmp_path, capsys):
    code, _, err = cli(capsys, "data", "prepare", "gsm8k", "--out", str(tmp_path), "--source", str(tmp_path / "no"))
    assert code == 2 and "no such file or folder" in err
    odd = write_jsonl(tmp_path / "stuff.jsonl", GSM8K_TEST)
    code, _, err = cli(capsys, "data", "prepare", "gsm8k", "--out", str(tmp_path), "--source", str(odd))
    assert code == 2 and "cannot tell the split of stuff.jsonl" in err and "--source train=" in err
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n{not json\n')
    code, _, err = cli(capsys, "data", "prepare", "gsm8k", "--out", str(tmp_path), "--source", str(bad))
    assert code == 2 and "line 2 is not valid JSON" in err
    none = write_jsonl(tmp_path / "empty" / "train.jsonl", [{"question": "q", "answer": "no marker"}])
    code, _, err = cli(capsys, "data", "prepare", "gsm8k", "--out", str(tmp_path), "--source", str(none))
    assert code == 2 and "none of the 1 records has a usable question and answer" in err
    code, _, err = cli(capsys, "data", "prepare", "gsm9k", "--out", str(tmp_path))
    assert code == 2 and "Did you mean 'gsm8k'?" in err


def test_prepare_checks_the_output_folder_first_and_writes_mixed_metadata(tmp_path, capsys):
    source = write_jsonl(tmp_path / "train.jsonl", GSM8K_TEST)
    (tmp_path / "afile").write_text("x")
    code, _, err = cli(capsys, "data", "prepare", "gsm8k", "--out", str(tmp_path / "afile"), "--source", str(source))
    assert code == 2 and "is a file, not a folder" in err and "Traceback" not in err
    code, _, err = cli(capsys, "data", "prepare", "gsm8k", "--out", str(tmp_path / "afile" / "x"), "--source",
                       str(source))
    assert code == 2 and "which is a file, not a folder" in err
    code, _, err = cli(capsys, "data", "prepare", "gsm8k", "--out", str(tmp_path / "o"), "--source", "train=")
    assert code == 2 and "give a file or folder after '='" in err
    # A source whose metadata columns change type from row to row (an int level, then a string one).
    mixed = write_jsonl(tmp_path / "m" / "test.jsonl", [
        {"problem": "p", "answer": "1", "level": 1, "solution": None},
        {"problem": "q", "answer": 2, "level": "Level 2", "subject": ["a"]}])
    code, _, err = cli(capsys, "data", "prepare", "math", "--out", str(tmp_path / "mo"), "--source", str(mixed))
    assert code == 0, err
    rows = rows_of(tmp_path / "mo" / "test.parquet")
    assert [r["extra_info"]["level"] for r in rows] == ["1", "Level 2"]
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["1", "2"]


def test_helpers():
    assert gsm8k_answer("so\n#### 1,234") == "1234" and gsm8k_answer("#### $5") == "5" and gsm8k_answer("x") is None
    assert split_of(Path("train-00000-of-00001.parquet")) == "train"
    assert split_of(Path("gsm8k_test.jsonl")) == "test" and split_of(Path("validation.json")) == "validation"
    assert split_of(Path("data.jsonl")) is None


def datasets_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(tmp_path / "hf-cache"), "HF_HOME": str(tmp_path / "hf-home")}


def test_prepare_reads_through_the_datasets_library(tmp_path):
    """--dataset takes what `datasets.load_dataset` takes: here a local folder, offline. Without --source and
    without network, the default hub id fails with a message that points at --source."""
    pytest.importorskip("datasets")
    write_jsonl(tmp_path / "local" / "train.jsonl", GSM8K_TRAIN)
    write_jsonl(tmp_path / "local" / "test.jsonl", GSM8K_TEST)
    cmd = [sys.executable, "-m", "rlx", "data", "prepare", "gsm8k", "--out", str(tmp_path / "out")]
    proc = subprocess.run([*cmd, "--dataset", str(tmp_path / "local")], capture_output=True, text=True,
                          env=datasets_env(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = rows_of(tmp_path / "out" / "train.parquet")
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["72", "10"]
    assert rows[0]["data_source"] == "openai/gsm8k"  # a local copy of the recipe's set keeps its source
    offline = subprocess.run(cmd, capture_output=True, text=True, env=datasets_env(tmp_path), timeout=120)
    assert offline.returncode == 2
    assert "Cannot load 'openai/gsm8k' from the Hugging Face hub" in offline.stderr
    assert "--source" in offline.stderr and "Traceback" not in offline.stderr


# -- validate -------------------------------------------------------------------------------------
GOOD = {"prompt": [{"role": "user", "content": "What is 1+1?"}], "data_source": "s",
        "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"i": 1}}


def test_validate_reports_every_bad_row_and_exits_2(tmp_path, capsys):
    rows = [GOOD, {**GOOD, "data_source": ""}, {**GOOD, "prompt": []},
            {**GOOD, "reward_model": {"style": "rule", "ground_truth": None}}]
    rows += [GOOD] * 3 + [{**GOOD, "data_source": ""}] * 25
    f = write_parquet(tmp_path / "bad.parquet", rows)
    code, out, err = cli(capsys, "data", "validate", str(f))
    assert code == 2
    lines = [line for line in out.splitlines() if ": row " in line]
    assert len(lines) == 28  # every bad row, not only the first few
    assert lines[0] == f"{f}: row 1: missing 'data_source' (a string naming the data set)"
    assert lines[1].startswith(f"{f}: row 2: 'prompt' must be a non-empty list")
    assert lines[2] == f"{f}: row 3: missing 'reward_model.ground_truth'"
    assert "Error: 28 of 32 rows are not usable" in err and "Traceback" not in err


def test_validate_good_files_and_unreadable_ones(tmp_path, capsys):
    good = write_parquet(tmp_path / "good.parquet", [GOOD] * 3)
    code, out, _ = cli(capsys, "data", "validate", str(good), str(good))
    assert code == 0 and out.count("3 rows, all usable") == 2
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    code, _, err = cli(capsys, "data", "validate", str(junk))
    assert code == 2 and "Cannot read" in err
    code, _, err = cli(capsys, "data", "validate", str(tmp_path / "missing.parquet"))
    assert code == 2 and "no such file" in err
    code, _, err = cli(capsys, "data", "validate", str(tmp_path))
    assert code == 2 and "that is a folder; give a parquet file" in err
    empty = tmp_path / "none.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty)
    code, out, err = cli(capsys, "data", "validate", str(good), str(empty))
    assert code == 2 and f"{empty}: no rows" in out
    assert f"Error: 1 file has no rows ({empty})." in err and "of 3 rows" not in err


# -- inspect --------------------------------------------------------------------------------------
def test_inspect_shows_rows_sources_and_token_lengths(tmp_path, capsys):
    rows = [{**GOOD, "prompt": [{"role": "user", "content": "What is 1+1?" + " x" * i}],
             "data_source": "a" if i % 3 else "b"} for i in range(30)]
    f = write_parquet(tmp_path / "d.parquet", rows)
    code, out, err = cli(capsys, "data", "inspect", str(f), "--tokenizer", "builtin:tiny-qwen2", "--rows", "2",
                         "--max-prompt-length", "40")
    assert code == 0, err
    assert "30 rows" in out and "data_source a: 20" in out and "data_source b: 10" in out
    assert out.count("--- row") == 2 and "ground_truth" in out
    assert "Prompt length in tokens (chat template applied)" in out
    code, out, _ = cli(capsys, "data", "inspect", str(f), "--tokenizer", "builtin:tiny-qwen2", "--json",
                       "--max-prompt-length", "40")
    stats = json.loads(out)
    from transformers import AutoTokenizer

    from rlx.run.data import resolve_path

    tok = AutoTokenizer.from_pretrained(resolve_path("builtin:tiny-qwen2"))
    lengths = sorted(len(tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                             add_special_tokens=False)["input_ids"]) for r in read_rows([str(f)]))
    assert stats["length_unit"] == "tokens"
    assert (stats["prompt_length"]["min"], stats["prompt_length"]["max"]) == (lengths[0], lengths[-1])
    assert stats["prompt_length"]["mean"] == pytest.approx(sum(lengths) / len(lengths), abs=0.05)
    assert stats["over_max_prompt_length"] == sum(n > 40 for n in lengths) > 0
    code, out, _ = cli(capsys, "data", "inspect", str(f), "--rows", "0")
    assert code == 0 and "Prompt length in characters (pass --tokenizer PATH for tokens)" in out
    (tmp_path / "no-tokenizer").mkdir()
    code, _, err = cli(capsys, "data", "inspect", str(f), "--tokenizer", str(tmp_path / "no-tokenizer"))
    assert code == 2 and "--tokenizer: the folder" in err and "is empty" in err and "sentencepiece" not in err


def test_data_commands_keep_the_cli_light(tmp_path):
    """`rlx data validate` does not import torch."""
    f = write_parquet(tmp_path / "good.parquet", [GOOD])
    code = ("import sys\nfrom rlx.cli.main import run\ntry:\n    run(['data', 'validate', sys.argv[1]])\n"
            "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code, str(f)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
