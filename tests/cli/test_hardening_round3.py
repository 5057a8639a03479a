"""Hardening round 3 (issue 33): bad input to the newer commands and options, through the real ``rlx``
command where a user meets it: exit status 2, one message naming the file, key or value and what would
be accepted, no traceback; and nothing dropped or coerced without saying so."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_hardening_config import assert_user_error

NOTE = "No model, config or data given: using the built-in preset 'tiny'."


def cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "RLX_CACHE": str(tmp_path / "cache"), "NO_COLOR": "1", "COLUMNS": "200"}
    for name in ("RLX_STRICT_PLUGINS", "RLX_DISABLE_PLUGINS"):
        env.pop(name, None)
    env.update(extra)
    return env


@pytest.fixture
def rlx(tmp_path):
    def call(*args: str, env: dict[str, str] | None = None, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rlx", *args], cwd=tmp_path,
                              env={**cli_env(tmp_path, **extra), **(env or {})},
                              capture_output=True, text=True, timeout=180)

    return call


# -- plugins list and RLX_DISABLE_PLUGINS ---------------------------------------------------------------
def test_plugins_list_keeps_the_extras_of_install_hints(rlx):
    proc = rlx("plugins", "list", COLUMNS="250")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # rich may wrap a long summary
    rows = json.loads(rlx("plugins", "list", "--json").stdout)
    hints = {h for r in rows for h in ("rlx[vllm]", "rlx[sglang]", "rlx[ray]") if h in r["summary"]}
    assert hints, "no summary carries an install hint with extras any more: the test checks nothing"
    for hint in hints:
        assert hint in text, hint


def test_plugins_list_fits_an_80_column_terminal(rlx):
    proc = rlx("plugins", "list", COLUMNS="80")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    rows = json.loads(rlx("plugins", "list", "--json").stdout)
    assert max(len(line) for line in lines) <= 80
    assert len(lines) <= len(rows) + 10, len(lines)  # one line per component, a header and a footnote
    for r in rows:
        assert any(f" {r['name']} " in line for line in lines), r["name"]
    assert "rlx plugins show NAME" in proc.stdout  # where the whole summaries are


def test_disabling_a_component_by_the_name_the_list_shows(rlx):
    proc = rlx("config", "validate", "--reward", "arith", RLX_DISABLE_PLUGINS="arith")
    assert "Warning" not in proc.stderr
    assert_user_error(proc, "reward.name: The reward 'arith' is turned off: RLX_DISABLE_PLUGINS names it")
    rows = json.loads(rlx("plugins", "list", "--json", RLX_DISABLE_PLUGINS="arith").stdout)
    assert [r["status"] for r in rows if r["name"] == "arith"] == ["disabled"]
    assert [r["status"] for r in rows if r["name"] == "gsm8k" and r["kind"] == "reward"] == ["ok"]


def test_a_disabled_name_that_matches_nothing_is_warned_about_with_the_valid_names(rlx):
    proc = rlx("config", "validate", RLX_DISABLE_PLUGINS="arihtm")
    assert proc.returncode == 0, proc.stderr
    assert "RLX_DISABLE_PLUGINS names 'arihtm'" in proc.stderr and "Did you mean 'arith'?" in proc.stderr
    assert "Components: arith," in proc.stderr and "reward_arith" in proc.stderr


# -- the [dev] extra: the README's test command tests what the README lists -------------------------------
ENGINES = {"vllm", "sglang", "ray", "megatron", "mbridge", "triton"}  # optional: big, or GPU-bound (triton: the
# GPU kernels' compiler; CI runs their tests under its interpreter in a step of its own)


def _requires(dist: str) -> list[str]:
    """The requirements of ``dist``: rlx's from this checkout's pyproject.toml, the others' from the installed
    metadata."""
    from importlib.metadata import PackageNotFoundError, requires

    if dist == "rlx":
        tomllib = pytest.importorskip("tomllib")
        project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
        return list(project["dependencies"]) + [f"{r}; extra == {extra!r}" for extra, reqs in
                                                project["optional-dependencies"].items() for r in reqs]
    try:
        return requires(dist) or []
    except PackageNotFoundError:
        return []


def _closure(dist: str, extras: set[str], seen: set[tuple[str, frozenset[str]]]) -> None:
    """Every distribution that installing ``dist[extras]`` brings."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    key = canonicalize_name(dist)
    if (key, frozenset(extras)) in seen:
        return
    seen.add((key, frozenset(extras)))
    reqs = _requires(dist)
    for text in reqs:
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras | {""}):
            _closure(req.name, set(req.extras), seen)


def test_the_dev_extra_brings_every_package_the_tests_skip_without_but_the_engines():
    from importlib.metadata import packages_distributions

    from packaging.utils import canonicalize_name

    wanted = set()
    for path in Path(__file__).parents[1].rglob("test_*.py"):
        wanted |= {m.split(".")[0] for m in re.findall(r"importorskip\([\"']([\w.]+)[\"']", path.read_text())}
    wanted -= set(sys.stdlib_module_names) | ENGINES
    assert {"peft", "matplotlib", "tensorboard", "wandb", "mlflow"} <= wanted  # the test sees what it guards
    seen: set[tuple[str, frozenset[str]]] = set()
    _closure("rlx", {"dev"}, seen)
    brought = {name for name, _ in seen}
    owners = packages_distributions()
    missing = {m for m in wanted if not {canonicalize_name(d) for d in owners.get(m, [])} & brought}
    assert not missing, f"tests skip without {sorted(missing)}, which `pip install -e '.[dev]'` does not install"


# -- from-verl: values of the wrong kind, files that are not text --------------------------------------
VERL = "python3 -m verl.trainer.main_ppo actor_rollout_ref.model.path=/m data.train_files=/d.parquet"


@pytest.mark.parametrize("value", ["abc", "[1,2]", "0", "1.5"])
@pytest.mark.parametrize("key", ["trainer.nnodes", "trainer.n_gpus_per_node"])
def test_from_verl_refuses_a_gpu_count_that_is_not_a_whole_number(rlx, key, value):
    proc = rlx("config", "from-verl", f"{VERL} {key}={value}")
    assert_user_error(proc, key, "whole number")


def test_from_verl_names_a_warmup_ratio_that_is_not_a_fraction(rlx):
    proc = rlx("config", "from-verl", f"{VERL} trainer.total_training_steps=100 "
               "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=abc")
    assert_user_error(proc, "lr_warmup_steps_ratio", "not a fraction between 0 and 1")


def test_from_verl_refuses_a_binary_file_named_yaml(rlx, tmp_path):
    (tmp_path / "run.yaml").write_bytes(bytes(range(256)) * 4)
    assert_user_error(rlx("config", "from-verl", str(tmp_path / "run.yaml")), "run.yaml", "not a text file")


@pytest.mark.parametrize("command", [("config", "from-verl"), ("train", "--from-verl")])
def test_from_verl_names_the_verl_key_of_a_value_rlx_refuses(rlx, command):
    proc = rlx(*command, f"{VERL} actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=abc "
               "actor_rollout_ref.rollout.n=two")
    err = assert_user_error(proc, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu='abc' "
                                  "(rlx's actor.micro_batch_size_per_device)",
                            "actor_rollout_ref.rollout.n='two' (rlx's rollout.n)")
    assert "valid integer" in err
