"""Each logger against the dict that was logged: every key and value comes back (jsonl and SwanLab
read from disk) or is printed (console), including metrics whose value is 0.0, negative values and
large ones. Comparing two loggers with each other would pass when a metric is missing from both."""

from __future__ import annotations

import io
import math

import pytest

from rlx.context import BuildContext
from rlx.plugins.loggers import console as console_mod
from rlx.plugins.loggers import jsonl as jsonl_mod
from rlx.protocols import RunInfo

# Two steps of metrics with the values loggers get wrong: exact zeros (a falsy value), negatives,
# large and tiny magnitudes, and whole numbers.
LOGGED: dict[int, dict[str, float]] = {
    3: {
        "reward/mean": 0.0, "reward/std": 0.0, "actor/pg_loss": -0.0123, "actor/kl_loss": 0.0,
        "actor/entropy": -3.25, "actor/grad_norm": 1.5e6, "actor/lr": 1e-7, "response_length/mean": 7.0,
        "timing/step": 2.5, "perf/tokens_per_second": 123456.789, "progress/total_steps": 10.0,
        "critic/vf_loss": 1e12, "custom/negative_large": -987654.321, "custom/zero_int": 0,
    },
    4: {
        "reward/mean": -1.5, "reward/std": 0.25, "actor/pg_loss": 0.0, "actor/kl_loss": 2.5e-5,
        "actor/entropy": 0.0, "actor/grad_norm": 0.0, "actor/lr": 0.0, "response_length/mean": 0.0,
        "timing/step": 0.0, "perf/tokens_per_second": 0.0, "progress/total_steps": 10.0,
        "critic/vf_loss": -1e12, "custom/negative_large": 0.0, "custom/zero_int": 5,
    },
}


def make_ctx(tmp_path, resumed: bool = False) -> BuildContext:
    run = RunInfo(output_dir=str(tmp_path / "out"), project="rlx-test", experiment="contract",
                  config={"algorithm": {"name": "grpo"}}, resumed=resumed)
    return BuildContext(config=None, run=run)


def test_jsonl_file_holds_every_logged_key_and_value(tmp_path):
    logger = jsonl_mod.build(None, make_ctx(tmp_path))
    for step, metrics in LOGGED.items():
        logger.log(dict(metrics), step)
    logger.finish()
    rows = jsonl_mod.read_metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == list(LOGGED)
    for row, (step, metrics) in zip(rows, LOGGED.items()):
        assert set(row) == {"step", "time", *metrics}, step
        assert isinstance(row["time"], float) and row["time"] > 0
        for key, value in metrics.items():
            assert row[key] is not None and row[key] == value, (step, key, row[key], value)
            assert isinstance(row[key], float), (key, type(row[key]))


def test_jsonl_non_finite_values_are_null_and_other_keys_kept(tmp_path):
    logger = jsonl_mod.build(None, make_ctx(tmp_path))
    logger.log({"a": float("nan"), "b": float("inf"), "c": float("-inf"), "d": 0.0}, 1)
    assert jsonl_mod.read_metrics(tmp_path / "out")[0] | {"time": 0} == {"step": 1, "time": 0, "a": None,
                                                                          "b": None, "c": None, "d": 0.0}


@pytest.fixture
def offline_swanlab(tmp_path, monkeypatch):
    """No API key, no webhook, no saved login: nothing can go online."""
    pytest.importorskip("swanlab")
    for var in ("SWANLAB_API_KEY", "SWANLAB_MODE", "SWANLAB_WEBHOOK", "SWANLAB_API_HOST", "SWANLAB_WEB_HOST"):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "swanlab-home"
    home.mkdir()
    monkeypatch.setenv("SWANLAB_ROOT", str(home))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SWANLAB_PROBE_MONITOR", "false")
    monkeypatch.setenv("SWANLAB_TERMINAL_PROXY_TYPE", "none")
    yield
    import swanlab

    if swanlab.has_run():
        swanlab.finish()


def test_swanlab_offline_run_holds_every_logged_key_and_value(tmp_path, offline_swanlab):
    from rlx.plugins.loggers import swanlab as swanlab_mod

    logger = swanlab_mod.build(swanlab_mod.SwanlabOptions(mode="offline"), make_ctx(tmp_path))
    for step, metrics in LOGGED.items():
        logger.log(dict(metrics), step)
    run_dir = logger.run_dir
    logger.finish()
    stored = swanlab_mod.read_offline_run(run_dir)
    assert set(stored) == set(LOGGED[3]), set(stored) ^ set(LOGGED[3])
    for key in LOGGED[3]:
        want = [(step, float(metrics[key])) for step, metrics in LOGGED.items()]
        got = stored[key]
        assert [s for s, _ in got] == [s for s, _ in want], key
        for (_, value), (_, expected) in zip(got, want):
            assert value == pytest.approx(expected, rel=1e-12, abs=0), (key, value, expected)


def test_console_prints_each_shown_metric_with_its_value(tmp_path):
    from rich.console import Console

    out = io.StringIO()
    logger = console_mod.ConsoleLogger(console_mod.ConsoleOptions(progress=False),
                                       console=Console(file=out, width=400, color_system=None))
    for step, metrics in LOGGED.items():
        logger.log(dict(metrics), step)
    logger.finish()
    lines = out.getvalue().splitlines()
    assert lines[0] == ("step 3/10 | reward 0±0 | len 7 | pg_loss -0.0123 | kl 0 | entropy -3.25 | grad 1500000"
                        " | lr 1.0e-07 | 2.5 s/step | 123457 tok/s")
    assert lines[1] == ("step 4/10 | reward -1.5±0.25 | len 0 | pg_loss 0 | kl 2.5e-05 | entropy 0 | grad 0"
                        " | lr 0.0e+00 | 0 s/step | 0 tok/s")
    assert lines[2].startswith("done: step 4/10 | final reward -1.5 | ")
    assert len(lines) == 3


@pytest.mark.parametrize("value", [0.0, -0.0, -2.0, 1e9, 1e-9, float("nan"), float("inf"), -float("inf")])
def test_console_line_shows_every_field_for_any_value(value):
    """Each field of the line appears, whatever its value (a zero is a value, not a missing metric)."""
    metrics = {key: value for key, *_ in console_mod.LINE_FIELDS}
    metrics["reward/mean"] = value
    line = console_mod.format_line(metrics, 1)
    text = console_mod.fmt_number(value)
    assert line.startswith(f"step 1 | reward {text} | ")
    for key, label, fmt, unit in console_mod.LINE_FIELDS:
        shown = fmt(value)
        assert (f"{label} {shown}" if label else f"{shown} {unit}") in line, (key, line)
    assert line.count(" | ") == len(console_mod.LINE_FIELDS) + 1
    if math.isfinite(value) and value != 0:
        assert text != "0"


@pytest.mark.parametrize(("value", "text"), [
    (0.0, "0"), (-0.0, "0"), (1000.0, "1000"), (-1000.0, "-1000"), (123456.7, "123457"), (999.0, "999"),
    (0.001, "0.001"), (0.000999, "1.0e-03"), (-0.0005, "-5.0e-04"), (0.012345, "0.0123"), (2.0, "2"),
    (float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "-inf"),
])
def test_console_number_format(value, text):
    assert console_mod.fmt_number(value) == text


def test_console_total_steps_and_finish_without_steps():
    from rich.console import Console

    for total in (0.0, -3.0, float("nan"), float("inf"), "ten"):
        assert console_mod.format_line({"progress/total_steps": total, "reward/mean": 1.0}, 2) == "step 2 | reward 1"
    assert console_mod.format_line({"perf/tokens_per_second": float("nan")}, 1) == "step 1 | nan tok/s"
    out = io.StringIO()
    logger = console_mod.ConsoleLogger(console_mod.ConsoleOptions(), console=Console(file=out, color_system=None))
    logger.finish()
    logger.finish()  # once only
    assert out.getvalue() == "done: no new steps\n"
    # finished by the trainer's `finally` while an error leaves it before any step: not "done"
    out = io.StringIO()
    logger = console_mod.ConsoleLogger(console_mod.ConsoleOptions(), console=Console(file=out, color_system=None))
    try:
        raise ValueError("bad data")
    except ValueError:
        logger.finish()
    assert out.getvalue() == "stopped before the first step\n"


def test_console_samples_are_clipped_and_one_line_each():
    from rich.console import Console

    out = io.StringIO()
    logger = console_mod.ConsoleLogger(console_mod.ConsoleOptions(samples=True, progress=False),
                                       console=Console(file=out, width=1000, color_system=None))
    logger.log_samples([{"prompt": "p\nq", "response": "x" * 500, "reward": 0.0}], step=4)
    logger.log_samples([], step=5)
    lines = out.getvalue().splitlines()
    assert lines == ["sample 0 @ step 4 | reward 0.0", "  prompt: p\\nq", "  response: " + "x" * 299 + "…"]
    quiet = io.StringIO()
    off = console_mod.ConsoleLogger(console_mod.ConsoleOptions(progress=False),
                                    console=Console(file=quiet, color_system=None))
    off.log_samples([{"prompt": "p", "reward": 1.0}], step=1)
    assert quiet.getvalue() == ""


def test_jsonl_reserved_keys_and_sample_values(tmp_path):
    import numpy as np
    import torch

    logger = jsonl_mod.build(None, make_ctx(tmp_path))
    logger.log({"step": 99.0, "time": -1.0, "reward/mean": 0.0, "note": "text"}, 2)
    (row,) = jsonl_mod.read_metrics(tmp_path / "out")
    assert row["step"] == 2 and row["time"] > 0 and row["reward/mean"] == 0.0 and row["note"] == "text"
    logger.log_samples([], step=2)
    assert not (tmp_path / "out" / "samples.jsonl").exists()
    logger.log_samples([{"step": 7, "prompt": "p", "reward": float("nan"), "extra": {"a": [1, float("inf")]},
                         "t": torch.tensor([0.5, 2.0]), "n": np.float32(0.25), "flag": True, "none": None,
                         "obj": object}], step=3)
    (sample,) = jsonl_mod.read_metrics(tmp_path / "out" / "samples.jsonl")
    assert sample["step"] == 3 and isinstance(sample["time"], float)
    assert sample["reward"] is None and sample["extra"] == {"a": [1, None]} and sample["t"] == [0.5, 2.0]
    assert sample["n"] == 0.25 and sample["flag"] is True and sample["none"] is None
    assert sample["obj"] == str(object)


def test_jsonl_reader_rejects_damage_inside_the_file(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 2, "x": 1.0}\n\n{"step": 1, "x": 0.0}\n{"step": 2, "x": 3.0}\n\n')
    assert [r["x"] for r in jsonl_mod.read_metrics(path)] == [1.0, 0.0, 3.0]
    assert [(r["step"], r["x"]) for r in jsonl_mod.read_metrics(path, dedupe=True)] == [(1, 0.0), (2, 3.0)]
    path.write_text('{"step": 1}\n{"step": 2\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"m\.jsonl:2: not a JSON object"):
        jsonl_mod.read_metrics(path)
    path.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"m\.jsonl:2: expected a JSON object, got list"):
        jsonl_mod.read_metrics(path)


def test_jsonl_fresh_runs_never_overwrite_a_moved_aside_file(tmp_path):
    for value in (1.0, 2.0, 3.0):  # three fresh runs within one second: three distinct old files
        jsonl_mod.build(None, make_ctx(tmp_path)).log({"x": value}, 1)
    old = sorted((tmp_path / "out").glob("metrics.jsonl.prev-*"))
    assert len(old) == 2
    assert sorted(jsonl_mod.read_metrics(p)[0]["x"] for p in old) == [1.0, 2.0]
    assert jsonl_mod.read_metrics(tmp_path / "out")[0]["x"] == 3.0
    (tmp_path / "out" / "metrics.jsonl").write_text("")
    jsonl_mod.build(None, make_ctx(tmp_path))  # an empty file is not worth keeping
    assert len(sorted((tmp_path / "out").glob("metrics.jsonl.prev-*"))) == 2


def test_jsonl_file_is_utf8_text_with_dated_old_files(tmp_path):
    import re

    opts = jsonl_mod.JsonlOptions(filename="m.jsonl", samples_filename="s.jsonl")  # plain names in the run folder
    jsonl_mod.build(opts, make_ctx(tmp_path)).log({"reward/ü": 1.0}, 1)
    path = tmp_path / "out" / "m.jsonl"
    assert '"reward/ü": 1.0' in path.read_text(encoding="utf-8")  # readable, not \\u-escaped
    jsonl_mod.build(opts, make_ctx(tmp_path))
    (old,) = path.parent.glob("m.jsonl.prev-*")
    assert re.fullmatch(r"m\.jsonl\.prev-\d{8}-\d{6}", old.name), old.name


def test_console_shows_validation_steps_and_the_last_validation_accuracy():
    from rich.console import Console

    out = io.StringIO()
    logger = console_mod.ConsoleLogger(console_mod.ConsoleOptions(every=10, progress=False),
                                       console=Console(file=out, width=400, color_system=None))
    logger.log({"reward/mean": 0.5, "progress/total_steps": 20}, 1)
    logger.log({"reward/mean": 0.5}, 2)  # not printed: not every 10th, not first or last
    logger.log({"reward/mean": 0.5, "val/acc": 0.75, "val/reward/mean": 0.5}, 3)  # validated: printed
    logger.log({"reward/mean": 0.5, "val/reward/mean": 0.25}, 4)  # no accuracy: the last one is kept
    logger.finish()
    lines = out.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines[:-1]] == ["step 1/20", "step 3/20", "step 4/20"]
    assert "val acc 0.75 | val reward 0.5" in lines[1]
    assert lines[-1].startswith("done: step 4/20 | final reward 0.5 | last validation acc 0.75 | ")
