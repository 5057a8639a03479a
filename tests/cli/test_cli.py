"""The ``rlx`` command as a user runs it (subprocesses): exit codes, stdout, and one clear error on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlx import __version__


@pytest.fixture
def rlx(tmp_path):
    env = {**os.environ, "RLX_CACHE": str(tmp_path / "cache"), "NO_COLOR": "1", "COLUMNS": "200"}
    env.pop("RLX_STRICT_PLUGINS", None)
    env.pop("RLX_DISABLE_PLUGINS", None)

    def call(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rlx", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)

    return call


def assert_user_error(proc: subprocess.CompletedProcess, *words: str) -> str:
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stdout, err)
    assert "Traceback" not in err and "Traceback" not in proc.stdout, err
    assert err.count("Error:") == 1, err  # one message
    for w in words:
        assert w in err, f"{w!r} not in:\n{err}"
    return err


# -- a config key given as an option --------------------------------------------------------------
@pytest.mark.parametrize("args, hint", [
    (["train", "--actor.optim.lr=1e-6"], "without dashes: actor.optim.lr=1e-6."),
    (["train", "--total_steps", "5"], "without dashes: trainer.total_steps=5."),
    (["train", "--lr", "1e-6"], "actor.optim.lr=1e-6 or critic.optim.lr=1e-6"),
    (["config", "validate", "--bogus"], "without dashes (e.g. actor.optim.lr=1e-6); `rlx config show` lists them"),
    (["eval", "--data", "x.parquet", "--rollout.temperature=1"], "without dashes: rollout.temperature=1."),
])
def test_a_config_key_written_as_an_option_gets_the_override_to_write(rlx, args, hint):
    """Users of argparse-based trainers write settings as options; the usage error says the override instead."""
    proc = rlx(*args)
    assert proc.returncode == 2, proc.stderr
    err = " ".join(proc.stderr.replace("│", " ").split())
    assert "No such option" in err and hint in err, err
    assert "Possible options: --help" not in err and "Traceback" not in err


def test_an_option_typo_keeps_the_suggestion_and_no_key_hint(rlx):
    err = " ".join(rlx("train", "--algo", "grpo").stderr.replace("│", " ").split())
    assert "No such option: --algo (Possible options: --algorithm)" in err and "KEY=VALUE" not in err, err


# -- version and help ---------------------------------------------------------------------------
def test_version(rlx):
    proc = rlx("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"rlx {__version__}"


def test_help(rlx):
    proc = rlx("--help")
    assert proc.returncode == 0, proc.stderr
    for word in ("--version", "Print the version and exit.", "train", "config", "plugins"):
        assert word in proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args", [[], ["config"], ["config", "validate", "--bogus"]])
def test_usage_errors_have_no_traceback(rlx, args):
    proc = rlx(*args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "Usage:" in proc.stderr + proc.stdout


# -- the tiny preset ----------------------------------------------------------------------------
def test_validate_tiny_preset(rlx, tmp_path):
    proc = rlx("config", "validate")
    assert proc.returncode == 0, proc.stderr
    assert "Config is valid." in proc.stdout
    assert "built-in preset 'tiny'" in proc.stderr
    assert not (tmp_path / "cache").exists()  # validation writes no builtin: resources
    proc = rlx("config", "validate", "--preset", "tiny")
    assert proc.returncode == 0, proc.stderr


def test_validate_does_not_import_torch(tmp_path):
    code = ("import sys\nfrom rlx.cli.main import run\ntry:\n    run(['config', 'validate'])\n"
            "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    env = {**os.environ, "RLX_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_config_show_fills_plugin_defaults(rlx):
    proc = rlx("config", "show", "actor.optim.lr=1e-6", "data.shuffle=false", "trainer.loggers=[console,jsonl]")
    assert proc.returncode == 0, proc.stderr
    assert "algorithm:" in proc.stdout and "  clip_ratio: 0.2\n" in proc.stdout
    out = yaml.safe_load(proc.stdout)
    assert out["algorithm"]["clip_ratio"] == 0.2
    assert out["algorithm"]["loss_agg_mode"] == "token-mean"
    assert out["rollout"]["attn_implementation"] == "sdpa"  # an hf rollout option, defaulted
    assert out["actor"]["optim"]["lr"] == 1e-06
    assert out["data"]["shuffle"] is False
    assert out["trainer"]["loggers"] == ["console", "jsonl"]
    assert out["loggers"]["console"]["every"] >= 1


def test_config_show_layering(rlx, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"trainer": {"total_steps": 5, "seed": 7},
                                   "model": {"path": "from-file"}, "data": {"train_batch_size": 32}}))
    proc = rlx("config", "show", "--preset", "tiny", "--config", str(cfg), "--model", "from-flag",
               "trainer.seed=9")
    assert proc.returncode == 0, proc.stderr
    out = yaml.safe_load(proc.stdout)
    assert out["data"]["max_response_length"] == 4  # preset over defaults
    assert out["data"]["train_batch_size"] == 32  # file over preset
    assert out["trainer"]["total_steps"] == 5  # file over preset
    assert out["model"]["path"] == "from-flag"  # shortcut over file
    assert out["trainer"]["seed"] == 9  # override over file
    proc = rlx("config", "show", "--preset", "tiny", "--model", "from-flag", "model.path=from-override")
    assert yaml.safe_load(proc.stdout)["model"]["path"] == "from-override"  # override over shortcut


# -- user errors: one message, exit 2, no traceback ---------------------------------------------
CASES = {
    "unknown top-level key": (["trainr.seed=1"], ["trainr: unknown key", "Did you mean 'trainer'?"]),
    "unknown nested key": (["actor.optim.lrr=1"], ["actor.optim.lrr: unknown key", "Did you mean 'lr'?"]),
    "wrong type": (["data.train_batch_size=abc"], ["data.train_batch_size:", "valid integer", "'abc'"]),
    "negative batch size": (["data.train_batch_size=-4"],
                            ["data.train_batch_size:", "greater than 0", "(got -4)"]),
    "unknown plugin": (["--algorithm", "grop"],
                       ["algorithm.name: No algorithm named 'grop'", "Did you mean 'grpo'?",
                        "Valid algorithms: dapo, grpo, ppo, reinforce_plus_plus, remax, rloo"]),
    "unknown plugin option": (["rollout.temprature=0.5"],
                              ["rollout.temprature: unknown key for rollout 'hf'",
                               "Did you mean 'temperature'?"]),
    "bad plugin option value": (["algorithm.loss_agg_mode=foo"],
                                ["algorithm.loss_agg_mode: must be one of", "'token-mean'",
                                 "'seq-mean-token-sum'", "(got 'foo')"]),
    "bad plugin option range": (["algorithm.clip_ratio=-1"],
                                ["algorithm.clip_ratio: Input should be greater than 0 (got -1)"]),
    "missing data file": (["--model", "builtin:tiny-qwen2", "data.train_files=/nope.parquet"],
                          ["data.train_files: file '/nope.parquet' does not exist"]),
    "mini-batch does not divide": (["actor.ppo_mini_batch_size=5"],
                                   ["actor.ppo_mini_batch_size: 5 must divide data.train_batch_size (64)"]),
    "config file not found": (["--config", "missing.yaml"], ["--config missing.yaml: no such file"]),
    "override without =": (["actor.lr"], ["override 'actor.lr': expected KEY=VALUE"]),
    "unknown logger": (["trainer.loggers=[console,wandbx]"],
                       ["trainer.loggers: No logger named 'wandbx'", "Valid loggers:", "console", "jsonl"]),
    "bad literal": (["trainer.device=tpu"],
                    ["trainer.device: must be one of 'auto', 'cpu' or 'cuda' (got 'tpu')"]),
    "unknown preset": (["--preset", "tinny"], ["--preset tinny: no such preset.", "Did you mean 'tiny'?"]),
    "no processes": (["--nproc", "0"], ["launcher.nproc: Input should be greater than or equal to 1 (got 0)"]),
    "unknown launcher": (["--launcher", "slurmx"], ["launcher.name: No launcher named 'slurmx'"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_user_error(rlx, case):
    args, words = CASES[case]
    assert_user_error(rlx("config", "validate", *args), "Invalid configuration (1 problem)", *words)


def test_yaml_syntax_error(rlx, tmp_path):
    (tmp_path / "bad.yaml").write_text("trainer:\n  seed: 1\n  loggers: [console,\n")
    assert_user_error(rlx("config", "validate", "--config", "bad.yaml"),
                      "--config bad.yaml: not valid YAML at line")


def test_several_errors_at_once(rlx):
    err = assert_user_error(
        rlx("config", "validate", "trainr.seed=1", "rollout.temprature=0.5", "data.train_batch_size=abc"),
        "Invalid configuration (3 problems)", "trainr: unknown key", "rollout.temprature: unknown key",
        "data.train_batch_size:")
    assert "built-in preset 'tiny'" in err  # the notice is part of the one message


def test_train_reports_config_errors_before_training(rlx, tmp_path):
    assert_user_error(rlx("train", "trainr.seed=1", "--algorithm", "grop"),
                      "Invalid configuration (2 problems)", "Did you mean 'trainer'?", "Did you mean 'grpo'?")
    assert not Path(tmp_path / "outputs").exists()


def test_plugins_show_bad_kind(rlx):
    assert_user_error(rlx("plugins", "show", "grpo", "--kind", "algorith"), "Did you mean 'algorithm'?")
