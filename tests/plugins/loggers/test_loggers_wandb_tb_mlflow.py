"""The wandb, tensorboard and mlflow loggers against the dict that was logged: each backend is read back
from disk (the W&B offline run file, the TensorBoard event files, the local MLflow store) and must hold
every metric at every step with its value, the resolved config and the sample rows. Each test skips
when its package is not installed."""

from __future__ import annotations

import math
import sys

import pytest

from rlx.context import BuildContext
from rlx.errors import MissingDependencyError
from rlx.protocols import RunInfo

# The contract test's values (zeros, negatives, large and tiny magnitudes, whole numbers) plus a metric
# that is not a number, which the services leave out (metrics.jsonl keeps it).
LOGGED: dict[int, dict[str, object]] = {
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
        "critic/vf_loss": -1e12, "custom/negative_large": 0.0, "custom/zero_int": 5, "note": "text",
    },
}
NUMERIC = [k for k in LOGGED[3]]
CONFIG = {"algorithm": {"name": "grpo", "clip_ratio": 0.2}, "actor": {"optim": {"lr": 1e-6}},
          "trainer": {"loggers": ["console", "jsonl"]}}
SAMPLES = [{"prompt": "1+2=", "response": "3", "ground_truth": "3", "reward": 1.0},
           {"prompt": "4+4=", "response": "7 | x\ny", "ground_truth": "8", "reward": 0.0}]


def make_ctx(tmp_path, resumed: bool = False, resumed_step: int = 0) -> BuildContext:
    run = RunInfo(output_dir=str(tmp_path / "out"), project="rlx-test", experiment="contract",
                  config=CONFIG, resumed=resumed, resumed_step=resumed_step)
    return BuildContext(config=None, run=run)


def feed(logger) -> None:
    for step, metrics in LOGGED.items():
        logger.log_samples(SAMPLES, step)
        logger.log(dict(metrics), step)
    logger.finish()


def check_metrics(stored: dict[str, list[tuple[int, object]]]) -> None:
    assert set(stored) == set(NUMERIC), set(stored) ^ set(NUMERIC)
    for key in NUMERIC:
        want = [(step, float(metrics[key])) for step, metrics in LOGGED.items()]
        got = [(step, float(value)) for step, value in stored[key]]
        assert [s for s, _ in got] == [s for s, _ in want], key
        for (_, value), (_, expected) in zip(got, want):
            assert value == pytest.approx(expected, rel=1e-12, abs=0), (key, value, expected)


# -- TensorBoard ---------------------------------------------------------------------------------
def test_tensorboard_event_files_hold_every_metric_config_and_samples(tmp_path):
    pytest.importorskip("tensorboard")
    from rlx.plugins.loggers import tensorboard as tb

    feed(tb.build(None, make_ctx(tmp_path)))
    stored = tb.read_event_files(tmp_path / "out" / "tensorboard")
    config_text = stored.pop("config")
    samples = stored.pop("samples")
    check_metrics(stored)
    assert config_text[0][0] == 0 and "clip_ratio: 0.2" in config_text[0][1] and "lr: 1.0e-06" in config_text[0][1]
    assert [step for step, _ in samples] == [3, 4]
    table = samples[0][1].splitlines()
    assert table[0] == "| prompt | response | ground_truth | reward |"
    assert table[2] == "| 1+2= | 3 | 3 | 1.0 |"
    assert table[3] == "| 4+4= | 7 \\| x<br>y | 8 | 0.0 |"


def test_tensorboard_resume_hides_the_steps_logged_after_the_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    from rlx.plugins.loggers import tensorboard as tb

    first = tb.build(None, make_ctx(tmp_path))
    for step in (1, 2, 3):
        first.log({"reward/mean": float(step)}, step)
    first.finish()
    resumed = tb.build(None, make_ctx(tmp_path, resumed=True, resumed_step=1))
    for step in (2, 3):
        resumed.log({"reward/mean": 10.0 * step}, step)
    resumed.finish()
    assert tb.read_event_files(tmp_path / "out" / "tensorboard")["reward/mean"] == [(1, 1.0), (2, 20.0), (3, 30.0)]


# -- MLflow -------------------------------------------------------------------------------------
@pytest.fixture
def local_mlflow(monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def test_mlflow_local_store_holds_every_metric_config_and_samples(tmp_path, local_mlflow):
    from rlx.plugins.loggers import mlflow as mlflow_logger

    logger = mlflow_logger.build(None, make_ctx(tmp_path))
    feed(logger)
    run = mlflow_logger.read_store(mlflow_logger.default_store(tmp_path / "out"))
    assert run["run_id"] == logger.run_id
    check_metrics(run["metrics"])
    assert run["config"] == CONFIG
    assert run["params"]["algorithm.clip_ratio"] == "0.2" and run["params"]["actor.optim.lr"] == "1e-06"
    assert run["params"]["trainer.loggers"] == "['console', 'jsonl']"
    assert [t["step"] for t in run["samples"]] == [3, 4]
    for table in run["samples"]:
        assert table["columns"] == ["prompt", "response", "ground_truth", "reward"]
        assert table["data"] == [[v for v in row.values()] for row in SAMPLES]


def test_mlflow_renames_characters_it_refuses_and_resume_continues_the_run(tmp_path, local_mlflow):
    from rlx.plugins.loggers import mlflow as mlflow_logger

    first = mlflow_logger.build(None, make_ctx(tmp_path))
    # reward/failed beside reward/failed/exception: a name that is another's folder in a file store.
    first.log({"reward/acc@1": 0.5, "reward/mean": 1.0, "reward/failed": 0.0, "reward/failed/exception": 2.0}, 1)
    first.finish()
    resumed = mlflow_logger.build(None, make_ctx(tmp_path, resumed=True, resumed_step=1))
    assert resumed.run_id == first.run_id
    resumed.log({"reward/mean": 2.0}, 2)
    resumed.finish()
    run = mlflow_logger.read_store(mlflow_logger.default_store(tmp_path / "out"))
    assert run["metrics"] == {"reward/acc_1": [(1, 0.5)], "reward/mean": [(1, 1.0), (2, 2.0)],
                              "reward/failed": [(1, 0.0)], "reward/failed/exception": [(1, 2.0)]}


# -- W&B ------------------------------------------------------------------------------------------
@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """No key, no saved login, a private config folder: nothing can go online."""
    pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_ENTITY", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))


def test_wandb_auto_mode_is_offline_without_a_key(offline_wandb, monkeypatch):
    from rlx.plugins.loggers import wandb as wandb_logger

    assert wandb_logger.resolve_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_logger.resolve_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_logger.resolve_mode("auto") == "disabled"
    assert wandb_logger.resolve_mode("offline") == "offline"


def test_wandb_offline_run_holds_every_metric_config_and_samples(tmp_path, offline_wandb):
    from rlx.plugins.loggers import wandb as wandb_logger

    logger = wandb_logger.build(None, make_ctx(tmp_path))
    assert logger.mode == "offline"
    run_dir = logger.run_dir
    assert run_dir is not None and run_dir.name.startswith("offline-run-")
    feed(logger)
    stored = wandb_logger.read_offline_run(run_dir)
    check_metrics(stored["metrics"])
    assert stored["config"] == CONFIG
    assert [(t["step"], t["key"]) for t in stored["samples"]] == [(3, "samples"), (4, "samples")]
    assert stored["samples"][0]["columns"] == ["prompt", "response", "ground_truth", "reward"]
    assert stored["samples"][0]["data"] == [[v for v in row.values()] for row in SAMPLES]
    # The logdir finds its newest run too.
    assert wandb_logger.read_offline_run(tmp_path / "out")["metrics"] == stored["metrics"]


def test_wandb_run_file_reader_joins_records_split_over_blocks():
    from rlx.plugins.loggers import wandb as wandb_logger

    def record(kind: int, body: bytes) -> bytes:
        return b"\x9a\x9b\x9c\x9d" + len(body).to_bytes(2, "little") + bytes([kind]) + body  # CRC unchecked

    header = b":W&B\xe1\xbe\x00"
    big = bytes(range(256)) * 300  # 76,800 bytes: over three 32 KiB blocks (FIRST, MIDDLE, LAST)
    first_len = wandb_logger._BLOCK - 7 - 10 - 7  # what is left of block 1 after the headers and b"abc"
    middle_len = wandb_logger._BLOCK - 7
    data = header + record(1, b"abc") + record(2, big[:first_len])
    data += record(3, big[first_len:first_len + middle_len])
    assert len(data) == 2 * wandb_logger._BLOCK
    data += record(4, big[first_len + middle_len:]) + record(1, b"tail")
    assert list(wandb_logger._messages(data)) == [b"abc", big, b"tail"]
    assert list(wandb_logger._messages(data[:-1])) == [b"abc", big]  # a record cut short is left out
    # A block's last bytes, too few for a record header, are padding: the next record starts a new block.
    padded = header + record(1, b"p" * (wandb_logger._BLOCK - 7 - 7 - 3)) + b"\0" * 3 + record(1, b"next")
    assert list(wandb_logger._messages(padded))[1:] == [b"next"]
    with pytest.raises(ValueError, match="W&B"):
        list(wandb_logger._messages(b"not a run"))


# -- Missing packages -------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "module", "extra"), [("wandb", "wandb", "wandb"),
                                                        ("tensorboard", "tensorboard", "tensorboard"),
                                                        ("mlflow", "mlflow", "mlflow")])
def test_missing_package_is_one_message_with_the_install_command(tmp_path, monkeypatch, name, module, extra):
    import importlib

    logger_module = importlib.import_module(f"rlx.plugins.loggers.{name}")
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    with pytest.raises(MissingDependencyError) as info:
        logger_module.build(None, make_ctx(tmp_path))
    assert f"pip install 'rlx[{extra}]'" in info.value.hint
    assert f"`{module}`" in info.value.message


def test_loggers_listed_without_importing_their_packages():
    import subprocess

    code = ("import sys; from rlx.registry import get_plugin_manager; pm = get_plugin_manager(); "
            "names = sorted(n for (k, n) in pm.components() if k == 'logger'); "
            "print(names, [m for m in ('wandb', 'mlflow', 'tensorboard', 'torch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['console', 'jsonl', 'mlflow', 'swanlab', 'tensorboard', 'wandb'] []"


def test_nan_is_kept_as_nan_by_every_backend(tmp_path, local_mlflow):
    pytest.importorskip("tensorboard")
    from rlx.plugins.loggers import mlflow as mlflow_logger
    from rlx.plugins.loggers import tensorboard as tb

    for module in (tb, mlflow_logger):
        logger = module.build(None, make_ctx(tmp_path))
        logger.log({"actor/kl_loss": float("nan")}, 1)
        logger.finish()
    ((_, tb_value),) = tb.read_event_files(tmp_path / "out" / "tensorboard")["actor/kl_loss"]
    stored = mlflow_logger.read_store(mlflow_logger.default_store(tmp_path / "out"))
    ((_, ml_value),) = stored["metrics"]["actor/kl_loss"]
    assert math.isnan(tb_value) and math.isnan(ml_value)


# -- A real run ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_train_with_every_logger_offline_each_backend_holds_every_metric_of_metrics_jsonl(tmp_path, offline_wandb,
                                                                                         local_mlflow):
    """`rlx train trainer.loggers=[console,jsonl,tensorboard,wandb,mlflow]` on the built-in job, offline."""
    import os
    import subprocess

    pytest.importorskip("tensorboard")
    from rlx.plugins.loggers import jsonl as jsonl_logger
    from rlx.plugins.loggers import mlflow as mlflow_logger
    from rlx.plugins.loggers import tensorboard as tb
    from rlx.plugins.loggers import wandb as wandb_logger

    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "rlx", "train", "trainer.loggers=[console,jsonl,tensorboard,wandb,mlflow]",
         f"trainer.output_dir={out}", "trainer.total_steps=2", "trainer.test_freq=2", "trainer.save_freq=0",
         "trainer.save_hf_model=false", "data.train_batch_size=16"],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning: logger" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr

    rows = jsonl_logger.read_metrics(out)
    want = {}
    for row in rows:
        for key, value in row.items():
            if key not in ("step", "time") and isinstance(value, (int, float)):
                want.setdefault(key, []).append((row["step"], float(value)))
    assert "val/acc" in want and "reward/mean" in want and len(want) > 30, sorted(want)
    stored_tb = tb.read_event_files(out / "tensorboard")
    stored_wandb = wandb_logger.read_offline_run(out)
    stored_mlflow = mlflow_logger.read_store(mlflow_logger.default_store(out))
    same = str
    for name, metrics, rename in (("tensorboard", stored_tb, same), ("wandb", stored_wandb["metrics"], same),
                                  ("mlflow", stored_mlflow["metrics"], mlflow_logger.metric_name)):
        for key, series in want.items():
            # MLflow refuses '@' (val/.../mean@1): the one renaming, named in the logger's doc and warning.
            got = [(step, float(value)) for step, value in metrics.get(rename(key), [])]
            assert [s for s, _ in got] == [s for s, _ in series], (name, key, got, series)
            for (_, value), (_, expected) in zip(got, series):
                assert value == pytest.approx(expected, rel=1e-9, abs=0), (name, key, value, expected)
    assert stored_wandb["config"]["trainer"]["total_steps"] == 2
    assert stored_mlflow["config"]["trainer"]["total_steps"] == 2
    assert "total_steps: 2" in stored_tb["config"][0][1]
    assert [t["step"] for t in stored_wandb["samples"]] == [1, 2]
    assert [t["step"] for t in stored_mlflow["samples"]] == [1, 2]
