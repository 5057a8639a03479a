"""Hardening round 3 (issue 33), the options and warnings: through the real ``rlx`` command, an option that
cannot work here (flash attention on the CPU, a component whose optional package is missing), a number
where module names belong, a text option whose value looks like a number, and the warnings a run prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel
from test_hardening_config import assert_user_error

from rlx import hookimpl
from rlx.components import Component
from rlx.config import build_raw, validate
from rlx.registry import PluginManager, Requirement, missing_requirements, requirements
from rlx.validate import load_config


@pytest.fixture
def rlx(tmp_path, rlx_cache):
    """``rlx ARGS`` in ``tmp_path`` with the session's cache of built-in resources (``env``: more variables)."""
    def call(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        full = {**os.environ, "RLX_CACHE": rlx_cache, "NO_COLOR": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1",
                **(env or {})}
        for name in ("RLX_STRICT_PLUGINS", "RLX_DISABLE_PLUGINS"):
            full.pop(name, None)
        return subprocess.run([sys.executable, "-m", "rlx", *args], cwd=tmp_path, env=full, capture_output=True,
                              text=True, timeout=180)

    return call


def shadow(tmp_path: Path, module: str) -> dict[str, str]:
    """PYTHONPATH with a package ``module`` whose import fails, as when it is not installed."""
    folder = tmp_path / "shadow" / module
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(f"raise ImportError(\"No module named '{module}'\")\n")
    return {"PYTHONPATH": str(folder.parent)}


def hidden(tmp_path: Path, module: str) -> dict[str, str]:
    """PYTHONPATH with a sitecustomize that hides the installed ``module`` from the process (a None entry in
    sys.modules: find_spec says it is not there and importing it fails), as when it is not installed."""
    folder = tmp_path / "hide"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(f"import sys\nsys.modules[{module!r}] = None\n")
    return {"PYTHONPATH": str(folder)}


# -- 1. flash attention where it cannot load --------------------------------------------------------------
@pytest.mark.parametrize("command", ["config validate", "train"])
def test_flash_attention_on_the_cpu_is_a_config_error(rlx, tmp_path, command):
    proc = rlx(*command.split(), "backend.attn_implementation=flash_attention_2", "trainer.device=cpu",
               f"trainer.output_dir={tmp_path / 'run'}")
    err = assert_user_error(proc, "backend.attn_implementation=flash_attention_2 needs the flash-attn package and "
                            "a CUDA GPU", "trainer.device is cpu", "backend.attn_implementation=sdpa")
    assert "ImportError" not in err
    assert not (tmp_path / "run").exists()


# -- 2. a number where module names belong ----------------------------------------------------------------
@pytest.mark.parametrize(("value", "words"), [
    ("model.target_modules=5", ["model.target_modules: give all-linear or a non-empty list of module names",
                                "(got 5)"]),
    ("model.target_modules=[q_proj,7]", ["model.target_modules:", "7 is not a module name"]),
    ("model.exclude_modules=5", ["model.exclude_modules: give a list of module names"]),
])
def test_module_names_refuse_numbers(rlx, value, words):
    assert_user_error(rlx("config", "validate", "model.lora_rank=4", value), "Invalid configuration", *words)


def test_module_names_given_as_one_name_or_a_comma_list():
    """One name (or names and commas) means a list of names; all-linear stays the keyword."""
    for text, want in (("q_proj", ["q_proj"]), ("q_proj, v_proj", ["q_proj", "v_proj"]),
                       ("all-linear", "all-linear"), ("[q_proj]", ["q_proj"])):
        cfg = validate(build_raw(preset="tiny", overrides=[f"model.target_modules={text}"]))
        assert cfg.model.target_modules == want, text


# -- 3. text options keep the text as typed --------------------------------------------------------------
def test_text_options_keep_numbers_as_typed(rlx):
    proc = rlx("config", "show", "trainer.experiment=010", "trainer.project=2024-01-01", "reward.name=format",
               "reward.style=regex", "reward.pattern=7", "trainer.loggers=[console,tensorboard]",
               "loggers.tensorboard.logdir=2024",
               "trainer.total_steps=3", "actor.optim.lr=1e-5", "trainer.val_before_train=yes")
    assert proc.returncode == 0, proc.stderr
    shown = yaml.safe_load(proc.stdout)
    assert shown["trainer"]["experiment"] == "010"  # not 8, YAML's octal
    assert shown["trainer"]["project"] == "2024-01-01"  # not a date
    assert shown["reward"]["pattern"] == "7"  # a plugin's option: was "Input should be a valid string"
    assert shown["loggers"]["tensorboard"]["logdir"] == "2024"  # a logger's option
    assert shown["trainer"]["total_steps"] == 3 and shown["actor"]["optim"]["lr"] == 1e-5  # numbers stay numbers
    assert shown["trainer"]["val_before_train"] is True


def test_text_rule_follows_the_plugin_named_last_and_keeps_yaml_elsewhere():
    pm = PluginManager()
    pm.load_entry_points()
    raw = build_raw(preset="tiny", overrides=["reward.pattern=7", "reward.style=regex", "reward.name=format",
                                              "trainer.experiment=null", "model.tokenizer_path=null",
                                              "trainer.experiment='5'", "reward.score=7"], pm=pm)
    assert raw["reward"]["pattern"] == "7" and raw["reward"]["score"] == 7  # the format reward's str and float
    assert raw["trainer"]["experiment"] == "5"  # quoted: YAML's string
    assert raw["model"]["tokenizer_path"] is None  # null still means None
    raw = build_raw(overrides=["reward.pattern=7"], pm=pm)  # the default reward has no such option: as YAML
    assert raw["reward"]["pattern"] == 7


def test_a_list_for_a_text_option_is_still_refused(rlx):
    assert_user_error(rlx("config", "validate", "trainer.experiment=[1,2]"),
                      "trainer.experiment: Input should be a valid string")


# -- 4. a component whose optional package is missing ---------------------------------------------------
def test_megatron_without_megatron_core_is_reported_by_validate(rlx, tmp_path):
    proc = rlx("config", "validate", "--backend", "megatron", f"trainer.output_dir={tmp_path / 'run'}",
               env=shadow(tmp_path, "megatron"))
    assert_user_error(proc, "backend.name: backend 'megatron' needs the Python package `megatron-core`",
                      "pip install 'rlx[megatron]'")
    assert "Config is valid" not in proc.stdout


def test_a_logger_without_its_package_is_reported_by_validate(rlx, tmp_path):
    proc = rlx("config", "validate", "trainer.loggers=[console,wandb]", f"trainer.output_dir={tmp_path / 'run'}",
               env=hidden(tmp_path, "wandb"))
    assert_user_error(proc, "trainer.loggers: logger 'wandb' needs the Python package `wandb`",
                      "pip install 'rlx[wandb]'", "take it off trainer.loggers")


def test_a_requirement_of_one_option_value_is_checked_for_that_value_only(rlx, tmp_path):
    env = hidden(tmp_path, "math_verify")
    proc = rlx("config", "validate", "--reward", "math", "reward.backend=math_verify",
               f"trainer.output_dir={tmp_path / 'run'}", env=env)
    assert_user_error(proc, "reward.name: reward 'math' with reward.backend=math_verify needs the Python package "
                      "`math-verify`", "pip install 'rlx[math]'", "change reward.backend")
    proc = rlx("config", "validate", "--reward", "math", f"trainer.output_dir={tmp_path / 'run'}", env=env)
    assert proc.returncode == 0, proc.stderr  # auto: the built-in check when math-verify is missing


def test_config_show_shows_a_config_whose_package_is_missing(rlx, tmp_path):
    proc = rlx("config", "show", "--backend", "megatron", env=shadow(tmp_path, "megatron"))
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["backend"]["name"] == "megatron"


class _NoOptions(BaseModel):
    pass


class _Fancy:
    """A third-party logger that declares the package it needs."""

    @hookimpl
    def rlx_loggers(self) -> list[Component]:
        need = Requirement("rlx_no_such_module", "fancy-logs", "pip install fancy-logs")
        return [Component(kind="logger", name="fancy", factory=lambda o, c: None, config_model=_NoOptions,
                          extra={"requires": [need]})]


def test_every_component_with_an_optional_package_is_checked_the_same_way(tmp_path):
    pm = PluginManager()
    pm.load_entry_points()
    pm.register(_Fancy(), name="fancy", distribution="fancy-dist", version="1")
    # rlx's own components that need more than rlx's dependencies, each with the extra that installs it
    own = {(c.kind, c.name): requirements(c) for c in pm.components().values() if requirements(c)}
    assert set(own) == {("backend", "megatron"), ("rollout", "vllm"), ("rollout", "sglang"), ("launcher", "ray"),
                        ("logger", "swanlab"), ("logger", "wandb"), ("logger", "tensorboard"),
                        ("logger", "mlflow"), ("reward", "math"), ("logger", "fancy")}
    for (_, name), reqs in own.items():
        if name != "fancy":
            assert all(f"rlx[{name}]" in r.install for r in reqs), name
    assert [r.package for r in missing_requirements(pm.get("logger", "fancy"))] == ["fancy-logs"]
    with pytest.raises(Exception) as info:
        load_config(pm, preset="tiny", overrides=["trainer.loggers=[console,fancy]",
                                                  f"trainer.output_dir={tmp_path / 'run'}"])
    assert "logger 'fancy' needs the Python package `fancy-logs`" in str(info.value)
    assert "pip install fancy-logs" in str(info.value)


# -- 5. warnings: one line each, no library noise -------------------------------------------------------------
def test_a_lora_run_prints_rlx_warnings_as_one_line_and_no_library_noise(rlx, tmp_path):
    # The think format is never met by the tiny model: every group's rewards are equal, which rlx warns about.
    proc = rlx("train", "model.lora_rank=4", "--reward", "format", "reward.style=think", "trainer.total_steps=1",
               "trainer.test_freq=-1", "trainer.loggers=[jsonl]", "trainer.save_hf_model=false",
               f"trainer.output_dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "FutureWarning" not in err and "is_gradient_checkpointing" not in err  # peft's call into transformers
    lines = [line for line in err.splitlines() if "same reward" in line]
    assert len(lines) == 1 and lines[0].startswith("Warning: every prompt's responses got the same reward"), err
    assert "UserWarning" not in err and "warnings.warn" not in err and ".py:" not in err, err
