"""The run configuration in-process: source layering, override parsing, error messages with paths."""

from __future__ import annotations

import pytest
import yaml

from rlx.config import RLXConfig, build_raw, dotted_path, load_yaml, parse_override, parse_value, validate
from rlx.errors import ConfigError
from rlx.registry import get_plugin_manager
from rlx.validate import load_config, resolve


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


def write(path, data) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def problems_of(raw, pm, **kw) -> list[str]:
    with pytest.raises(ConfigError) as info:
        resolve(raw, pm, **kw)
    return info.value.problems


# -- layering: defaults < preset < file < shortcut < override ----------------------------------
def test_preset_beats_defaults():
    assert RLXConfig().data.train_batch_size == 32
    cfg = validate(build_raw(preset="tiny"))
    assert cfg.data.train_batch_size == 64
    assert cfg.model.path == "builtin:tiny-qwen2"
    assert cfg.data.max_response_length == 4


def test_a_preset_of_the_other_trainer_is_named_as_such():
    """rm_* presets belong to `rlx rm train`; the others to `rlx train`: each command says so for the other's."""
    from rlx.config import preset_names

    assert "tiny" in preset_names() and "rm_tiny" not in preset_names()
    assert preset_names("rm") == ["rm_tiny"]
    with pytest.raises(ConfigError, match=r"rm_tiny is a preset of `rlx rm train`, not of `rlx train`\. "
                                          r"Presets of `rlx train`: tiny"):
        build_raw(preset="rm_tiny")
    with pytest.raises(ConfigError, match=r"tiny is a preset of `rlx train`, not of `rlx rm train`"):
        build_raw(preset="tiny", preset_family="rm")
    assert build_raw(preset="rm_tiny", preset_family="rm")["rm"]


def test_file_beats_preset(tmp_path):
    f = write(tmp_path / "c.yaml", {"trainer": {"total_steps": 5}, "rollout": {"n": 2}})
    cfg = validate(build_raw(preset="tiny", config_file=f))
    assert cfg.trainer.total_steps == 5
    assert cfg.rollout.n == 2
    assert cfg.trainer.test_freq == 20  # untouched keys of the preset stay (deep merge)
    assert cfg.rollout.name == "hf"


def test_shortcut_beats_file(tmp_path):
    f = write(tmp_path / "c.yaml", {"model": {"path": "from-file"}, "reward": {"name": "arith"}})
    raw = build_raw(preset="tiny", config_file=f, shortcuts={"model": "from-flag", "reward": "gsm8k",
                                                             "algorithm": None})
    cfg = validate(raw)
    assert cfg.model.path == "from-flag"
    assert cfg.reward.name == "gsm8k"
    assert cfg.algorithm.name == "grpo"  # a flag left out (None) changes nothing


def test_override_beats_shortcut(tmp_path):
    f = write(tmp_path / "c.yaml", {"model": {"path": "from-file"}})
    raw = build_raw(preset="tiny", config_file=f, shortcuts={"model": "from-flag", "reward": "gsm8k"},
                    overrides=["model.path=from-override", "reward.name=arith"])
    cfg = validate(raw)
    assert cfg.model.path == "from-override"
    assert cfg.reward.name == "arith"


def test_later_override_wins():
    cfg = validate(build_raw(preset="tiny", overrides=["trainer.seed=1", "trainer.seed=2"]))
    assert cfg.trainer.seed == 2


# -- override values ----------------------------------------------------------------------------
def test_override_value_types():
    key, lr = parse_override("actor.optim.lr=1e-6")
    assert key == "actor.optim.lr"
    assert isinstance(lr, float) and lr == 1e-06
    assert parse_override("trainer.loggers=[console,jsonl]") == ("trainer.loggers", ["console", "jsonl"])
    assert parse_override("data.shuffle=false") == ("data.shuffle", False)
    assert parse_override("data.train_batch_size=64") == ("data.train_batch_size", 64)
    assert parse_override("+trainer.experiment=exp1") == ("trainer.experiment", "exp1")
    assert parse_override("trainer.total_steps=null") == ("trainer.total_steps", None)
    assert parse_value("1E-3") == 1e-3
    assert parse_value("") == ""


def test_override_types_survive_validation():
    cfg = validate(build_raw(preset="tiny", overrides=[
        "actor.optim.lr=1e-6", "trainer.loggers=[console,jsonl]", "data.shuffle=false",
        "trainer.experiment=2024", "data.train_files=a.parquet"]))
    assert cfg.actor.optim.lr == 1e-06
    assert cfg.trainer.loggers == ["console", "jsonl"]
    assert cfg.data.shuffle is False
    assert cfg.trainer.experiment == "2024"  # a number given for a name is kept as text
    assert cfg.data.train_files == ["a.parquet"]  # one file is a list of one


def test_comma_separated_loggers():
    cfg = validate(build_raw(overrides=["trainer.loggers=console,jsonl"]))
    assert cfg.trainer.loggers == ["console", "jsonl"]


@pytest.mark.parametrize(("text", "words"), [
    ("actor.lr", ["expected KEY=VALUE"]),
    ("=4", ["key before '=' is empty"]),
    ("actor..lr=3", ["empty part"]),
    ("trainer.loggers=[console,", ["trainer.loggers", "not a valid YAML list"]),
])
def test_bad_overrides(text, words):
    with pytest.raises(ConfigError) as info:
        build_raw(overrides=[text])
    for w in words:
        assert w in info.value.message


def test_all_bad_overrides_reported_together():
    with pytest.raises(ConfigError) as info:
        build_raw(overrides=["a", "b", "c=1"])
    assert len(info.value.problems) == 2


# -- YAML files ------------------------------------------------------------------------------------
def test_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  seed: [1,\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+"):
        load_yaml(bad)
    with pytest.raises(ConfigError, match="no such file"):
        load_yaml(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="is a folder"):
        load_yaml(tmp_path)
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_yaml(lst)


def test_empty_yaml_section_sets_nothing(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("trainer:\nmodel:\n  path: m\n")
    cfg = validate(build_raw(preset="tiny", config_file=str(f)))
    assert cfg.trainer.total_steps == 120
    assert cfg.model.path == "m"


# -- error messages ------------------------------------------------------------------------------
def test_dotted_path():
    assert dotted_path(["trainer", "loggers", 1]) == "trainer.loggers[1]"
    assert dotted_path([]) == ""


def test_core_errors_have_paths_and_values():
    with pytest.raises(ConfigError) as info:
        validate(build_raw(preset="tiny", overrides=[
            "trainr.seed=1", "actor.optim.lrr=1", "data.train_batch_size=-4", "trainer.device=tpu"]))
    text = info.value.message
    assert "trainr: unknown key. Did you mean 'trainer'?" in text
    assert "actor.optim.lrr: unknown key. Did you mean 'lr'?" in text
    assert "data.train_batch_size: Input should be greater than 0 (got -4)" in text
    assert "trainer.device: must be one of 'auto', 'cpu' or 'cuda' (got 'tpu')" in text
    assert len(info.value.problems) == 4


def test_tuple_too_short():
    with pytest.raises(ConfigError, match=r"actor\.optim\.betas: too few items"):
        validate(build_raw(overrides=["actor.optim.betas=[0.9]"]))


def test_mini_batch_must_divide():
    with pytest.raises(ConfigError) as info:
        validate(build_raw(preset="tiny", overrides=["actor.ppo_mini_batch_size=5"]))
    assert info.value.problems == ["actor.ppo_mini_batch_size: 5 must divide data.train_batch_size (64)."]


def test_plugin_option_errors_have_dotted_paths(pm):
    raw = build_raw(preset="tiny", overrides=[
        "algorithm.clip_ratio=-1", "algorithm.loss_agg_mode=foo", "rollout.temprature=0.5",
        "loggers.console.every=0"])
    problems = problems_of(raw, pm, check_files=False)
    assert "algorithm.clip_ratio: Input should be greater than 0 (got -1)" in problems
    assert any(p.startswith("algorithm.loss_agg_mode: must be one of 'token-mean'") and "(got 'foo')" in p
               for p in problems)
    assert any(p.startswith("rollout.temprature: unknown key for rollout 'hf'. Did you mean 'temperature'?")
               for p in problems)
    assert any(p.startswith("loggers.console.every:") for p in problems)
    assert len(problems) == 4


def test_a_required_plugin_option_says_what_it_is_and_how_to_set_it(pm):
    """`--reward custom` without reward.path: not a bare "Field required" but the option's help and the
    override that gives it."""
    raw = build_raw(preset="tiny", shortcuts={"reward": "custom"})
    problems = problems_of(raw, pm, check_files=False)
    assert problems == ["reward.path: Field required: set reward.path=... (The Python file that defines the "
                        "reward function.)"]


def test_a_message_that_quotes_the_value_does_not_repeat_it(pm):
    raw = build_raw(preset="tiny", shortcuts={"reward": "custom"}, overrides=["reward.path=nothere.py"])
    problems = problems_of(raw, pm, check_files=False)
    assert problems == ["reward.path: no such file: 'nothere.py'"]


def test_unknown_plugin_and_logger(pm):
    raw = build_raw(preset="tiny", shortcuts={"algorithm": "grop"}, overrides=["trainer.loggers=[console,wandbx]"])
    problems = problems_of(raw, pm, check_files=False)
    assert any(p.startswith("algorithm.name: No algorithm named 'grop'. Did you mean 'grpo'?")
               and "Valid algorithms: dapo, grpo, ppo, reinforce_plus_plus, remax, rloo" in p for p in problems)
    assert any(p.startswith("trainer.loggers: No logger named 'wandbx'") and "console, jsonl" in p
               for p in problems)


def test_logger_options_need_the_logger_on(pm):
    raw = build_raw(preset="tiny", overrides=["loggers.swanlab.mode=offline"])
    problems = problems_of(raw, pm, check_files=False)
    assert problems == ["loggers.swanlab: options for a logger that is not on; add it to trainer.loggers "
                        "(now ['console', 'jsonl'])"]


def test_plugin_problems_reported_even_when_core_is_invalid(pm):
    # No preset: the rollout section has no name in the raw dict; its default plugin is checked.
    raw = build_raw(overrides=["model.path=m", "trainr.seed=1", "rollout.temprature=0.5",
                               "trainer.loggers=[wandbx]", "data.train_files=/nope.parquet"])
    problems = problems_of(raw, pm)
    assert [p.split(":", 1)[0] for p in problems] == [
        "trainr", "rollout.temprature", "trainer.loggers", "data.train_files"]


def test_missing_model_and_data(pm):
    problems = problems_of({}, pm)
    assert any(p.startswith("model.path: no model given") for p in problems)
    assert any(p.startswith("data.train_files: no training data given") for p in problems)


def test_tiny_preset_is_valid_and_fills_plugin_defaults(pm, tmp_path, monkeypatch):
    monkeypatch.setenv("RLX_CACHE", str(tmp_path / "cache"))
    resolved = load_config(pm, preset="tiny")
    out = resolved.as_dict()
    assert out["algorithm"]["clip_ratio"] == 0.2
    assert out["algorithm"]["kl_loss_coef"] == 0.1  # from the preset
    assert out["rollout"]["n"] == 8
    assert "console" in out["loggers"] and "jsonl" in out["loggers"]
    assert not (tmp_path / "cache").exists()  # builtin: data is not written just to validate
