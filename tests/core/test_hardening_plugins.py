"""Faulty third-party plugins: a factory that raises or names a missing module, a config_model that is not a
pydantic model, a CLI hook that raises or adds a command typer cannot build, a lifecycle hook that raises,
an entry-point name that another distribution already uses, and RLX_DISABLE_PLUGINS naming nothing.
None of them may take down the CLI or end in a traceback; each is named with its distribution."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from rlx import Component, hookimpl
from rlx.errors import MissingDependencyError, UserError
from rlx.registry import PluginManager

FAULTS = '''
import dataclasses

from rlx import Component, hookimpl


@dataclasses.dataclass
class NotPydantic:
    x: int = 1


def build_raises(options, ctx):
    raise RuntimeError("boom at build")


@hookimpl
def rlx_rewards():
    return [
        Component(kind="reward", name="raises_at_build", factory=build_raises),
        Component(kind="reward", name="missing_module", factory="rlx_no_such_module_xyz:build"),
        Component(kind="reward", name="missing_attr", factory="rlx_hard_faults:no_such_attr"),
        Component(kind="reward", name="not_pydantic", factory=build_raises, config_model=NotPydantic),
    ]
'''
CLI_RAISES = '''
from rlx import hookimpl


@hookimpl
def rlx_cli_commands(app):
    raise RuntimeError("cli hook broken on purpose")
'''
# A module given where a function belongs: typer fails when it builds the command line, for every command.
CLI_BAD_COMMAND = '''
import math

from rlx import hookimpl


@hookimpl
def rlx_cli_commands(app):
    app.command("unbuildable")(math)
'''
CLI_GOOD = '''
import typer

from rlx import hookimpl


def hello() -> None:
    """Say hello from a plugin."""
    typer.echo("hello from a plugin")


@hookimpl
def rlx_cli_commands(app):
    app.command("hello")(hello)
'''
# Reuses the entry-point name of rlx's own gsm8k reward; importing it leaves a mark.
SHADOW = '''
import os
from pathlib import Path

Path(os.environ["RLX_TEST_SHADOW_MARK"]).write_text("imported")
'''


def write_dist(site: Path, name: str, ver: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    info = site / f"{name.replace('-', '_')}-{ver}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n")
    (info / "entry_points.txt").write_text("[rlx]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    for mod, text in modules.items():
        (site / f"{mod}.py").write_text(textwrap.dedent(text))


@pytest.fixture(scope="module")
def faulty_site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("faulty_site")
    write_dist(site, "rlx-hard-faults", "0.3.0",
               {"hard_faults": "rlx_hard_faults", "hard_cli_raises": "rlx_hard_cli_raises",
                "hard_cli_bad": "rlx_hard_cli_bad", "hard_cli_good": "rlx_hard_cli_good"},
               {"rlx_hard_faults": FAULTS, "rlx_hard_cli_raises": CLI_RAISES, "rlx_hard_cli_bad": CLI_BAD_COMMAND,
                "rlx_hard_cli_good": CLI_GOOD})
    return site


@pytest.fixture(scope="module")
def shadow_site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("shadow_site")
    write_dist(site, "rlx-shadow", "6.6.6", {"reward_gsm8k": "rlx_hard_shadow"}, {"rlx_hard_shadow": SHADOW})
    return site


def rlx_cli(site: Path, tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(site), "RLX_CACHE": str(tmp_path / "cache"), "NO_COLOR": "1",
            "COLUMNS": "200", "RLX_TEST_SHADOW_MARK": str(tmp_path / "shadow-imported"), **env}
    for name in ("RLX_STRICT_PLUGINS", "RLX_DISABLE_PLUGINS"):
        if name not in env:
            full.pop(name, None)
    return subprocess.run([sys.executable, "-m", "rlx", *args], cwd=tmp_path, env=full, capture_output=True,
                          text=True, timeout=120)


def assert_user_error(proc: subprocess.CompletedProcess, *words: str) -> str:
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stdout, err)
    assert "Traceback" not in err + proc.stdout, err
    assert err.count("Error:") == 1, err
    for w in words:
        assert w in err, f"{w!r} not in:\n{err}"
    return err


# -- the CLI survives broken plugins -----------------------------------------------------------------
def test_broken_cli_hooks_do_not_take_down_the_cli(faulty_site, tmp_path):
    proc = rlx_cli(faulty_site, tmp_path, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "hello" in proc.stdout and "Say hello from a plugin." in proc.stdout  # a good plugin's command
    assert "unbuildable" not in proc.stdout  # taken back: typer could not build it
    proc = rlx_cli(faulty_site, tmp_path, "hello")
    assert proc.returncode == 0 and proc.stdout.strip() == "hello from a plugin", proc.stderr
    proc = rlx_cli(faulty_site, tmp_path, "config", "validate")
    assert proc.returncode == 0, proc.stderr


def test_plugins_list_shows_the_broken_cli_hooks_as_failed(faulty_site, tmp_path):
    proc = rlx_cli(faulty_site, tmp_path, "plugins", "list", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout) if r["distribution"] == "rlx-hard-faults"}
    raises, bad = rows["hard_cli_raises"], rows["hard_cli_bad"]
    assert raises["status"] == "failed" and raises["version"] == "0.3.0"
    assert "rlx_cli_commands: RuntimeError: cli hook broken on purpose" in raises["summary"]
    assert bad["status"] == "failed" and bad["summary"].startswith("rlx_cli_commands: TypeError: ")
    assert rows["raises_at_build"]["status"] == "ok"  # the other plugins of the distribution still load
    proc = rlx_cli(faulty_site, tmp_path, "plugins", "list")
    assert proc.returncode == 0 and "cli hook broken on purpose" in proc.stdout, proc.stderr


def test_strict_mode_turns_a_broken_cli_hook_into_one_error(faulty_site, tmp_path):
    assert_user_error(rlx_cli(faulty_site, tmp_path, "--help", RLX_STRICT_PLUGINS="1"),
                      "Plugin 'hard_cli_raises' is broken in rlx_cli_commands: cli hook broken on purpose")


# -- component faults found while the config is checked --------------------------------------------
def test_a_factory_in_a_missing_module_is_a_config_error(faulty_site, tmp_path):
    assert_user_error(rlx_cli(faulty_site, tmp_path, "config", "validate", "--reward", "missing_module"),
                      "reward.name: reward 'missing_module' (plugin hard_faults, distribution rlx-hard-faults "
                      "0.3.0) names its factory 'rlx_no_such_module_xyz:build', but no module "
                      "'rlx_no_such_module_xyz' is installed")


def test_a_config_model_that_is_not_pydantic(faulty_site, tmp_path):
    err = assert_user_error(rlx_cli(faulty_site, tmp_path, "config", "validate", "--reward", "not_pydantic"),
                            "reward: the config_model of reward 'not_pydantic' (plugin hard_faults, distribution "
                            "rlx-hard-faults 0.3.0) must be a pydantic model class")
    assert "NotPydantic" in err
    assert_user_error(rlx_cli(faulty_site, tmp_path, "plugins", "show", "not_pydantic"),
                      "The config_model of reward 'not_pydantic'", "must be a pydantic model class")


# -- faults while a run is built and running (in process: PluginManager.build / call_lifecycle) -------
def plugin(name: str, **hooks: Callable) -> types.ModuleType:
    mod = types.ModuleType(name)
    for hook_name, fn in hooks.items():
        setattr(mod, hook_name, hookimpl(fn))
    return mod


@pytest.fixture
def loaded(faulty_site, monkeypatch) -> PluginManager:
    monkeypatch.syspath_prepend(str(faulty_site))
    monkeypatch.delenv("RLX_STRICT_PLUGINS", raising=False)
    monkeypatch.delenv("RLX_DISABLE_PLUGINS", raising=False)
    pm = PluginManager()
    pm.load_entry_points()
    yield pm
    sys.modules.pop("rlx_hard_faults", None)


def test_build_names_the_component_plugin_and_distribution_of_a_factory_that_raises(loaded):
    with pytest.raises(UserError) as info:
        loaded.build("reward", "raises_at_build", None, None)
    assert info.value.message.startswith(
        "Building reward 'raises_at_build' (plugin hard_faults, distribution rlx-hard-faults 0.3.0) failed: "
        "RuntimeError: boom at build")
    assert isinstance(info.value.__cause__, RuntimeError)


def test_build_reports_a_factory_that_cannot_be_imported(loaded):
    with pytest.raises(UserError, match=r"Cannot import the factory 'rlx_hard_faults:no_such_attr' of reward "
                                        r"'missing_attr' \(plugin hard_faults, distribution rlx-hard-faults 0\.3\.0\)"):
        loaded.build("reward", "missing_attr", None, None)
    with pytest.raises(UserError, match="ModuleNotFoundError"):
        loaded.build("reward", "missing_module", None, None)


def test_build_passes_a_plugins_own_user_error_through_and_returns_what_the_factory_built():
    def needs_package(options, ctx):
        raise MissingDependencyError("fancy", "fancy", "The fancy reward")

    pm = PluginManager()
    pm.register(plugin("p", rlx_rewards=lambda: [
        Component(kind="reward", name="fancy", factory=needs_package),
        Component(kind="reward", name="fine", factory=lambda options, ctx: ("built", options, ctx))]))
    with pytest.raises(MissingDependencyError, match="needs the Python package `fancy`"):
        pm.build("reward", "fancy", None, None)
    assert pm.build("reward", "fine", {"a": 1}, "ctx") == ("built", {"a": 1}, "ctx")


def test_a_lifecycle_hook_that_raises_names_plugin_distribution_hook_and_step():
    calls: list[str] = []
    pm = PluginManager()
    pm.register(plugin("first", rlx_on_step_end=lambda step, metrics: calls.append(f"first {step}")),
                name="first", distribution="dist-first", version="1.0")
    pm.register(plugin("broken", rlx_on_step_end=lambda step: 1 / 0), name="broken",
                distribution="dist-broken", version="2.5")
    pm.register(plugin("last", rlx_on_step_end=lambda metrics: calls.append(f"last {metrics['x']}")),
                name="last", distribution="dist-last", version="0.1")
    # pluggy calls the plugin registered last first: 'last', then 'broken', which stops the run.
    with pytest.raises(UserError) as info:
        pm.call_lifecycle("rlx_on_step_end", step=7, metrics={"x": 1.0})
    assert info.value.message.startswith("Plugin 'broken' (distribution dist-broken 2.5) failed in "
                                         "rlx_on_step_end at step 7: ZeroDivisionError: division by zero")
    assert "RLX_DISABLE_PLUGINS=broken" in str(info.value)
    assert calls == ["last 1.0"]


def test_call_lifecycle_calls_every_plugin_in_pluggys_order():
    seen: list[tuple[str, object]] = []
    pm = PluginManager()
    for name in ("a", "b", "c"):
        pm.register(plugin(name, rlx_on_checkpoint=lambda step, path, n=name: seen.append((n, step, path))),
                    name=name)
    pm.hook.rlx_on_checkpoint(step=3, path="/x")
    expected = list(seen)
    seen.clear()
    pm.call_lifecycle("rlx_on_checkpoint", step=3, path="/x")
    assert seen == expected and len(seen) == 3
    pm.call_lifecycle("rlx_on_train_start", config={}, output_dir="/x")  # no implementation: nothing to do
    with pytest.raises(ValueError, match="not a lifecycle hook"):
        pm.call_lifecycle("rlx_rewards")


# -- one entry-point name, two distributions ------------------------------------------------------------
def test_an_entry_point_name_reused_by_another_distribution_is_an_error(shadow_site, tmp_path):
    err = assert_user_error(rlx_cli(shadow_site, tmp_path, "config", "validate"),
                            "The rlx plugin entry point 'reward_gsm8k' is registered by several distributions: "
                            "rlx ", " and rlx-shadow 6.6.6.", "RLX_DISABLE_PLUGINS=<distribution name>")
    assert "Invalid configuration" not in err
    assert not (tmp_path / "shadow-imported").exists()  # neither was loaded: nothing of the newcomer ran
    proc = rlx_cli(shadow_site, tmp_path, "--help")
    assert proc.returncode == 0, proc.stderr


def test_disabling_one_distribution_resolves_the_clash(shadow_site, tmp_path):
    proc = rlx_cli(shadow_site, tmp_path, "plugins", "show", "gsm8k", RLX_DISABLE_PLUGINS="rlx-shadow")
    assert proc.returncode == 0, proc.stderr
    assert "plugin reward_gsm8k, rlx " in proc.stdout
    assert not (tmp_path / "shadow-imported").exists()


def test_strict_mode_stops_at_the_clash(shadow_site, tmp_path):
    assert_user_error(rlx_cli(shadow_site, tmp_path, "--help", RLX_STRICT_PLUGINS="1"),
                      "'reward_gsm8k' is registered by several distributions")


# -- RLX_DISABLE_PLUGINS that matches nothing ------------------------------------------------------------
def test_disabling_a_name_that_matches_nothing_warns(faulty_site, tmp_path):
    proc = rlx_cli(faulty_site, tmp_path, "plugins", "list", "--json",
                   RLX_DISABLE_PLUGINS="reward_gms8k, rlx-hard-faults ,nothing-like-it")
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("Warning:")]
    assert len(warnings) == 2, proc.stderr
    assert "RLX_DISABLE_PLUGINS names 'nothing-like-it'" in warnings[0]
    assert "RLX_DISABLE_PLUGINS names 'reward_gms8k'" in warnings[1]
    assert "Did you mean 'reward_gsm8k'?" in warnings[1]
    assert "Entry points: " in warnings[1] and "reward_gsm8k" in warnings[1] and "rlx-hard-faults" in warnings[1]
    rows = json.loads(proc.stdout)
    assert {r["status"] for r in rows if r["distribution"] == "rlx-hard-faults"} == {"disabled"}
    proc = rlx_cli(faulty_site, tmp_path, "plugins", "list", "--json", RLX_DISABLE_PLUGINS="reward_math")
    assert proc.returncode == 0 and "Warning" not in proc.stderr, proc.stderr
