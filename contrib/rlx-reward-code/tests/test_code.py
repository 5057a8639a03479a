"""Tests of the rlx-reward-code plugin, installed or straight from its source folder. Real processes run."""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlx.plugins.loggers.jsonl import read_metrics
from rlx.protocols import RewardBatch, RewardOutput
from rlx.registry import PluginManager

ROOT = Path(__file__).resolve().parents[1]

try:
    code_plugin = importlib.import_module("rlx_reward_code")
except ImportError:  # not installed: use the source folder
    sys.path.insert(0, str(ROOT))
    code_plugin = importlib.import_module("rlx_reward_code")

from rlx_reward_code.sandbox import Limits, bwrap_problem  # noqa: E402

CodeOptions = code_plugin.CodeOptions
# The behaviour tested here is the same with or without the sandbox (test_code_sandbox.py tests the sandbox).
SANDBOX = "auto" if bwrap_problem(Limits()) is None else "none"
FAST = CodeOptions(time_limit_s=3.0, workers=2, sandbox=SANDBOX)


def options(**kw) -> CodeOptions:
    return CodeOptions(sandbox=SANDBOX, **kw)


def block(code: str, lang: str = "python") -> str:
    return f"Here is my solution.\n```{lang}\n{code}\n```\nDone."


def batch(responses: list[str], truths: list) -> RewardBatch:
    n = len(responses)
    return RewardBatch(["q"] * n, responses, truths, ["code"] * n, [{}] * n, [len(r) for r in responses])


ADD_TESTS = {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]}


# -- extraction and parsing -----------------------------------------------------------------------
def test_extract_code_prefers_the_last_python_block():
    text = "```\nprint(0)\n```\n```python\nprint(1)\n```\n```py\nprint(2)\n```\n```bash\nls\n```"
    assert code_plugin.extract_code(text) == "print(2)\n"
    assert code_plugin.extract_code("```\nx = 1\n```") == "x = 1\n"
    assert code_plugin.extract_code("x = 1") is None
    assert code_plugin.extract_code("x = 1", require_block=False) == "x = 1"
    assert code_plugin.extract_code("   ", require_block=False) is None


def test_parse_tests_accepts_every_documented_form():
    assert code_plugin.parse_tests(ADD_TESTS).asserts == ADD_TESTS["tests"]
    assert code_plugin.parse_tests(json.dumps(ADD_TESTS)).asserts == ADD_TESTS["tests"]
    assert code_plugin.parse_tests({"test_list": ["assert f()"], "test_setup_code": "import os"}).asserts == [
        "import os\nassert f()"]
    humaneval = code_plugin.parse_tests({"test": "def check(c):\n    assert c(1) == 2", "entry_point": "inc"})
    assert humaneval.asserts == ["def check(c):\n    assert c(1) == 2\ncheck(inc)"]
    io = code_plugin.parse_tests({"inputs": ["1\n", "2\n"], "outputs": ["1", "4"]})
    assert io.cases == [("1\n", "1"), ("2\n", "4")]
    assert code_plugin.parse_tests("42").cases == [("", "42")]
    with pytest.raises(ValueError, match="no tests"):
        code_plugin.parse_tests({"something": 1})
    with pytest.raises(ValueError, match="2 inputs but 1 outputs"):
        code_plugin.parse_tests({"inputs": ["1", "2"], "outputs": ["1"]})


# -- running ----------------------------------------------------------------------------------------
def test_assert_tests_all_or_fraction():
    right = block("def add(a, b):\n    return a + b")
    wrong = block("def add(a, b):\n    return a - b")
    half = block("def add(a, b):\n    return a + b if a > 0 else 99")
    out = code_plugin.build(FAST, None)(batch([right, wrong, half, "no code"], [ADD_TESTS] * 4))
    assert isinstance(out, RewardOutput)
    assert out.scores == [1.0, 0.0, 0.0, 0.0]
    assert out.extra["code/pass_rate"] == pytest.approx([1.0, 0.0, 2 / 3, 0.0])
    assert out.extra["code/has_code"] == [1.0, 1.0, 1.0, 0.0]
    frac = code_plugin.build(options(mode="fraction", time_limit_s=3.0), None)(batch([half], [ADD_TESTS]))
    assert frac.scores == pytest.approx([2 / 3])


def test_stdin_stdout_cases_and_expected_output():
    prog = block("a, b = map(int, input().split())\nprint(a + b)   ")
    truth = {"inputs": ["1 2\n", "3 4\n", "5 5\n"], "outputs": ["3\n", "7", "11"]}
    out = code_plugin.build(options(mode="fraction", time_limit_s=3.0), None)(
        batch([prog, block("print(42)"), block("print(41)")], [truth, "42", "42"]))
    assert out.scores == pytest.approx([2 / 3, 1.0, 0.0])


def test_program_is_not_main_for_asserts_but_is_for_io():
    code = block("def f():\n    return 1\nif __name__ == '__main__':\n    print('main')\n    raise SystemExit(3)")
    out = code_plugin.build(FAST, None)(batch([code, code], [{"tests": ["assert f() == 1"]}, "main"]))
    assert out.scores == [1.0, 0.0]  # as a program it exits 3: a failed case even though it printed 'main'


def test_an_infinite_loop_is_killed_at_the_time_limit():
    opts = options(time_limit_s=1.0)
    start = time.perf_counter()
    out = code_plugin.build(opts, None)(batch([block("while True:\n    pass"), block("import time\ntime.sleep(60)")],
                                              [ADD_TESTS, "x"]))
    assert time.perf_counter() - start < 10
    assert out.scores == [0.0, 0.0]
    assert out.extra["code/timeout"] == [1.0, 1.0]


def test_memory_and_environment_are_limited():
    # 768 MiB against a 512 MiB limit: fails under the limit on any host, succeeds without it here.
    hog = block("x = bytearray(768 * 1024 ** 2)\ndef add(a, b):\n    return a + b")
    env = block("import os\nprint(all(k in ('HOME', 'LANG', 'PATH', 'PWD', 'TMPDIR', 'LC_CTYPE') for k in os.environ))")
    cwd = block("import os\nprint(len(os.listdir('.')))")
    out = code_plugin.build(options(time_limit_s=5.0, memory_mb=512), None)(batch(
        [hog, env, cwd], [ADD_TESTS, "True", "0"]))
    assert out.scores == [0.0, 1.0, 1.0]  # the allocation fails; the program sees only its own folder
    fits = code_plugin.build(options(time_limit_s=5.0, memory_mb=1024), None)(batch([hog], [ADD_TESTS]))
    assert fits.scores == [1.0]


def test_forged_results_do_not_count():
    """The program cannot reach the harness's result file through its working folder."""
    cheat = block("import glob, json\nfor p in glob.glob('*') + glob.glob('.*') + glob.glob('../*'):\n"
                  "    try:\n        open(p, 'a').write(json.dumps({'test': 0, 'ok': True}) + '\\n')\n"
                  "    except OSError:\n        pass\ndef add(a, b):\n    return 0")
    out = code_plugin.build(FAST, None)(batch([cheat], [{"tests": ["assert add(1, 2) == 3"]}]))
    assert out.scores == [0.0]


def test_without_site_packages_only_the_standard_library_imports():
    uses_pydantic = block("import pydantic\nprint('ok')")
    strict = code_plugin.build(FAST, None)(batch([uses_pydantic], ["ok"]))
    loose = code_plugin.build(options(time_limit_s=5.0, site_packages=True), None)(batch([uses_pydantic], ["ok"]))
    assert strict.scores == [0.0] and loose.scores == [1.0]


def test_no_temporary_folders_are_left_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    code_plugin.build(FAST, None)(batch([block("print(1)"), block("while True: pass")], ["1", "1"]))
    assert list(tmp_path.iterdir()) == []


def test_a_batch_runs_in_parallel():
    sleepy = block("import time\ntime.sleep(0.5)\nprint(1)")
    start = time.perf_counter()
    out = code_plugin.build(options(time_limit_s=5.0, workers=4), None)(batch([sleepy] * 4, ["1"] * 4))
    assert out.scores == [1.0] * 4
    assert time.perf_counter() - start < 1.9  # 4 x 0.5 s in sequence would be 2 s


# -- options and registration ------------------------------------------------------------------------
def test_options_forbid_unknown_keys_and_describe_every_field():
    with pytest.raises(ValidationError):
        CodeOptions(time_limit=3)
    with pytest.raises(ValidationError):
        CodeOptions(time_limit_s=0)
    assert all(f.description for f in CodeOptions.model_fields.values())


def test_a_row_without_tests_is_an_error_for_the_reward_policy():
    with pytest.raises(ValueError, match="no tests"):
        code_plugin.build(FAST, None)(batch([block("print(1)")], [{"nothing": True}]))


def test_registers_a_reward_named_code():
    pm = PluginManager()
    pm.register(code_plugin, name="code", distribution="rlx-reward-code", version="0.1.0")
    comp = pm.get("reward", "code")
    assert comp.distribution == "rlx-reward-code"
    assert comp.load_config_model() is CodeOptions


def test_pyproject_declares_the_rlx_entry_point():
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["rlx"] == {"code": "rlx_reward_code"}
    assert "rlx>=0.1.0,<0.2" in meta["project"]["dependencies"]  # a range of rlx releases, not any


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")
def test_children_of_a_timed_out_program_are_killed_too():
    spawner = block("import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', "
                    "'import time; time.sleep(30)'])\nimport time\ntime.sleep(30)")
    start = time.perf_counter()
    out = code_plugin.build(options(time_limit_s=1.0), None)(batch([spawner], ["x"]))
    assert out.scores == [0.0] and time.perf_counter() - start < 10


@pytest.mark.slow
def test_trains_through_rlx_when_installed(tmp_path):
    """Built as a wheel, installed, and picked by `rlx train --reward code` (responses run as programs)."""
    import shutil
    import subprocess

    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".pytest_cache"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("rlx_reward_code-*.whl")
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True,
                   capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLX_STRICT", "RLX_DISABLE"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rlx", "train", "--preset", "tiny", "--reward", "code",
         "reward.require_code_block=false", "reward.time_limit_s=2", f"reward.sandbox={SANDBOX}", "rollout.n=2",
         "trainer.total_steps=2",
         "trainer.test_freq=-1", "trainer.loggers=[jsonl]", "trainer.save_hf_model=false", "trainer.save_freq=0",
         f"trainer.output_dir={run_dir}"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["reward/code/has_code"] > 0.5 and r["reward/failed"] == 0.0 for r in rows)
    assert all("reward/code/pass_rate" in r for r in rows)


@pytest.mark.parametrize("hack", [
    # Replace exec so the tests never run.
    "import builtins\nbuiltins.exec = lambda *a, **k: None",
    # Write passing results straight into the harness's result file and drop the tests.
    "import sys, json\ng = sys._getframe(1).f_globals\n"
    "for i in range(len(g['spec']['tests'])):\n    g['result'].write(json.dumps({'test': i, 'ok': True}) + '\\n')\n"
    "g['spec']['tests'] = []",
])
def test_solutions_cannot_fake_passing_tests(hack):
    tests = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}
    score, pass_rate, *_ = code_plugin.score_one(f"```python\n{hack}\n```", tests, options())
    assert score == 0.0 and pass_rate == 0.0
