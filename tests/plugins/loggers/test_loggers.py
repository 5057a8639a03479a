"""The built-in loggers: console, jsonl and swanlab (offline, read back from disk)."""

from __future__ import annotations

import io
import json
import math
import sys

import pytest

from rlx.context import BuildContext
from rlx.plugins.loggers import console as console_mod
from rlx.plugins.loggers import jsonl as jsonl_mod
from rlx.plugins.loggers import swanlab as swanlab_mod
from rlx.protocols import Logger, RunInfo
from rlx.registry import PluginManager


def make_ctx(tmp_path, resumed: bool = False, resumed_step: int = 0) -> BuildContext:
    run = RunInfo(output_dir=str(tmp_path / "out"), project="rlx-test", experiment="exp1",
                  config={"algorithm": {"name": "grpo"}, "lr": 1e-3}, resumed=resumed, resumed_step=resumed_step)
    return BuildContext(config=None, run=run)


def step_metrics(step: int) -> dict[str, float]:
    return {
        "reward/mean": 0.1 * step,
        "reward/std": 0.2,
        "response_length/mean": 6.0 + step,
        "actor/pg_loss": -0.01 * step,
        "actor/kl_loss": 0.003,
        "actor/entropy": 2.9,
        "actor/grad_norm": 0.84,
        "actor/lr": 1e-3,
        "timing/step": 3.2,
        "perf/tokens_per_second": 410.0,
        "progress/total_steps": 3.0,
        "custom/unknown_key": 7.0,
    }


# ---------------------------------------------------------------------------------------------
# Registration
def test_hooks_register_the_three_loggers():
    pm = PluginManager()
    for module in (console_mod, jsonl_mod, swanlab_mod):
        pm.register(module)
    assert pm.names("logger") == ["console", "jsonl", "swanlab"]
    assert pm.get("logger", "console").load_config_model() is console_mod.ConsoleOptions
    assert pm.get("logger", "jsonl").load_factory() is jsonl_mod.build
    assert pm.get("logger", "swanlab").load_config_model() is swanlab_mod.SwanlabOptions


def test_options_forbid_unknown_fields_and_describe_every_field():
    from pydantic import ValidationError

    for model in (console_mod.ConsoleOptions, jsonl_mod.JsonlOptions, swanlab_mod.SwanlabOptions):
        with pytest.raises(ValidationError):
            model(no_such_option=1)
        assert all(f.description for f in model.model_fields.values()), model


def test_plugin_modules_do_not_import_heavy_libraries():
    code = ("import sys; import rlx.plugins.loggers.console, rlx.plugins.loggers.jsonl, "
            "rlx.plugins.loggers.swanlab; "
            "print(','.join(m for m in ('torch', 'swanlab', 'rich') if m in sys.modules))")
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


# ---------------------------------------------------------------------------------------------
# console
def test_console_prints_one_line_per_step(tmp_path, capsys):
    logger = console_mod.build(console_mod.ConsoleOptions(), make_ctx(tmp_path))
    assert isinstance(logger, Logger)
    for step in (1, 2, 3):
        logger.log(step_metrics(step), step)
    logger.finish()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    assert lines[1].startswith("step 2/3 | reward 0.2±0.2 | len 8 | pg_loss -0.02 | kl 0.003")
    assert "lr 1.0e-03" in lines[1] and "3.2 s/step" in lines[1] and "410 tok/s" in lines[1]
    assert "done: step 3/3" in lines[3] and "final reward 0.3" in lines[3]


def test_console_every_skips_missing_and_prints_samples(tmp_path, capsys):
    logger = console_mod.build(console_mod.ConsoleOptions(every=2, samples=True), make_ctx(tmp_path))
    for step in range(1, 6):
        logger.log({"reward/mean": float(step), "progress/total_steps": 5}, step)
    logger.log_samples([{"prompt": "1+1=", "response": "2\nok", "reward": 1.0}], step=5)
    logger.finish()
    out = capsys.readouterr().out
    steps = [line.split(" |")[0] for line in out.splitlines() if line.startswith("step ")]
    assert steps == ["step 1/5", "step 2/5", "step 4/5", "step 5/5"]  # first, every 2nd, last
    assert "step 4/5 | reward 4\n" in out  # missing metrics are left out
    assert "sample 0 @ step 5 | reward 1.0" in out and "response: 2\\nok" in out


def test_console_handles_nan_and_no_total(tmp_path, capsys):
    logger = console_mod.build(console_mod.ConsoleOptions(), make_ctx(tmp_path))
    logger.log({"reward/mean": float("nan"), "actor/kl_loss": 1.2e-5}, 7)
    assert capsys.readouterr().out.strip() == "step 7 | reward nan | kl 1.2e-05"


def test_console_progress_bar_in_a_terminal():
    from rich.console import Console

    buf = io.StringIO()
    term = Console(file=buf, force_terminal=True, width=150)
    logger = console_mod.ConsoleLogger(console_mod.ConsoleOptions(), console=term)
    for step in (1, 2, 3):
        logger.log(step_metrics(step), step)
    assert logger._progress is not None
    logger.finish()
    assert logger._progress is None
    out = buf.getvalue()
    assert "step 3/3 | reward 0.3" in out and "3/3" in out and "done: step 3/3" in out

    plain = console_mod.ConsoleLogger(console_mod.ConsoleOptions(progress=False), console=term)
    plain.log(step_metrics(1), 1)
    assert plain._progress is None


# ---------------------------------------------------------------------------------------------
# jsonl
def test_jsonl_writes_flushed_valid_lines(tmp_path):
    ctx = make_ctx(tmp_path)
    logger = jsonl_mod.build(jsonl_mod.JsonlOptions(), ctx)
    assert isinstance(logger, Logger)
    logger.log({"reward/mean": 0.5, "actor/pg_loss": -0.1}, 1)
    logger.log({"reward/mean": float("nan"), "actor/pg_loss": float("inf")}, 2)
    logger.log({"reward/mean": 0.75, "perf/total_tokens": 1234}, 3)
    # No finish(): every line must already be on disk, and each must be strict JSON.
    path = tmp_path / "out" / "metrics.jsonl"
    raw = path.read_text().splitlines()
    assert len(raw) == 3
    for line in raw:
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))

    rows = jsonl_mod.read_metrics(path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["reward/mean"] == 0.5 and rows[0]["actor/pg_loss"] == -0.1
    assert rows[1]["reward/mean"] is None and rows[1]["actor/pg_loss"] is None
    assert rows[2]["perf/total_tokens"] == 1234.0 and isinstance(rows[2]["perf/total_tokens"], float)
    assert all(isinstance(r["time"], float) for r in rows)
    assert jsonl_mod.read_metrics(tmp_path / "out") == rows  # a run folder works too
    logger.finish()


def test_jsonl_converts_array_scalars(tmp_path):
    np = pytest.importorskip("numpy")
    logger = jsonl_mod.build(None, make_ctx(tmp_path))
    logger.log({"a": np.float32(1.5), "b": np.int64(3), "c": np.float64("nan")}, 1)
    (row,) = jsonl_mod.read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert row["a"] == 1.5 and row["b"] == 3.0 and row["c"] is None


def test_jsonl_fresh_run_moves_old_file_aside_and_resume_drops_later_steps(tmp_path):
    """A resumed run keeps the lines up to its checkpoint's step, drops the later ones (it logs those
    steps again) and appends: each step once. A fresh run moves the old file aside."""
    path = tmp_path / "out" / "metrics.jsonl"
    first = jsonl_mod.build(jsonl_mod.JsonlOptions(), make_ctx(tmp_path))
    for step in (1, 2, 3):
        first.log({"x": float(step)}, step)
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"step": 4, "x": 4.')  # the line being written when the run was killed

    resumed = jsonl_mod.build(jsonl_mod.JsonlOptions(), make_ctx(tmp_path, resumed=True, resumed_step=2))
    assert [(r["step"], r["x"]) for r in jsonl_mod.read_metrics(path)] == [(1, 1.0), (2, 2.0)]
    resumed.log({"x": 3.5}, 3)
    rows = jsonl_mod.read_metrics(path)
    assert [(r["step"], r["x"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.5)]
    assert not list(path.parent.glob(".metrics.jsonl.tmp-*")), "the rewrite leaves no temporary file"

    fresh = jsonl_mod.build(jsonl_mod.JsonlOptions(), make_ctx(tmp_path))
    fresh.log({"x": 9.0}, 1)
    assert [r["x"] for r in jsonl_mod.read_metrics(path)] == [9.0]
    (old,) = (tmp_path / "out").glob("metrics.jsonl.prev-*")
    assert len(jsonl_mod.read_metrics(old)) == 3  # nothing the earlier run kept is lost


def test_jsonl_reader_skips_a_truncated_last_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\n\n{"step": 2, "x": 2.0}\n{"step": 3, "x"')
    assert [r["step"] for r in jsonl_mod.read_metrics(path)] == [1, 2]
    path.write_text('{"step": 1\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"m\.jsonl:1"):
        jsonl_mod.read_metrics(path)


def test_jsonl_samples(tmp_path):
    logger = jsonl_mod.build(jsonl_mod.JsonlOptions(), make_ctx(tmp_path))
    logger.log_samples([{"prompt": "1+1=", "response": "2", "reward": 1.0},
                        {"prompt": "2+2=", "response": "5", "reward": float("nan")}], step=4)
    rows = jsonl_mod.read_metrics(tmp_path / "out" / "samples.jsonl")
    assert [(r["step"], r["prompt"], r["reward"]) for r in rows] == [(4, "1+1=", 1.0), (4, "2+2=", None)]


# ---------------------------------------------------------------------------------------------
# swanlab
@pytest.fixture
def no_network_swanlab(tmp_path, monkeypatch):
    """No API key anywhere swanlab looks, no webhook, no saved login: nothing can go online."""
    pytest.importorskip("swanlab")
    for var in ("SWANLAB_API_KEY", "SWANLAB_MODE", "SWANLAB_WEBHOOK", "SWANLAB_API_HOST", "SWANLAB_WEB_HOST"):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "swanlab-home"
    home.mkdir()
    monkeypatch.setenv("SWANLAB_ROOT", str(home))
    monkeypatch.chdir(tmp_path)
    # Keep the test quiet and quick: no hardware monitor thread, no terminal capture.
    monkeypatch.setenv("SWANLAB_PROBE_MONITOR", "false")
    monkeypatch.setenv("SWANLAB_TERMINAL_PROXY_TYPE", "none")
    yield
    import swanlab

    if swanlab.has_run():  # a failed test must not leave a run open for the next one
        swanlab.finish()


def test_swanlab_auto_mode(no_network_swanlab, monkeypatch):
    assert swanlab_mod.resolve_mode("auto") == "offline"
    assert swanlab_mod.resolve_mode("cloud") == "online"
    monkeypatch.setenv("SWANLAB_MODE", "disabled")
    assert swanlab_mod.resolve_mode("auto") == "disabled"
    monkeypatch.delenv("SWANLAB_MODE")
    monkeypatch.setenv("SWANLAB_API_KEY", "not-a-real-key")
    assert swanlab_mod.resolve_mode("auto") == "online"


def test_swanlab_offline_run_reads_back(tmp_path, no_network_swanlab):
    ctx = make_ctx(tmp_path)
    logger = swanlab_mod.build(swanlab_mod.SwanlabOptions(mode="offline"), ctx)
    assert isinstance(logger, Logger)
    assert logger.mode == "offline"
    logged = {step: step_metrics(step) for step in (1, 2, 3)}
    logged[2]["actor/kl_loss"] = float("nan")
    for step, metrics in logged.items():
        logger.log(metrics, step)
    logger.log_samples([{"prompt": "1+1=", "response": "2", "reward": 1.0}], step=3)
    run_dir = logger.run_dir
    logger.finish()
    logger.finish()  # idempotent

    assert run_dir is not None and run_dir.parent == tmp_path / "out" / "swanlab"
    series = swanlab_mod.read_offline_run(run_dir)
    assert repr(swanlab_mod.read_offline_run(tmp_path / "out" / "swanlab")) == repr(series)  # logdir too
    for key in step_metrics(1):
        got = series[key]
        assert [s for s, _ in got] == [1, 2, 3], key
        for (step, value) in got:
            want = logged[step][key]
            assert (math.isnan(value) and math.isnan(want)) or value == pytest.approx(want), (key, step)
    assert "samples" not in series  # text goes to media records, not scalars


def test_swanlab_cloud_without_key_falls_back_to_offline(tmp_path, no_network_swanlab, caplog):
    logger = swanlab_mod.build(swanlab_mod.SwanlabOptions(mode="cloud", logdir=str(tmp_path / "sl")),
                               make_ctx(tmp_path))
    try:
        assert logger.mode == "offline"
        assert "recording it offline" in caplog.text
        logger.log({"reward/mean": 1.0}, 1)
    finally:
        logger.finish()
    assert swanlab_mod.read_offline_run(tmp_path / "sl") == {"reward/mean": [(1, 1.0)]}


def test_swanlab_disabled_writes_nothing(tmp_path, no_network_swanlab):
    logger = swanlab_mod.build(swanlab_mod.SwanlabOptions(mode="disabled"), make_ctx(tmp_path))
    logger.log({"reward/mean": 1.0}, 1)
    logger.finish()
    assert not (tmp_path / "out" / "swanlab").exists()
