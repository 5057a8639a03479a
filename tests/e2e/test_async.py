"""Asynchronous RL end to end (issue 27, `trainer.max_staleness=K`): real runs of the built-in tiny job.

What is checked: the lag of every trained sample stays within K and is recorded, K=0 is the synchronous
loop, a run killed while the next step's rollouts were being generated resumes to the same numbers, the
rollout pool of several processes overlaps training (colocated it does not, and says so), and the config
errors of the new keys. Runs use one CPU thread (`threads=1`) where numbers are compared exactly.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_trainer import rlx  # the CLI in a subprocess, optionally on one thread

from rlx.plugins.loggers.jsonl import read_metrics
from rlx.run import checkpoint

pytestmark = pytest.mark.slow

TINY = ["--preset", "tiny", "trainer.test_freq=-1", "trainer.loggers=[jsonl]", "trainer.save_hf_model=false"]
COMPARED = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "async/staleness/mean", "response_length/mean")


def train(run: Path, *args: str, threads: int | None = 1) -> list[dict]:
    """`rlx train --preset tiny ARGS` into ``run``; its metrics rows, one per step."""
    result = rlx("train", *TINY, *args, f"trainer.output_dir={run}", cwd=run.parent, threads=threads)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(run)


def check_staleness(rows: list[dict], k: int) -> None:
    """Every step's samples lag at most ``k`` versions; the first step's none; the policy version is the step."""
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    for r in rows:
        assert 0 <= r["async/staleness/mean"] <= r["async/staleness/max"] <= k, r
        assert r["async/policy_version"] == r["step"], r
        assert r["async/engine_version"] <= r["step"], r
        assert r["timing/overlap"] >= 0 and r["timing/rollout_idle"] >= 0 and r["timing/wait_rollout"] >= 0, r
    assert rows[0]["async/staleness/max"] == 0.0 and rows[0]["async/staleness/mean"] == 0.0


def test_staleness_stays_within_k_and_versions_are_recorded(tmp_path: Path) -> None:
    one = train(tmp_path / "k1", "trainer.max_staleness=1", "trainer.total_steps=5")
    check_staleness(one, 1)
    for r in one[1:]:  # one-step off-policy: every later step trains on the previous policy's rollouts
        assert r["async/staleness/mean"] == 1.0 and r["async/staleness/max"] == 1.0, r
    # The in-process engine generates in a thread beside training (the last step has nothing to generate).
    assert any(r["timing/overlap"] > 0 for r in one[:-1]), [r["timing/overlap"] for r in one]
    assert one[-1]["timing/overlap"] == 0.0

    two = train(tmp_path / "k2", "trainer.max_staleness=2", "trainer.total_steps=6")
    check_staleness(two, 2)
    # Weights reach the engine only when the lag would exceed 2: some step trains on rollouts 2 versions old.
    assert any(r["async/staleness/max"] == 2.0 for r in two), [r["async/staleness/max"] for r in two]
    assert any(r["async/engine_version"] < r["step"] - 1 for r in two), [r["async/engine_version"] for r in two]


def test_partial_rollouts_are_interrupted_continued_and_stay_within_k(tmp_path: Path) -> None:
    """rollout.partial with K=2: one sequence per micro-batch makes the generation slower than the update, so
    the step boundary interrupts it (here on 2 or 3 of the 6 steps, with micro-batches of 2); unfinished responses are
    continued in the next rollout, those too old are made again, and no trained token is more than 2 versions
    old (a row's policy_version is its first token's)."""
    rows = train(tmp_path / "partial", "trainer.max_staleness=2", "rollout.partial=true",
                 "rollout.micro_batch_size=1", "trainer.total_steps=6", threads=None)
    check_staleness(rows, 2)
    assert any(r["rollout/partial/interrupted"] == 1.0 for r in rows), rows
    assert any(r["rollout/partial/continued"] > 0 for r in rows), [r["rollout/partial/continued"] for r in rows]
    assert all(r["rollout/partial/carried"] >= 0 for r in rows)


def test_max_staleness_zero_is_the_synchronous_loop(tmp_path: Path) -> None:
    default = train(tmp_path / "default", "trainer.total_steps=3")
    zero = train(tmp_path / "zero", "trainer.max_staleness=0", "trainer.total_steps=3")
    assert [r["step"] for r in default] == [r["step"] for r in zero] == [1, 2, 3]

    def values(row: dict) -> dict:
        return {k: v for k, v in row.items() if not k.startswith(("timing/", "perf/")) and k != "time"}

    for a, b in zip(default, zero):
        assert not [k for k in a if k.startswith("async/")] and not [k for k in b if k.startswith("async/")]
        assert "timing/overlap" not in a and "timing/overlap" not in b
        assert values(a) == values(b), {k: (v, values(b).get(k)) for k, v in values(a).items()
                                        if values(b).get(k) != v}


def _kill_after_checkpoint(run: Path, step: int, args: list[str]) -> bool:
    """`rlx train ARGS` killed with SIGKILL once checkpoint ``step`` is complete; False when the run ended
    first (then the checkpoints after ``step`` are removed, as if it had been killed there)."""
    cmd = [sys.executable, "-m", "rlx", "train", *TINY, *args, f"trainer.output_dir={run}"]
    log = run.parent / f"{run.name}.log"
    marker = run / "checkpoints" / f"global_step_{step}" / checkpoint.MARKER
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=run.parent, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            deadline = time.time() + 300
            while time.time() < deadline and proc.poll() is None and not marker.is_file():
                time.sleep(0.02)
            killed = proc.poll() is None
            if killed:
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert marker.is_file(), log.read_text()[-3000:]
    if not killed:
        assert proc.returncode == 0, log.read_text()[-3000:]
    else:
        assert proc.returncode == -signal.SIGKILL
    for later in checkpoint.list_complete(run / "checkpoints"):
        if checkpoint.read_state(later)["step"] > step:
            shutil.rmtree(later)
    return killed


def test_kill_and_resume_mid_overlap_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    args = ["trainer.max_staleness=1", "trainer.total_steps=6", "trainer.save_freq=2"]
    straight = {r["step"]: r for r in train(tmp_path / "straight", *args)}
    assert sorted(straight) == [1, 2, 3, 4, 5, 6]

    run = tmp_path / "run"
    killed = _kill_after_checkpoint(run, 2, args)
    print(f"killed before the run ended: {killed}")
    ckpt = run / "checkpoints" / "global_step_2"
    assert (ckpt / "rollouts.pt").is_file(), sorted(p.name for p in ckpt.iterdir())
    assert checkpoint.read_state(ckpt)["policy_version"] == 2
    sync = tmp_path / "sync"  # the same checkpoint, resumed by the synchronous loop
    shutil.copytree(run, sync)

    resumed = rlx("train", *TINY, "--resume", *args, f"trainer.output_dir={run}", cwd=tmp_path, threads=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from" in resumed.stdout and "step 2)" in resumed.stdout
    rows = {r["step"]: r for r in read_metrics(run)}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    for step in (3, 4, 5, 6):
        for key in COMPARED:
            assert rows[step][key] == straight[step][key], (step, key, rows[step][key], straight[step][key])
    check_staleness([rows[s] for s in sorted(rows)], 1)

    # The synchronous loop trains on the rollouts the checkpoint holds first: step 3 is the K=1 run's step 3.
    again = rlx("train", *TINY, "--resume", "trainer.max_staleness=0", "trainer.total_steps=3", "trainer.save_freq=2",
                f"trainer.output_dir={sync}", cwd=tmp_path, threads=1)
    assert again.returncode == 0, again.stderr[-3000:]
    step3 = {r["step"]: r for r in read_metrics(sync)}[3]
    assert step3["reward/mean"] == straight[3]["reward/mean"], (step3["reward/mean"], straight[3]["reward/mean"])
    assert step3["response_length/mean"] == straight[3]["response_length/mean"]
    assert not [k for k in step3 if k.startswith("async/")]


@pytest.mark.multiproc
def test_rollout_pool_overlaps_training(tmp_path: Path) -> None:
    run = tmp_path / "pool"
    result = rlx("train", *TINY, "--nproc", "2", "launcher.rollout_nproc=1", "trainer.max_staleness=1",
                 "trainer.total_steps=3", f"trainer.output_dir={run}", cwd=tmp_path, threads=1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "shares processes" not in result.stderr
    rows = read_metrics(run)
    check_staleness(rows, 1)
    assert [r["async/staleness/max"] for r in rows] == [0.0, 1.0, 1.0]
    assert rows[1]["timing/overlap"] > 0, [r["timing/overlap"] for r in rows]


@pytest.mark.multiproc
def test_colocated_engine_says_there_is_no_overlap(tmp_path: Path) -> None:
    run = tmp_path / "colocated"
    result = rlx("train", *TINY, "--nproc", "2", "trainer.max_staleness=1", "trainer.total_steps=2",
                 f"trainer.output_dir={run}", cwd=tmp_path, threads=1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Note: trainer.max_staleness=1" in result.stderr and "no overlap" in result.stderr, result.stderr[-3000:]
    rows = read_metrics(run)
    check_staleness(rows, 1)  # the same schedule, so the same staleness
    assert rows[1]["async/staleness/max"] == 1.0
    assert all(r["timing/overlap"] == 0.0 for r in rows), [r["timing/overlap"] for r in rows]


@pytest.mark.parametrize(("args", "key", "says"), [
    (["trainer.max_staleness=-1"], "trainer.max_staleness", "greater than or equal to 0"),
    (["trainer.max_staleness=17"], "trainer.max_staleness", "less than or equal to 16"),
    (["rollout.partial=true", "trainer.max_staleness=1"], "rollout.partial", "trainer.max_staleness >= 2"),
    (["rollout.partial=true", "trainer.max_staleness=2", "--nproc", "2"], "rollout.partial", "--nproc 1"),
    (["rollout.partial=true", "trainer.max_staleness=2", "rollout.name=vllm"], "rollout.partial",
     "cannot be interrupted"),
])
def test_bad_async_config_is_refused(tmp_path: Path, args: list[str], key: str, says: str) -> None:
    result = rlx("config", "validate", "--preset", "tiny", *args, cwd=tmp_path)
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert key in result.stderr and says in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_train_refuses_partial_rollouts_below_staleness_two(tmp_path: Path) -> None:
    """`rlx train` says it too, before anything runs (no run folder is made)."""
    run = tmp_path / "run"
    result = rlx("train", *TINY, "rollout.partial=true", "trainer.max_staleness=1", "trainer.total_steps=1",
                 f"trainer.output_dir={run}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "rollout.partial" in result.stderr and "trainer.max_staleness" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (run / "checkpoints").exists()
