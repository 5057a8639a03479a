"""`rlx plugins new reward NAME`: the generated package passes its own tests as written, and once
installed (a real wheel, pip-installed) `rlx train --reward NAME` uses it and logs its scores."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlx.cli.scaffold import write_package
from rlx.errors import UserError
from rlx.plugins.loggers.jsonl import read_metrics


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlx", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def clean_env(*paths: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLX_STRICT", "RLX_DISABLE"))}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("scaffold")
    proc = cli("plugins", "new", "reward", "exact_answer", "--out", str(out), cwd=out)
    assert proc.returncode == 0, proc.stderr
    assert "Wrote" in proc.stdout and "pyproject.toml" in proc.stdout
    return out / "rlx-reward-exact-answer"


def test_the_package_has_pyproject_module_tests_and_readme(package):
    files = sorted(str(p.relative_to(package)) for p in package.rglob("*") if p.is_file())
    assert files == ["README.md", "pyproject.toml", "rlx_reward_exact_answer/__init__.py",
                     "tests/test_exact_answer.py"]
    text = (package / "pyproject.toml").read_text()
    assert '[project.entry-points.rlx]\nexact_answer = "rlx_reward_exact_answer"' in text
    assert 'name = "rlx-reward-exact-answer"' in text


def test_the_generated_tests_pass_out_of_the_box(package):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=package,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "5 passed" in proc.stdout


def test_the_generated_code_is_lint_clean(package):
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed")
    proc = subprocess.run([ruff, "check", "--no-cache", "--select", "E,F,W,I,UP,B", str(package)],
                          capture_output=True, text=True, cwd=package)
    assert proc.returncode == 0, proc.stdout


def test_bad_requests_are_user_errors(tmp_path):
    with pytest.raises(UserError, match=r"Cannot make a plugin of kind 'rewards'. Did you mean 'reward'?"):
        write_package("rewards", "x", tmp_path)
    with pytest.raises(UserError, match="not a usable name"):
        write_package("reward", "2fast", tmp_path)
    with pytest.raises(UserError, match=r"A reward named 'gsm8k' is already installed \(from rlx\)"):
        write_package("reward", "gsm8k", tmp_path)
    with pytest.raises(UserError, match=r"entry point name 'reward_gsm8k' is already used by rlx"):
        write_package("reward", "reward_gsm8k", tmp_path)
    first = write_package("reward", "mine", tmp_path)
    with pytest.raises(UserError, match="already exists"):
        write_package("reward", "mine", tmp_path)
    (first / "README.md").write_text("changed")
    assert write_package("reward", "mine", tmp_path, force=True) == first
    assert (first / "README.md").read_text() != "changed"
    proc = cli("plugins", "new", "reward", "bad name", "--out", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2 and "not a usable name" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_installed_package_is_picked_by_rlx_train_and_its_scores_are_logged(package, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(package, src, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("rlx_reward_exact_answer-*.whl")
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True,
                   capture_output=True, timeout=300)
    env = clean_env(site)
    listed = json.loads(cli("plugins", "list", "--json", cwd=tmp_path, env=env).stdout)
    row = next(r for r in listed if (r["kind"], r["name"]) == ("reward", "exact_answer"))
    assert (row["distribution"], row["version"], row["status"]) == ("rlx-reward-exact-answer", "0.1.0", "ok")
    run_dir = tmp_path / "run"
    proc = cli("train", "--preset", "tiny", "--reward", "exact_answer", "reward.contains_score=0.25",
               "trainer.total_steps=2", "trainer.test_freq=-1", "trainer.loggers=[jsonl]",
               "trainer.save_hf_model=false", "trainer.save_freq=0", f"trainer.output_dir={run_dir}",
               cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert "reward/exact_answer/exact" in r
        assert 0.0 <= r["reward/mean"] <= 1.0 and r["reward/failed"] == 0.0
    config = (run_dir / "config.yaml").read_text()
    assert "name: exact_answer" in config and "contains_score: 0.25" in config
