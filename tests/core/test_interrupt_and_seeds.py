"""A run stopped by Ctrl-C or SIGTERM says where it stopped and how to go on; each rollout engine of a
pool samples with its own seed; `--config` says that it replaces the preset."""

from __future__ import annotations

import os
import pickle
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from rlx.context import BuildContext
from rlx.plugins.loggers.jsonl import read_metrics
from rlx.plugins.rollout import sglang as sglang_plugin
from rlx.plugins.rollout import vllm as vllm_plugin
from rlx.protocols import RunInfo
from rlx.run import checkpoint

# The default job, made short to start: no validation, no final Hugging Face copy.
FAST = ["trainer.test_freq=-1", "trainer.save_hf_model=false", "trainer.log_samples=0"]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


# A shell that starts a command in the background without job control (`pytest ... &` in a script, nohup, some
# CI runners) starts it with SIGINT ignored; children inherit that, and it survives exec, so Python installs no
# Ctrl-C handler and `rlx train` goes on through SIGINT (as a background job should: the run had to be killed
# after the 60 s wait, in full-suite runs started so). The run here starts as a terminal's foreground job does,
# SIGINT at its default, whatever the disposition pytest itself got.
_DEFAULT_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                   "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def _stop_after(run: Path, rows: int, sig: int, *args: str) -> subprocess.CompletedProcess[str]:
    """`rlx train ARGS` sent ``sig`` once ``rows`` steps are in its metrics.jsonl."""
    cmd = [sys.executable, "-m", "rlx", "train", *args]
    proc = subprocess.Popen([sys.executable, "-c", _DEFAULT_SIGINT, *cmd[1:]], cwd=run.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if (run / "metrics.jsonl").is_file() and len(read_metrics(run)) >= rows:
                break
            time.sleep(0.1)
        assert proc.poll() is None, "the run ended before it was interrupted"
        proc.send_signal(sig)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"`rlx train` did not stop within 60 s of {signal.Signals(sig).name}; it logged "
                        f"{len(read_metrics(run))} steps; its stderr ends:\n{err[-3000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_ctrl_c_names_the_last_checkpoint_and_the_command_that_resumes_from_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    stopped = _stop_after(run, 3, signal.SIGINT, "trainer.total_steps=200", "trainer.save_freq=2", *FAST,
                          f"trainer.output_dir={run}")
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    done = read_metrics(run)[-1]["step"]
    assert f"Training interrupted (Ctrl-C) at step {done}/200." in stopped.stderr
    # The console says the run stopped, not that it is done.
    assert f"stopped at step {done}/200" in stopped.stdout and "done:" not in stopped.stdout
    last = checkpoint.latest(run / "checkpoints")
    assert last is not None and f"Last complete checkpoint: {last} (step " in stopped.stderr
    lines = stopped.stderr.splitlines()
    command = lines[lines.index("To resume from it:") + 1].strip()
    args = shlex.split(command)
    assert args[:4] == ["python", "-m", "rlx", "train"] and args[-1] == "--resume", command
    assert f"trainer.output_dir={run}" in args and "trainer.save_freq=2" in args
    # The printed command, run for two steps past the checkpoint (total_steps may change on resume).
    step = checkpoint.read_state(last)["step"]
    args = [sys.executable, *args[1:]]
    args[args.index("trainer.total_steps=200")] = f"trainer.total_steps={step + 2}"
    resumed = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resuming from {last} (step {step})." in resumed.stdout
    assert f"done: step {step + 2}/{step + 2}" in resumed.stdout
    assert checkpoint.latest(run / "checkpoints").name == f"global_step_{step + 2}"
    assert {r["step"] for r in read_metrics(run, dedupe=True)} == set(range(1, step + 3))


def test_sigterm_before_any_checkpoint_says_a_restart_begins_from_scratch(tmp_path: Path) -> None:
    run = tmp_path / "run"
    stopped = _stop_after(run, 1, signal.SIGTERM, "trainer.total_steps=200", "trainer.save_freq=-1", *FAST,
                          f"trainer.output_dir={run}", "trainer.resume=auto")
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    assert "Training interrupted by SIGTERM at step " in stopped.stderr
    assert "No checkpoint yet" in stopped.stderr and "starts from scratch" in stopped.stderr
    assert "stopped at step " in stopped.stdout and "done:" not in stopped.stdout
    command = stopped.stderr.splitlines()[-1].strip()
    assert "--resume" not in command and "trainer.resume=" not in command, command
    assert command.startswith("python -m rlx train trainer.total_steps=200 "), command
    assert not checkpoint.list_complete(run / "checkpoints")


# -- one seed per engine of a pool -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ctx(rlx_cache: str) -> BuildContext:
    from rlx.registry import get_plugin_manager
    from rlx.run.models import load_tokenizer
    from rlx.validate import load_config

    resolved = load_config(get_plugin_manager(), preset="tiny", overrides=["trainer.seed=7"])
    cfg = resolved.config
    from rlx.run.data import resolve_path

    tokenizer = load_tokenizer(resolve_path(cfg.model.path), False)
    return BuildContext(cfg, RunInfo(str(cfg.run_dir()), "rlx", "t", {}), None, tokenizer)


@pytest.mark.parametrize("plugin", [vllm_plugin, sglang_plugin], ids=["vllm", "sglang"])
@pytest.mark.parametrize("train,rollout", [(1, 2), (2, 0), (3, 3)], ids=["pool", "colocated", "3+3"])
def test_each_engine_of_a_rollout_pool_samples_with_its_own_seed(ctx: BuildContext, plugin: ModuleType,
                                                                 train: int, rollout: int) -> None:
    """The launcher builds the rollout role on each rank of its pool with ``build(pool rank, pool size)``
    (the trainer's builder, pickled as it is to a worker process); the engine's seed is trainer.seed plus
    that rank. (vLLM and SGLang are optional: the engines' arguments are checked, not the engines.)"""
    from functools import partial

    from rlx.plugins.launchers._process import Host, Layout
    from rlx.trainer import _call_factory

    options = plugin.VLLMRolloutOptions() if plugin is vllm_plugin else plugin.SGLangRolloutOptions()
    builder = pickle.loads(pickle.dumps(partial(_call_factory, plugin.engine_arguments, options, ctx, "engine")))
    layout = Layout(train, rollout)
    seeds = []
    for rank in layout.ranks("rollout"):
        host = Host(rank, layout, control=None)
        host.execute(("build", "rollout", builder), None)
        seeds.append(host.roles["rollout"]["seed"])
    assert seeds == [7 + r for r in range(rollout or train)]
    # Built alone (the driver's rank 0), the engine takes trainer.seed itself.
    assert plugin.engine_arguments(options, ctx)["seed"] == 7


# -- --config replaces the preset, and says so -----------------------------------------------------------
def test_config_file_says_it_replaces_the_preset_and_the_error_names_it(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("algorithm:\n  name: rloo\n")

    def rlx(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "rlx", *args, f"trainer.output_dir={tmp_path / 'r'}"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120, env=_env())

    alone = rlx("train", "--config", str(cfg))
    assert alone.returncode == 2 and "Traceback" not in alone.stderr, alone.stderr
    err = alone.stderr
    assert "--config replaces the built-in preset 'tiny'" in err and "Add --preset tiny" in err
    assert "--preset tiny" in err.split("model.path: no model given")[1]
    assert "--preset tiny" in err.split("data.train_files: no training data given")[1]
    with_preset = rlx("train", "--config", str(cfg), "--preset", "tiny", "trainer.total_steps=0")
    assert with_preset.returncode == 2 and "trainer.total_steps" in with_preset.stderr  # stops before training
    assert "replaces the built-in preset" not in with_preset.stderr
