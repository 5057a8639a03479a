"""The plugin machinery: the plugin manager, entry-point loading, the ``rlx plugins`` CLI and a real
third-party plugin (contrib/rlx-reward-length) built, installed, trained with and uninstalled."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import types
from collections.abc import Callable
from importlib.metadata import version as dist_version
from pathlib import Path

import pluggy
import pytest

from rlx import Component, hookimpl
from rlx.errors import UserError
from rlx.plugins.loggers.jsonl import read_metrics
from rlx.registry import PluginManager

REPO = Path(__file__).resolve().parents[2]
CONTRIB_LENGTH = REPO / "contrib" / "rlx-reward-length"
RLX_VERSION = dist_version("rlx")
BUILTINS = [("backend", "torch"), ("rollout", "hf"), ("algorithm", "grpo"), ("reward", "gsm8k"),
            ("logger", "console"), ("logger", "jsonl"), ("logger", "swanlab")]
TORCH_IMPORT = re.compile(r"\|\s+torch(\.|$)")  # the module column of `python -X importtime`


@pytest.fixture(autouse=True)
def _no_plugin_env(monkeypatch):
    monkeypatch.delenv("RLX_STRICT_PLUGINS", raising=False)
    monkeypatch.delenv("RLX_DISABLE_PLUGINS", raising=False)


def _build(options, ctx):
    return lambda batch: [0.0] * len(batch)


def plugin(name: str, **hooks: Callable) -> types.ModuleType:
    """A plugin module made on the fly, with each keyword a hook implementation."""
    mod = types.ModuleType(name)
    for hook_name, fn in hooks.items():
        setattr(mod, hook_name, hookimpl(fn))
    return mod


def provides(kind: str, *names: str) -> Callable[[], list[Component]]:
    return lambda: [Component(kind=kind, name=n, factory=_build, summary=f"test {n}") for n in names]


# ---------------------------------------------------------------------------------------------
# The plugin manager, with plugins registered directly
def test_get_by_kind_and_name_fills_in_the_origin():
    pm = PluginManager()
    pm.register(plugin("p_rewards", rlx_rewards=provides("reward", "alpha", "beta")),
                name="p_rewards", distribution="dist-a", version="1.0")
    pm.register(plugin("p_loggers", rlx_loggers=provides("logger", "alpha")), name="p_loggers",
                distribution="dist-b", version="2.0")
    comp = pm.get("reward", "alpha")
    assert (comp.kind, comp.name, comp.plugin, comp.distribution, comp.version) == (
        "reward", "alpha", "p_rewards", "dist-a", "1.0")
    assert pm.get("logger", "alpha").distribution == "dist-b"  # same name, other kind: no clash
    assert pm.names("reward") == ["alpha", "beta"]
    assert {c.kind for c in pm.find("alpha")} == {"reward", "logger"}
    assert comp.load_factory() is _build
    assert [(p.name, p.status, p.hooks) for p in pm.plugins] == [
        ("p_rewards", "ok", ["rlx_rewards"]), ("p_loggers", "ok", ["rlx_loggers"])]
    with pytest.raises(ValueError, match="unknown component kind"):
        pm.get("rewards", "alpha")


def test_string_references_are_imported_only_when_used():
    pm = PluginManager()
    pm.register(plugin("lazy", rlx_rewards=lambda: [Component(
        kind="reward", name="lazy", factory="rlx.errors:did_you_mean", config_model="rlx.config:RewardConfig")]))
    comp = pm.get("reward", "lazy")
    from rlx.config import RewardConfig
    from rlx.errors import did_you_mean

    assert comp.factory == "rlx.errors:did_you_mean"
    assert comp.load_factory() is did_you_mean
    assert comp.load_config_model() is RewardConfig


def test_unknown_name_lists_valid_names_and_suggests_one():
    pm = PluginManager()
    pm.register(plugin("p", rlx_rewards=provides("reward", "length", "gsm8k")))
    with pytest.raises(UserError) as info:
        pm.get("reward", "lenght")
    msg = str(info.value)
    assert "No reward named 'lenght'" in msg
    assert "Did you mean 'length'?" in msg
    assert "Valid rewards: gsm8k, length" in msg
    assert "rlx plugins list" in msg  # the hint
    with pytest.raises(UserError, match=r"Valid loggers: \(none installed\)"):
        pm.get("logger", "console")


def test_duplicate_names_name_both_distributions():
    pm = PluginManager()
    pm.register(plugin("first", rlx_rewards=provides("reward", "same")), name="first",
                distribution="dist-one", version="0.1")
    pm.register(plugin("second", rlx_rewards=provides("reward", "same")), name="second",
                distribution="dist-two", version="0.2")
    with pytest.raises(UserError) as info:
        pm.get("reward", "same")
    msg = str(info.value)
    assert "dist-one 0.1" in msg and "dist-two 0.2" in msg
    assert "RLX_DISABLE_PLUGINS" in msg


def test_registration_hook_with_a_wrong_record_kind_marks_the_plugin_failed():
    pm = PluginManager()
    pm.register(plugin("good", rlx_rewards=provides("reward", "fine")), name="good")
    pm.register(plugin("wrong_kind", rlx_rewards=provides("logger", "misfiled")), name="wrong_kind")
    pm.register(plugin("not_a_record", rlx_rewards=lambda: [{"kind": "reward", "name": "dict"}]),
                name="not_a_record")
    pm.register(plugin("raises", rlx_loggers=lambda: 1 / 0), name="raises")
    assert pm.names("reward") == ["fine"]
    assert pm.names("logger") == []
    status = {p.name: (p.status, p.error) for p in pm.plugins}
    assert status["good"] == ("ok", "")
    assert status["wrong_kind"][0] == "failed" and "kind 'reward'" in status["wrong_kind"][1]
    assert status["not_a_record"][0] == "failed" and "Component records" in status["not_a_record"][1]
    assert status["raises"][0] == "failed" and "ZeroDivisionError" in status["raises"][1]


def test_wrong_record_kind_is_fatal_in_strict_mode(monkeypatch):
    monkeypatch.setenv("RLX_STRICT_PLUGINS", "1")
    pm = PluginManager()
    pm.register(plugin("wrong_kind", rlx_rewards=provides("logger", "misfiled")), name="wrong_kind")
    with pytest.raises(UserError, match="wrong_kind"):
        pm.components()


def test_hookimpl_for_an_unknown_hook_is_rejected():
    pm = PluginManager()
    with pytest.raises(pluggy.PluginValidationError, match="unknown hook 'rlx_reward'"):
        pm.register(plugin("typo", rlx_reward=provides("reward", "x")), name="typo")


def test_hookimpl_with_an_unknown_argument_is_rejected():
    pm = PluginManager()
    with pytest.raises(pluggy.PluginValidationError, match="config"):
        pm.register(plugin("bad_args", rlx_rewards=lambda config: []), name="bad_args")


def test_a_rejected_plugin_does_not_break_later_plugins():
    pm = PluginManager()
    with pytest.raises(pluggy.PluginValidationError):
        pm.register(plugin("typo", rlx_reward=provides("reward", "x")), name="typo")
    pm.register(plugin("good", rlx_rewards=provides("reward", "fine")), name="good")
    assert pm.names("reward") == ["fine"]


# ---------------------------------------------------------------------------------------------
# Entry points of fake installed distributions
GOOD_MODULE = '''
"""A light third-party plugin: a reward given by "module:attr" strings."""
from pydantic import BaseModel, ConfigDict, Field

from rlx import Component, hookimpl


class FakeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bonus: float = Field(0.5, description="Score of every response.")


def build(options, ctx):
    return lambda batch: [options.bonus] * len(batch)


@hookimpl
def rlx_rewards():
    return [Component(kind="reward", name="fake_reward", factory="rlx_test_fake_good:build",
                      config_model="rlx_test_fake_good:FakeOptions", summary="A fake reward.")]
'''
BROKEN_MODULE = 'raise RuntimeError("fake plugin broken on purpose")\n'
TYPO_MODULE = '''
from rlx import hookimpl


@hookimpl
def rlx_reward():
    return []
'''
FAKE_MODULES = ("rlx_test_fake_good", "rlx_test_fake_broken", "rlx_test_fake_typo")


def write_dist(site: Path, name: str, ver: str, entry_points: dict[str, str]) -> None:
    info = site / f"{name.replace('-', '_')}-{ver}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[rlx]\n{lines}")


@pytest.fixture(scope="module")
def fake_site(tmp_path_factory) -> Path:
    """A folder that looks like site-packages with two third-party rlx plugin distributions."""
    site = tmp_path_factory.mktemp("fake_site")
    write_dist(site, "rlx-fake-good", "1.2.3", {"fake_good": "rlx_test_fake_good"})
    write_dist(site, "rlx-fake-broken", "0.0.1",
               {"fake_broken": "rlx_test_fake_broken", "fake_typo": "rlx_test_fake_typo"})
    (site / "rlx_test_fake_good.py").write_text(textwrap.dedent(GOOD_MODULE))
    (site / "rlx_test_fake_broken.py").write_text(BROKEN_MODULE)
    (site / "rlx_test_fake_typo.py").write_text(textwrap.dedent(TYPO_MODULE))
    return site


@pytest.fixture
def on_path(fake_site, monkeypatch) -> Path:
    monkeypatch.syspath_prepend(str(fake_site))
    yield fake_site
    for mod in FAKE_MODULES:
        sys.modules.pop(mod, None)


def records(pm: PluginManager) -> dict[str, object]:
    return {p.name: p for p in pm.plugins}


def test_entry_points_load_third_party_and_builtin_plugins(on_path):
    pm = PluginManager()
    pm.load_entry_points()
    recs = records(pm)
    good = recs["fake_good"]
    assert (good.distribution, good.version, good.status, good.hooks) == (
        "rlx-fake-good", "1.2.3", "ok", ["rlx_rewards"])
    comp = pm.get("reward", "fake_reward")
    assert (comp.distribution, comp.version, comp.plugin) == ("rlx-fake-good", "1.2.3", "fake_good")
    assert comp.load_config_model()().bonus == 0.5
    for kind, name in BUILTINS:
        builtin = pm.get(kind, name)
        assert (builtin.distribution, builtin.version) == ("rlx", RLX_VERSION), (kind, name)


def test_a_plugin_failing_to_import_is_recorded_and_the_rest_still_load(on_path):
    pm = PluginManager()
    pm.load_entry_points()
    recs = records(pm)
    broken = recs["fake_broken"]
    assert (broken.distribution, broken.version, broken.status) == ("rlx-fake-broken", "0.0.1", "failed")
    assert "RuntimeError: fake plugin broken on purpose" in broken.error
    assert "rlx_test_fake_broken.py" in broken.error  # where it failed
    typo = recs["fake_typo"]
    assert typo.status == "failed" and "unknown hook 'rlx_reward'" in typo.error
    assert not pm.pm.has_plugin("fake_typo")
    assert all(recs[n].status == "ok" for n in recs if n not in ("fake_broken", "fake_typo"))
    assert {("reward", "fake_reward"), *BUILTINS} <= set(pm.components())
    with pytest.raises(UserError, match="Some plugins failed to load: fake_broken, fake_typo"):
        pm.get("reward", "nope")
    # The message itself (all a config problem shows) names them with their errors, the one asked for first.
    with pytest.raises(UserError) as info:
        pm.get("reward", "fake_typo")
    assert "Plugins that failed to load (one may provide it): fake_typo (" in info.value.message
    assert "fake_broken (rlx-fake-broken 0.0.1: RuntimeError: fake plugin broken on purpose" in info.value.message


def test_strict_mode_makes_a_failing_plugin_fatal(on_path, monkeypatch):
    monkeypatch.setenv("RLX_STRICT_PLUGINS", "1")
    with pytest.raises(UserError) as info:
        PluginManager().load_entry_points()
    assert "'fake_broken' from distribution rlx-fake-broken 0.0.1 failed to load" in info.value.message
    assert "RLX_STRICT_PLUGINS" in info.value.hint


def test_disabled_plugins_are_recorded_and_absent(on_path, monkeypatch):
    monkeypatch.setenv("RLX_DISABLE_PLUGINS", "fake_good, reward_gsm8k")
    pm = PluginManager()
    pm.load_entry_points()
    recs = records(pm)
    assert recs["fake_good"].status == "disabled" and recs["reward_gsm8k"].status == "disabled"
    assert "rlx_test_fake_good" not in sys.modules
    assert "fake_reward" not in pm.names("reward")
    assert "gsm8k" not in pm.names("reward")
    assert "arith" in pm.names("reward")


def test_disabling_a_distribution_disables_all_its_entry_points(on_path, monkeypatch):
    monkeypatch.setenv("RLX_DISABLE_PLUGINS", "rlx-fake-broken")
    pm = PluginManager()
    pm.load_entry_points(strict=True)  # nothing left that fails
    recs = records(pm)
    assert recs["fake_broken"].status == recs["fake_typo"].status == "disabled"
    assert recs["fake_good"].status == "ok"


# ---------------------------------------------------------------------------------------------
# The CLI, in a subprocess
def cli_env(*paths: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLX_")}
    parts = [str(p) for p in paths] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.update(extra)
    return env


def rlx_cli(*args: str, env: dict[str, str], cwd: Path, py_flags: tuple[str, ...] = (),
            timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *py_flags, "-m", "rlx", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def list_json(env: dict[str, str], cwd: Path) -> list[dict]:
    res = rlx_cli("plugins", "list", "--json", env=env, cwd=cwd)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_cli_plugins_list_json(fake_site, tmp_path):
    rows = list_json(cli_env(fake_site), tmp_path)
    by_key = {(r["kind"], r["name"]): r for r in rows}
    for key in BUILTINS:
        assert by_key[key]["distribution"] == "rlx" and by_key[key]["version"] == RLX_VERSION, key
        assert by_key[key]["status"] == "ok"
    fake = by_key[("reward", "fake_reward")]
    assert (fake["distribution"], fake["version"], fake["status"]) == ("rlx-fake-good", "1.2.3", "ok")
    broken = next(r for r in rows if r["name"] == "fake_broken")
    assert (broken["distribution"], broken["status"]) == ("rlx-fake-broken", "failed")
    assert "fake plugin broken on purpose" in broken["summary"]


def test_cli_plugins_list_table_shows_a_failed_plugin(fake_site, tmp_path):
    res = rlx_cli("plugins", "list", env=cli_env(fake_site, COLUMNS="200"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "fake_broken" in res.stdout and "failed" in res.stdout and "grpo" in res.stdout


def test_cli_strict_mode_fails_with_one_paragraph(fake_site, tmp_path):
    res = rlx_cli("plugins", "list", env=cli_env(fake_site, RLX_STRICT_PLUGINS="1"), cwd=tmp_path)
    assert res.returncode == 2
    assert "Error: Plugin 'fake_broken' from distribution rlx-fake-broken" in res.stderr
    assert "Traceback" not in res.stderr


def test_cli_plugins_show_prints_options_with_defaults(tmp_path):
    res = rlx_cli("plugins", "show", "grpo", env=cli_env(), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    pm = PluginManager()
    pm.load_entry_points()
    model = pm.get("algorithm", "grpo").load_config_model()
    assert len(model.model_fields) > 3
    for name, field in model.model_fields.items():
        default = field.get_default(call_default_factory=True)
        assert re.search(rf"^\s+{name}: .* = {re.escape(repr(default))}$", res.stdout, re.M), name
    assert "algorithm.KEY=VALUE" in res.stdout


def test_cli_plugins_show_unknown_name(tmp_path):
    res = rlx_cli("plugins", "show", "grp", env=cli_env(), cwd=tmp_path)
    assert res.returncode == 2
    assert "No component named 'grp'. Did you mean 'grpo'?" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("args", [("plugins", "list"), ("--help",)], ids=["plugins-list", "help"])
def test_cli_stays_light(args, tmp_path, capsys):
    env = cli_env()
    res = rlx_cli(*args, env=env, cwd=tmp_path, py_flags=("-X", "importtime"))
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert any(re.search(r"\|\s+rlx\.cli\.main$", line) for line in lines)  # the check sees rlx's imports
    heavy = [line for line in lines if TORCH_IMPORT.search(line)]
    assert not heavy, "\n".join(heavy[:5])
    start = time.perf_counter()
    res = rlx_cli(*args, env=env, cwd=tmp_path)
    seconds = time.perf_counter() - start
    assert res.returncode == 0, res.stderr
    with capsys.disabled():
        print(f"\n  `rlx {' '.join(args)}` took {seconds:.2f} s", end="")
    assert seconds < 3.0


# ---------------------------------------------------------------------------------------------
# A real third-party plugin: build, install, train, uninstall
@pytest.mark.slow
def test_contrib_length_plugin_end_to_end(tmp_path):
    # Build the wheel from a copy, so the source folder gets no build/ or egg-info.
    src = tmp_path / "src"
    shutil.copytree(CONTRIB_LENGTH, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("rlx_reward_length-*.whl")
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)

    installed = cli_env(site, RLX_CACHE=str(tmp_path / "cache"))
    rows = list_json(installed, tmp_path)
    length = next(r for r in rows if (r["kind"], r["name"]) == ("reward", "length"))
    assert (length["distribution"], length["version"], length["status"]) == ("rlx-reward-length", "0.1.0", "ok")

    run_dir = tmp_path / "run"
    train = ["train", "--preset", "tiny", "reward.name=length", "reward.target_tokens=2", "reward.tolerance=1",
             "trainer.total_steps=2", "trainer.test_freq=-1", f"trainer.output_dir={run_dir}",
             "trainer.loggers=[jsonl]"]
    start = time.perf_counter()
    res = rlx_cli(*train, env=installed, cwd=tmp_path, timeout=600)
    seconds = time.perf_counter() - start
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = read_metrics(run_dir)
    assert len(metrics) == 2
    assert all("reward/mean" in m and "reward/length/in_range" in m for m in metrics)
    assert all(0.0 <= m["reward/mean"] <= 1.0 for m in metrics)
    print(f"2-step training with the length reward took {seconds:.1f} s")

    # "Uninstall": the same environment without the target folder.
    uninstalled = cli_env(RLX_CACHE=str(tmp_path / "cache"))
    assert "length" not in {r["name"] for r in list_json(uninstalled, tmp_path)}
    res = rlx_cli(*train, env=uninstalled, cwd=tmp_path, timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "No reward named 'length'" in res.stderr
    assert re.search(r"Valid rewards: .*arith.*gsm8k", res.stderr)
    assert "Traceback" not in res.stderr
