"""End-to-end runs of the training loop on the built-in tiny model (real model, real data files)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlx.plugins.loggers.jsonl import read_metrics
from rlx.run import checkpoint

pytestmark = pytest.mark.slow


def rlx(*args: str, cwd: Path, timeout: int = 600, threads: int | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if threads:  # CPU kernels may sum in another order under load with several threads
        env["OMP_NUM_THREADS"] = str(threads)
    return subprocess.run([sys.executable, "-m", "rlx", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def metrics(run: Path) -> list[dict]:
    return read_metrics(run)


@pytest.mark.learning
def test_default_job_learns(tmp_path: Path) -> None:
    """`rlx train` with no arguments: the built-in GRPO job runs its 120 steps and learns for real.

    Greedy exact-match accuracy starts at chance (0.02 measured) and ended at 0.88-1.00 on seeds 1-5 of
    two machines (docs/benchmarks.md; seed 1, the default, 0.98 and 1.00); the training reward (exact
    match) rose from about 0.10 to 0.87-0.98. The thresholds sit far below those and far above chance.
    This run is also the learning test of grpo (tests/e2e/test_algorithms_learn.py covers the others).
    """
    result = rlx("train", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "built-in preset 'tiny'" in result.stderr
    run = tmp_path / "outputs" / "rlx" / "tiny-grpo"
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(0, 121))  # step 0: validation before training
    train = [r for r in rows if "reward/mean" in r]
    rewards = [r["reward/mean"] for r in train]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    acc = {r["step"]: r["val/acc"] for r in rows if "val/acc" in r}
    print(f"accuracy {acc}, reward first 5 steps {first:.3f}, last 10 steps {last:.3f}")
    assert sorted(acc) == [0, 20, 40, 60, 80, 100, 120] and acc[120] >= 0.6, acc  # chance: test_algorithms_learn
    assert acc[0] <= 0.2, acc  # before training: chance (0.02 measured)
    assert last >= first + 0.4, (first, last)
    assert "val acc" in result.stdout  # validation is shown on the console, next to the reward
    assert result.stdout.splitlines()[0].startswith("step 0/120 | val acc ")  # before the first step
    for key in ("reward/std", "response_length/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy",
                "actor/pg_clipfrac", "actor/grad_norm", "actor/lr", "timing/gen", "timing/update_actor",
                "perf/tokens_per_second", "perf/throughput", "perf/time_share/gen", "perf/time_share/update_actor"):
        assert key in rows[-1], key
    assert "val/reward/mean" in rows[-1]
    assert "step 120/120" in result.stdout
    assert checkpoint.latest(run / "checkpoints").name == "global_step_120"
    assert (run / "hf_model" / "config.json").is_file()
    assert (run / "config.yaml").is_file()


TINY = ["--preset", "tiny", "trainer.test_freq=-1", "trainer.loggers=[jsonl]", "trainer.save_hf_model=false"]


def test_resume_continues_exactly(tmp_path: Path) -> None:
    """Stopping after 4 steps and resuming to 6 gives the same steps 5-6 as one run of 6 steps."""
    straight = tmp_path / "straight"
    assert rlx("train", *TINY, "trainer.total_steps=6", f"trainer.output_dir={straight}",
               cwd=tmp_path, threads=1).returncode == 0
    split = tmp_path / "split"
    first = rlx("train", *TINY, "trainer.total_steps=4", "trainer.save_freq=2", f"trainer.output_dir={split}",
                cwd=tmp_path, threads=1)
    assert first.returncode == 0, first.stderr[-2000:]
    assert [p.name for p in checkpoint.list_complete(split / "checkpoints")] == ["global_step_2", "global_step_4"]
    second = rlx("train", *TINY, "--resume", "trainer.total_steps=6", f"trainer.output_dir={split}", cwd=tmp_path,
                 threads=1)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "Resuming from" in second.stdout
    a = {r["step"]: r for r in metrics(straight)}
    b = {r["step"]: r for r in metrics(split)}
    assert sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in (5, 6):
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-7), (step, key)


def test_resume_without_checkpoint_and_overwrite_protection(tmp_path: Path) -> None:
    run = tmp_path / "run"
    missing = rlx("train", *TINY, "--resume", "trainer.total_steps=1", f"trainer.output_dir={run}", cwd=tmp_path)
    assert missing.returncode == 2 and "no complete checkpoint" in missing.stderr
    assert "Traceback" not in missing.stderr
    assert rlx("train", *TINY, "trainer.total_steps=1", f"trainer.output_dir={run}", cwd=tmp_path).returncode == 0
    done = rlx("train", *TINY, "trainer.total_steps=1", f"trainer.output_dir={run}", cwd=tmp_path)
    assert done.returncode == 0 and "already finished" in done.stdout
    assert len(metrics(run)) == 1, "a finished run is not trained again"
    again = rlx("train", *TINY, "trainer.total_steps=1", "trainer.resume=never", f"trainer.output_dir={run}",
                cwd=tmp_path)
    assert again.returncode == 2 and "already holds checkpoints" in again.stderr


def test_checkpoint_write_failure_leaves_no_partial_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"

    def good(folder: Path) -> None:
        folder.mkdir(parents=True)
        (folder / "weights").write_text("ok")

    def crashes(folder: Path) -> None:
        folder.mkdir(parents=True)
        (folder / "weights").write_text("half")
        raise OSError("disk full")

    checkpoint.save(root, 1, good, {})
    with pytest.raises(OSError):
        checkpoint.save(root, 2, crashes, {})
    assert [p.name for p in checkpoint.list_complete(root)] == ["global_step_1"]
    assert not (root / "global_step_2").exists()
    checkpoint.save(root, 3, good, {}, keep=1)
    assert [p.name for p in checkpoint.list_complete(root)] == ["global_step_3"]
    assert not list(root.glob(".tmp-*")), "left-over temporary folders are cleaned by the next save"
    assert checkpoint.read_state(root / "global_step_3")["step"] == 3


def test_kill_during_training_never_leaves_an_incomplete_checkpoint(tmp_path: Path) -> None:
    """SIGKILL a run that saves every step; every checkpoint left behind is complete and resumable."""
    run = tmp_path / "run"
    args = [sys.executable, "-m", "rlx", "train", *TINY, "trainer.total_steps=200", "trainer.save_freq=1",
            "trainer.max_checkpoints_to_keep=2", f"trainer.output_dir={run}"]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and len(checkpoint.list_complete(run / "checkpoints")) < 2:
        time.sleep(0.2)
    time.sleep(0.37)  # land somewhere inside a step or a save
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = checkpoint.list_complete(run / "checkpoints")
    assert done, "at least one checkpoint was complete before the kill"
    for path in (run / "checkpoints").glob("global_step_*"):
        assert (path / checkpoint.MARKER).is_file(), f"{path} looks like a checkpoint but is incomplete"
    last_step = checkpoint.read_state(done[-1])["step"]
    resumed = rlx("train", *TINY, f"trainer.total_steps={last_step + 1}", f"trainer.output_dir={run}",
                  cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"step {last_step})" in resumed.stdout


def test_swanlab_offline_gets_every_metric(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("swanlab")
    from rlx.plugins.loggers.swanlab import read_offline_run

    run = tmp_path / "run"
    monkeypatch.delenv("SWANLAB_API_KEY", raising=False)
    result = rlx("train", "--preset", "tiny", "trainer.total_steps=2", "trainer.test_freq=-1",
                 "trainer.loggers=[jsonl,swanlab]", "loggers.swanlab.mode=offline", "trainer.save_freq=0",
                 "trainer.save_hf_model=false", f"trainer.output_dir={run}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    logged = metrics(run)
    stored = read_offline_run(run / "swanlab")
    for row in logged:
        for key, value in row.items():
            if key in ("step", "time") or value is None:
                continue
            assert key in stored, key
            assert dict(stored[key])[row["step"]] == pytest.approx(value, rel=1e-5), key
