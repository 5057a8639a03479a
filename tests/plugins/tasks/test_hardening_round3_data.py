"""Hardening round 3 (issue 33), the data, reward-model and plot classes, through the real ``rlx`` command:
bad metrics files for ``rlx plot``, ``rlx rm train`` without a model, a margin column that is not there,
chat roles no template knows, data files that cannot be opened (any OSError), and ``rlx data validate``
on renamed columns. Each is exit status 2 with one message naming the file, key or value and what would
be accepted, no traceback; nothing is dropped without saying so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_hardening_config import assert_user_error

from rlx.plugins.tasks import builtin
from rlx.run.data import CHAT_ROLES

ROLES = ", ".join(CHAT_ROLES)


@pytest.fixture
def rlx(tmp_path):
    """``rlx ARGS`` in ``tmp_path``, sharing the session's cache of built-in resources (conftest)."""
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    for name in ("RLX_STRICT_PLUGINS", "RLX_DISABLE_PLUGINS"):
        env.pop(name, None)

    def call(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        return subprocess.run([*prefix, sys.executable, "-m", "rlx", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    return call


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompt_rows(count: int, role: str = "user", every: int = 1) -> list[dict]:
    """Prompt rows in verl's shape; every ``every``-th one (1, 1+every, ...) has a message of ``role``."""
    return [{"prompt": [{"role": role if every == 1 or i % every == 1 else "user",
                         "content": f"What is {i % 5}+{i % 4}?"}],
             "data_source": "test/arith", "reward_model": {"style": "rule", "ground_truth": str(i % 5 + i % 4)}}
            for i in range(count)]


def tiny_train(tmp_path: Path, *overrides: str) -> list[str]:
    return ["train", "--preset", "tiny", "trainer.total_steps=1", f"trainer.output_dir={tmp_path / 'run'}",
            *overrides]


# -- 1. rlx plot on bad metrics files -------------------------------------------------------------------------
BAD_METRICS = "\n".join([
    '{"step": 1, "time": 1.0, "reward/mean": 0.25, "note": "text"}',
    '{"step": "two", "reward/mean": 0.5}',  # a step that is not a number: line skipped
    '{"step": true, "reward/mean": 0.5}',  # a bool is not a step either
    '{"step": 2.5, "reward/mean": 0.5}',  # nor a fraction
    'not json at all',
    '[1, 2, 3]',  # JSON, not an object
    '{"reward/mean": 0.5}',  # no step
    '{"step": 3, "reward/mean": NaN}',  # values skipped but counted: NaN, infinities, text, null, too large
    '{"step": 4, "reward/mean": Infinity}',
    '{"step": 5, "reward/mean": -Infinity}',
    '{"step": 6, "reward/mean": "high"}',
    '{"step": 7, "reward/mean": null}',
    '{"step": 8, "reward/mean": ' + "9" * 400 + '}',
    '{"step": 9.0, "time": 9.0, "reward/mean": 1.0}',  # a whole float is a step
]) + "\n"


def test_plot_skips_bad_lines_and_values_with_one_warning(rlx, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(BAD_METRICS)
    proc = rlx("plot", "run")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1, proc.stderr
    assert warnings[0].startswith("Warning: run/metrics.jsonl: skipped 6 lines") and "6 values" in warnings[0]
    chart = proc.stdout.splitlines()
    assert chart[0] == "reward (reward/mean)"
    assert chart[1].endswith("0.25 -> 1 (min 0.25, max 1; steps 1-9)"), chart  # only the two good points
    assert len(chart[1].split()[1]) == 2


def test_plot_png_of_a_file_with_nan_and_mixed_types(rlx, tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "m.jsonl").write_text(BAD_METRICS)
    proc = rlx("plot", "m.jsonl", "--out", "curves.png")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("Warning: m.jsonl: skipped") == 1
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("text, words", [
    (b"", ["nothing to plot"]),
    (b"\n\n", ["nothing to plot"]),
    (b'{"step": "a", "reward/mean": 1}\n{"step": 1, "reward/mean": NaN}\n',
     ["nothing to plot", "skipped 1 line that is not a JSON object", "1 value that is NaN"]),
    (b'{"step": 1, "time": 3.0}\n', ["nothing to plot"]),  # steps but no metric
    (b"\x00\xff\xfe binary \x01\n", ["nothing to plot", "skipped 1 line"]),  # not even UTF-8
])
def test_plot_with_nothing_plottable_names_the_file(rlx, tmp_path, text, words):
    (tmp_path / "m.jsonl").write_bytes(text)
    assert_user_error(rlx("plot", "m.jsonl"), "m.jsonl: ", *words)


# -- 2. rlx rm train with no model ----------------------------------------------------------------------------
def test_rm_train_without_a_model_says_how_to_give_one(rlx, tmp_path):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", builtin.arith_pref_rows("train", 4, seed=1))
    (tmp_path / "rm.yaml").write_text(f"data:\n  train_files: [{pairs}]\n")
    for args in (["--config", "rm.yaml"], ["model.path=null", f"data.train_files={pairs}"],
                 ["--model", "", f"data.train_files={pairs}"]):
        err = assert_user_error(rlx("rm", "train", *args), "model.path: no model given", "--model",
                                "model.path=", "--preset rm_tiny", "a --config file replaces the preset")
        assert "Input should be" not in err and "rlx config show" not in err, err


# -- 3. a margin column the config names but the file lacks --------------------------------------------------
def test_rm_train_margin_key_missing_names_file_key_and_columns(rlx, tmp_path):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"q{i}", "chosen": "yes", "rejected": f"no{i}"}
                                                   for i in range(5)])
    err = assert_user_error(rlx("rm", "train", "--preset", "rm_tiny", f"data.train_files={pairs}",
                                "data.margin_key=margins", f"trainer.output_dir={tmp_path / 'run'}"),
                            f"{pairs}: no row has the column 'margins' (columns present: prompt, chosen, rejected)",
                            "data.margin_key")
    assert "row 0" not in err and err.count("margins") <= 3, err  # one line, not one per row
    proc = rlx("data", "validate", str(pairs), "--margin-key", "margins")
    assert_user_error(proc, "lacks a column", "--margin-key")
    assert proc.stdout.strip().splitlines() == [
        f"{pairs}: no row has the column 'margins' (columns present: prompt, chosen, rejected)."]


# -- 4. chat roles no template knows --------------------------------------------------------------------------
def test_train_refuses_prompts_with_an_unknown_role_and_says_which(rlx, tmp_path):
    data = write_parquet(tmp_path / "wizard.parquet", prompt_rows(64, role="wizard", every=2))
    err = assert_user_error(rlx(*tiny_train(tmp_path, f"data.train_files={data}")),
                            "32 of 64 rows are not usable",
                            f"row 1: prompt[0] has the role 'wizard'; the roles accepted are {ROLES}")
    assert "row 0:" not in err and "fewer than data.train_batch_size" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_rm_train_refuses_pairs_with_an_unknown_role(rlx, tmp_path):
    rows = builtin.arith_pref_rows("train", 4, seed=2)
    rows[2]["prompt"] = [{"role": "usr", "content": "What is 1+1?"}]
    pairs = write_jsonl(tmp_path / "pairs.jsonl", rows)
    assert_user_error(rlx("rm", "train", "--preset", "rm_tiny", f"data.train_files={pairs}",
                          f"trainer.output_dir={tmp_path / 'run'}"),
                      "1 of 4 preference rows", f"row 2: prompt[0] has the role 'usr'; the roles accepted are {ROLES}",
                      "Did you mean 'user'?")


# -- 5. data files that cannot be opened: one OSError check --------------------------------------------------
def test_data_file_under_a_regular_file_is_named_not_a_traceback(rlx, tmp_path):
    (tmp_path / "blocker").write_text("a file, not a folder\n")
    prompts, pairs = tmp_path / "blocker" / "train.parquet", tmp_path / "blocker" / "pairs.jsonl"
    why = "a part of its path is a file, not a folder"
    assert_user_error(rlx(*tiny_train(tmp_path, f"data.train_files={prompts}")),
                      f"data.train_files: cannot read '{prompts}': {why}")
    assert_user_error(rlx(*tiny_train(tmp_path, f"data.val_files={prompts}")), "data.val_files", why)
    assert_user_error(rlx("rm", "train", "--preset", "rm_tiny", f"data.train_files={pairs}"),
                      f"data.train_files: cannot read '{pairs}': {why}")
    assert_user_error(rlx("data", "validate", str(prompts)), str(prompts), why)
    assert_user_error(rlx("data", "inspect", str(prompts)), str(prompts), why)
    assert_user_error(rlx("data", "prepare", "gsm8k", "--out", "out", "--source", f"train={pairs}"), why)


def as_a_user() -> tuple[str, ...]:
    """The command prefix that makes permissions count: none for a user; for root, setpriv without the
    capabilities that let root read and enter anything (a skip where there is no setpriv)."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root ignores file permissions, and there is no setpriv to drop that")
    caps = "-dac_override,-dac_read_search"
    return (setpriv, f"--inh-caps={caps}", f"--bounding-set={caps}")


@pytest.mark.parametrize("lock", ["folder", "file"])
def test_data_file_the_user_cannot_read(rlx, tmp_path, lock):
    prefix = as_a_user()
    locked = tmp_path / "locked"
    locked.mkdir()
    files = [write_parquet(locked / "train.parquet", prompt_rows(4)),
             write_jsonl(locked / "pairs.jsonl", builtin.arith_pref_rows("train", 4, seed=1)),
             locked / "metrics.jsonl"]
    files[2].write_text('{"step": 1, "reward/mean": 1.0}\n')
    for path in [locked] if lock == "folder" else files:
        path.chmod(0)
    try:
        for args in (tiny_train(tmp_path, f"data.train_files={files[0]}"),
                     ["rm", "train", "--preset", "rm_tiny", f"data.train_files={files[1]}"],
                     ["data", "validate", str(files[0])], ["data", "validate", str(files[1])],
                     ["data", "prepare", "preference", "--out", "out", "--source", f"train={files[1]}"],
                     ["plot", str(files[2])]):
            assert_user_error(rlx(*args, prefix=prefix), str(locked), "permission denied")
    finally:
        for path in [locked, *files]:
            path.chmod(0o755)


# -- 6. rlx data validate: unknown roles are bad rows, a renamed column is one line ------------------------
def test_data_validate_reports_unknown_roles_and_renamed_columns_once(rlx, tmp_path):
    wizard = write_parquet(tmp_path / "wizard.parquet", prompt_rows(6, role="wizard", every=3))
    proc = rlx("data", "validate", str(wizard))
    assert_user_error(proc, "2 of 6 rows are not usable")
    assert proc.stdout.splitlines() == [
        f"{wizard}: row {i}: prompt[0] has the role 'wizard'; the roles accepted are {ROLES}" for i in (1, 4)]

    renamed = write_parquet(tmp_path / "renamed.parquet",
                            [{"question" if k == "prompt" else k: v for k, v in r.items()} for r in prompt_rows(30)])
    proc = rlx("data", "validate", str(renamed))
    assert_user_error(proc, "1 file lacks a column every row needs", "--prompt-key")
    assert proc.stdout.splitlines() == [f"{renamed}: no row has the column 'prompt' (columns present: question, "
                                        "data_source, reward_model)."]
    assert rlx("data", "validate", str(renamed), "--prompt-key", "question").returncode == 0

    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "q", "chosen": f"a{i}", "rejectd": "b"}
                                                   for i in range(25)])
    proc = rlx("data", "validate", str(pairs))
    assert_user_error(proc, "lacks a column", "--rejected-key")
    assert proc.stdout.splitlines() == [f"{pairs}: no row has the column 'rejected' (columns present: prompt, "
                                        "chosen, rejectd). Did you mean 'rejectd'?"]
