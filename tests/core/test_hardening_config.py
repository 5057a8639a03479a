"""Config values that used to pass validation and then fail inside torch, the run folder, and what a new
user trips over (several --config files, --resume, the built-in preset's note, model.dtype, torch threads).
Each user error goes through the real ``rlx`` command: exit status 2, one message, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from rlx.config import RLXConfig, build_raw, resolve_dtype, validate
from rlx.errors import ConfigError
from rlx.validate import check_output_dir, output_dir_problems

NOTE = "No model, config or data given: using the built-in preset 'tiny'."


def cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "RLX_CACHE": str(tmp_path / "cache"), "NO_COLOR": "1", "COLUMNS": "200", **extra}
    for name in ("RLX_STRICT_PLUGINS", "RLX_DISABLE_PLUGINS"):
        env.pop(name, None)
    return env


@pytest.fixture
def rlx(tmp_path):
    def call(*args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rlx", *args], cwd=tmp_path, env=cli_env(tmp_path),
                              capture_output=True, text=True, timeout=120, **kw)

    return call


def assert_user_error(proc: subprocess.CompletedProcess, *words: str) -> str:
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stdout, err)
    assert "Traceback" not in err + proc.stdout, err
    assert err.count("Error:") == 1, err
    for w in words:
        assert w in err, f"{w!r} not in:\n{err}"
    return err


# -- values torch would choke on --------------------------------------------------------------------
RANGE_CASES = {
    "betas out of [0, 1)": (["actor.optim.betas=[1.5,-2]"],
                            ["actor.optim.betas[0]: Input should be less than 1 (got 1.5)",
                             "actor.optim.betas[1]: Input should be greater than or equal to 0 (got -2)"]),
    "beta of exactly 1": (["critic.optim.betas=[0.9,1.0]"], ["critic.optim.betas[1]: Input should be less than 1"]),
    "lr inf": (["actor.optim.lr=.inf"], ["actor.optim.lr: Input should be a finite number"]),
    "lr nan": (["actor.optim.lr=nan"], ["actor.optim.lr: Input should be a finite number"]),
    "lr 1e308": (["actor.optim.lr=1e308"], ["actor.optim.lr: Input should be less than or equal to 1 (got 1e+308)"]),
    "critic lr 1e308": (["critic.optim.lr=1e308"], ["critic.optim.lr: Input should be less than or equal to 1"]),
    "weight decay huge": (["actor.optim.weight_decay=1e30"], ["actor.optim.weight_decay: Input should be less"]),
    "rollout.n beyond int64": (["rollout.n=100000000000000000000"],
                               ["rollout.n: Input should be less than or equal to 65536"]),
    "response length huge": (["data.max_response_length=1000000000000"],
                             ["data.max_response_length: Input should be less than or equal to 1048576"]),
    "micro batch huge": (["actor.micro_batch_size_per_device=99999999999999999999"],
                         ["actor.micro_batch_size_per_device: Input should be less than or equal to 1048576"]),
    "critic epochs huge": (["critic.ppo_epochs=100000"], ["critic.ppo_epochs: Input should be less than or equal"]),
    "save_freq -5": (["trainer.save_freq=-5"], ["trainer.save_freq: Input should be greater than or equal to -1"]),
    "test_freq -5": (["trainer.test_freq=-5"], ["trainer.test_freq: Input should be greater than or equal to -1"]),
    "temperature too small": (["rollout.temperature=1e-9"],
                              ["rollout.temperature: must be 0 (greedy) or at least 0.001"]),
    "temperature inf": (["rollout.val_temperature=.inf"], ["rollout.val_temperature: Input should be a finite"]),
    "reward timeout 1e20": (["reward.timeout_s=1e20"], ["reward.timeout_s: Input should be less than or equal"]),
    "failure score nan": (["reward.failure_score=nan"], ["reward.failure_score: Input should be a finite"]),
    "negative seed": (["trainer.seed=-1"], ["trainer.seed: Input should be greater than or equal to 0"]),
}


@pytest.mark.parametrize("case", list(RANGE_CASES))
def test_values_that_torch_rejects_are_config_errors(rlx, case):
    args, words = RANGE_CASES[case]
    assert_user_error(rlx("config", "validate", *args), "Invalid configuration", *words)


def _numeric_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, type]]:
    """Every int and float field of the core config, by dotted path (``int | None`` counts as int)."""
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)] if typing.get_origin(ann) else [ann]
        if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            out.extend(_numeric_fields(args[0], f"{prefix}{name}."))
        elif len(args) == 1 and args[0] in (int, float):
            out.append((f"{prefix}{name}", args[0]))
    return out


def test_every_numeric_option_is_bounded_and_finite():
    """A new numeric option without bounds would let 1e30 or inf through to torch again."""
    fields = _numeric_fields(RLXConfig)
    paths = {path for path, _ in fields}  # the walk reaches every section, nested ones too
    assert {"data.train_batch_size", "actor.optim.lr", "critic.optim.betas", "critic.cliprange_value", "rollout.n",
            "reward.timeout_s", "trainer.seed"} - {"critic.optim.betas"} <= paths, paths
    for path, kind in fields:
        bad = [10**30, -(10**30)] if kind is int else [float("inf"), float("nan"), float("-inf")]
        for value in bad:
            with pytest.raises(ConfigError) as info:
                validate(build_raw(preset="tiny", overrides=[f"{path}={value}"]))
            assert any(p.startswith(f"{path}:") for p in info.value.problems), (path, value, info.value.problems)


def test_values_at_the_documented_bounds_are_accepted():
    cfg = validate(build_raw(preset="tiny", overrides=[
        "actor.optim.lr=1", "actor.optim.betas=[0,0.999999]", "rollout.n=65536", "trainer.save_freq=-1",
        "trainer.test_freq=0", "rollout.temperature=0", "rollout.val_temperature=0.001", "trainer.seed=4294967295"]))
    assert cfg.actor.optim.lr == 1.0 and cfg.rollout.n == 65536 and cfg.trainer.seed == 2**32 - 1


# -- names and the run folder ---------------------------------------------------------------------
NAME_CASES = {
    "experiment climbing out": (["trainer.experiment=../../x"],
                                ["trainer.experiment: must be one folder name, without '/'"]),
    "project with a slash": (["trainer.project=a/b"], ["trainer.project: must be one folder name"]),
    "project of dots": (["trainer.project=.."], ["trainer.project: must not be made only of dots"]),
    "experiment '.'": (["trainer.experiment=."], ["trainer.experiment: must not be made only of dots"]),
    "control character": (["trainer.experiment=a\x1bb"], ["trainer.experiment: must not contain control characters"]),
    "unknown placeholder": (["trainer.output_dir=out/{projet}"],
                            ["trainer.output_dir: unknown placeholder {projet}", "{project}, {experiment}"]),
    "stray brace": (["trainer.output_dir=out/{project"], ["trainer.output_dir:", "a literal brace is written {{"]),
    "format spec": (["trainer.output_dir=out/{experiment:>9}"],
                    ["trainer.output_dir: unknown placeholder {experiment:>9}"]),
}


@pytest.mark.parametrize("case", list(NAME_CASES))
def test_bad_names_and_placeholders(rlx, case):
    args, words = NAME_CASES[case]
    assert_user_error(rlx("config", "show", *args), "Invalid configuration (1 problem)", *words)


def test_literal_braces_and_dotted_names_are_fine():
    cfg = validate(build_raw(preset="tiny", overrides=[
        "trainer.output_dir=runs/{{x}}/{project}-{experiment}", "trainer.project=.hidden-but-fine",
        "trainer.experiment=v1.2..3"]))
    assert cfg.run_dir() == Path("runs/{x}/.hidden-but-fine-v1.2..3")


def test_run_folder_that_is_a_file(rlx, tmp_path):
    (tmp_path / "taken").write_text("x")
    assert_user_error(rlx("config", "validate", "trainer.output_dir=taken"),
                      f"trainer.output_dir: the run folder {tmp_path / 'taken'} is a file, not a folder")
    assert_user_error(rlx("config", "validate", "trainer.output_dir=taken/{experiment}"),
                      f"cannot be created: {tmp_path / 'taken'} is a file")


@pytest.mark.parametrize("where", ["/proc/rlx-run", "/sys/kernel/{experiment}"])
def test_run_folder_under_a_kernel_file_system(rlx, where):
    assert_user_error(rlx("config", "validate", f"trainer.output_dir={where}"),
                      "a virtual file system of the kernel")


def test_train_checks_the_run_folder_before_loading_a_model(rlx, tmp_path):
    (tmp_path / "taken").write_text("x")
    assert_user_error(rlx("train", "trainer.output_dir=taken"), "is a file, not a folder")
    assert not (tmp_path / "cache").exists()  # the built-in model was never written, let alone loaded


AS_USER = """
import os, sys
from rlx.cli.main import run


def rlx(*args):
    try:
        run(list(args))
    except SystemExit as e:
        return e.code


rlx('config', 'validate')  # as root: every module the check needs is imported now
if os.geteuid() == 0:  # root may write anywhere: check as the unprivileged user `nobody`
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
sys.exit(rlx('config', 'validate', sys.argv[1]))
"""


def test_run_folder_not_writable(tmp_path):
    base = Path("/tmp") / f"rlx-ro-{os.getpid()}-{tmp_path.name}"  # a folder `nobody` can reach
    base.mkdir()
    try:
        base.chmod(0o755)
        (base / "ro").mkdir()
        (base / "ro").chmod(0o555)
        (base / "open").mkdir()
        (base / "open").chmod(0o777)

        def check(output_dir: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-c", AS_USER, f"trainer.output_dir={output_dir}"], cwd=base,
                                  env=cli_env(tmp_path), capture_output=True, text=True, timeout=120)

        proc = check(f"{base}/ro/run")
        assert proc.stderr.count(NOTE) == 2  # the run as root, then the one that fails
        assert_user_error(proc, f"cannot be created: {base}/ro is not writable by this user")
        assert_user_error(check(f"{base}/ro"), f"the run folder {base}/ro is not writable by this user")
        proc = check(f"{base}/open/run")
        assert proc.returncode == 0, proc.stderr
    finally:
        (base / "ro").chmod(0o755)
        for p in sorted(base.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        base.rmdir()


def test_check_output_dir_accepts_a_new_folder_and_creates_nothing(tmp_path):
    cfg = validate(build_raw(preset="tiny", overrides=[f"trainer.output_dir={tmp_path}/a/b/{{experiment}}"]))
    assert output_dir_problems(cfg) == []
    check_output_dir(cfg)
    assert not (tmp_path / "a").exists()
    (tmp_path / "a").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        check_output_dir(cfg)


# -- several config files -----------------------------------------------------------------------------
def test_several_config_files_merge_in_order(rlx, tmp_path):
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({"trainer": {"seed": 1, "total_steps": 7},
                                                     "rollout": {"n": 4}}))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump({"trainer": {"seed": 2}, "model": {"path": "m"}}))
    proc = rlx("config", "show", "--preset", "tiny", "--config", "a.yaml", "-c", "b.yaml")
    assert proc.returncode == 0, proc.stderr
    out = yaml.safe_load(proc.stdout)
    assert out["trainer"]["seed"] == 2  # the later file wins
    assert out["trainer"]["total_steps"] == 7 and out["rollout"]["n"] == 4  # the earlier file's other keys stay
    assert out["model"]["path"] == "m"
    assert out["data"]["max_response_length"] == 4  # the preset below both


def test_every_bad_config_file_is_reported(rlx):
    assert_user_error(rlx("config", "validate", "--config", "one.yaml", "--config", "two.yaml"),
                      "Invalid configuration (2 problems)", "--config one.yaml: no such file",
                      "--config two.yaml: no such file")


def test_config_help_says_it_replaces_the_preset_and_resume_is_a_flag(rlx):
    proc = rlx("train", "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "Repeat it to merge several in order" in text
    assert "replaces the built-in preset" in text
    resume = next(line for line in proc.stdout.splitlines() if "--resume" in line)
    assert "<bool>" not in resume and "Continue from the last complete" in resume
    err = assert_user_error(rlx("train", "--resume", "true"), "--resume is a flag and takes no value")
    assert "KEY=VALUE" not in err


# -- the built-in preset's note -------------------------------------------------------------------
def test_note_for_a_bare_command_only(rlx):
    proc = rlx("config", "validate")
    assert proc.returncode == 0 and NOTE in proc.stderr, proc.stderr
    for args in (["--reward", "arith"], ["--algorithm", "rloo"], ["--backend", "torch"]):
        proc = rlx("config", "validate", *args)
        assert proc.returncode == 0, proc.stderr
        assert "built-in preset" not in proc.stderr, (args, proc.stderr)


def test_note_never_follows_an_error(rlx):
    err = assert_user_error(rlx("config", "validate", "trainr.seed=1"), "trainr: unknown key")
    assert err.index(NOTE) < err.index("Error:")
    err = assert_user_error(rlx("config", "validate", "--algorithm", "grop"), "No algorithm named 'grop'")
    assert "built-in preset" not in err


# -- model.dtype ------------------------------------------------------------------------------------------
def test_dtype_auto_is_the_default_and_resolves_by_device(rlx):
    assert RLXConfig().model.dtype == "auto"
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    assert resolve_dtype("auto", "cuda:1") == "bfloat16"
    assert resolve_dtype("float16", "cpu") == "float16"
    with pytest.raises(ValueError, match="not 'auto'"):
        resolve_dtype("auto", "auto")
    assert_user_error(rlx("config", "validate", "model.dtype=int8"), "model.dtype: must be one of 'auto'")


# -- torch threads --------------------------------------------------------------------------------------
THREADS = """
import os, sys
from rlx.cli.main import run
try:
    run(['config', 'validate'])
except SystemExit as e:
    assert e.code in (0, None), e.code
assert 'torch' not in sys.modules
import torch
print(os.environ.get('OMP_NUM_THREADS'), torch.get_num_threads(), len(os.sched_getaffinity(0)))
"""


def test_cli_gives_torch_half_the_cores_unless_told(tmp_path):
    env = cli_env(tmp_path)
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run([sys.executable, "-c", THREADS], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    var, threads, cores = proc.stdout.split()[-3:]
    assert var == str(max(1, int(cores) // 2)) and int(threads) == int(var)
    env["OMP_NUM_THREADS"] = cores  # the user's choice stays, here every core
    proc = subprocess.run([sys.executable, "-c", THREADS], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-3:-1] == [cores, cores]


@pytest.mark.parametrize("model_path", ["rlx.plugins.algorithms.base:AlgorithmOptions",
                                        "rlx.plugins.algorithms.base:KLControlOptions",
                                        "rlx.plugins.rollout.hf:HFRolloutOptions",
                                        "rlx.plugins.backends.torch_local:TorchBackendOptions"])
def test_built_in_plugin_options_are_bounded_and_finite(model_path):
    """The same rule for the numeric options of rlx's own plugins (algorithm.kl_loss_coef=inf must not
    reach a loss)."""
    import importlib

    from pydantic import ValidationError

    module, name = model_path.split(":")
    model = getattr(importlib.import_module(module), name)
    fields = _numeric_fields(model)
    assert fields
    for path, kind in fields:
        bad = [10**30, -(10**30)] if kind is int else [float("inf"), float("nan"), float("-inf")]
        for value in bad:
            raw: dict = {}
            node = raw
            *parents, leaf = path.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
            with pytest.raises(ValidationError):
                model.model_validate(raw)
