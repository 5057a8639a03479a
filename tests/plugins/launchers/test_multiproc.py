"""Several worker processes (``launcher.nproc=2``, torch.distributed over gloo on the CPU): the same update
as one process, end-to-end training, exact resume after a SIGKILL, and a dead or hung worker ending the run
with a message naming it, without orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlx.plugins.loggers.jsonl import read_metrics
from rlx.run import checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

TINY = ["--preset", "tiny", "trainer.test_freq=-1", "trainer.loggers=[jsonl]", "trainer.save_hf_model=false"]

# Every folder of the test tree: the scripts these tests run import helpers of other test modules.
TEST_DIRS = sorted({str(p.parent) for p in Path(__file__).parents[2].rglob("test_*.py")})


def rlx(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "rlx", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def children(pid: int) -> list[int]:
    """Worker processes spawned by ``pid`` (not multiprocessing's resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and "spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def gone(pids: list[int], seconds: float = 20) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if not any(Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]
                   for p in pids if Path(f"/proc/{p}/stat").exists()):
            return True
        time.sleep(0.2)
    return False


SAME_UPDATE = textwrap.dedent('''
    import json, sys
    from functools import partial
    import torch
    sys.path[:0] = {tests!r}
    from test_backend_torch import make_batch, grpo_loss
    from rlx.plugins.tasks import builtin
    from rlx.plugins.backends.torch_local import TorchBackend
    from rlx.plugins.modeling.worker import TorchBackendOptions
    from rlx.plugins.launchers.local import LocalOptions, build
    from rlx.context import BuildContext
    from rlx.protocols import RoleSpec, RunInfo, TrainWorker
    from rlx.trainer import ppo_update

    def main(nproc, out):
        path = builtin.resolve("builtin:tiny-qwen2")
        ctx = BuildContext(None, RunInfo(out, "p", "e", {{}}))
        launcher = build(LocalOptions(nproc=nproc), ctx)
        spec = RoleSpec(role="actor", model_path=path, trainable=True, lr=3e-4, micro_batch_size=2, seed=0)
        actor = launcher.create_group("actor", partial(TorchBackend(TorchBackendOptions(), "cpu").worker, spec))
        batch = make_batch(rows=8)
        batch.tensors["old_log_probs"] = actor.call(TrainWorker.compute_log_probs, batch)["log_probs"]
        metrics = {{}}
        ppo_update(actor, batch, grpo_loss(loss_agg_mode="token-mean"), epochs=2, mini_size=4, shuffle=True,
                   seed=7, prefix="actor", metrics=metrics)
        actor.call_all(TrainWorker.save_pretrained, out + "/model")
        launcher.shutdown()
        json.dump(metrics, open(out + "/metrics.json", "w"))

    if __name__ == "__main__":
        main(int(sys.argv[1]), sys.argv[2])
        # As the CLI does after torch.distributed was used: its C++ threads can abort the interpreter's
        # teardown ("terminate called without an active exception") once everything is written.
        import os
        os._exit(0)
''')


def test_two_processes_give_the_same_update_as_one(tmp_path: Path) -> None:
    """2 epochs x 2 shuffled mini-batches of 4 rows, micro-batches of 2: one process vs two data-parallel
    ranks (each sees half of every mini-batch; gradients summed over ranks). Same losses, gradient norms
    and weights to float32 round-off (1e-6)."""
    import torch
    from transformers import AutoModelForCausalLM

    script = tmp_path / "same_update.py"
    script.write_text(SAME_UPDATE.format(tests=TEST_DIRS))
    results = {}
    for nproc in (1, 2):
        out = tmp_path / f"n{nproc}"
        out.mkdir()
        run = subprocess.run([sys.executable, str(script), str(nproc), str(out)], capture_output=True, text=True,
                             timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert run.returncode == 0, run.stderr[-3000:]
        import json

        results[nproc] = (json.loads((out / "metrics.json").read_text()),
                          AutoModelForCausalLM.from_pretrained(out / "model").state_dict())
    (m1, w1), (m2, w2) = results[1], results[2]
    assert len(m1["actor/grad_norm"]) == len(m2["actor/grad_norm"]) == 4
    assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-5)
    assert m2["actor/pg_loss"] == pytest.approx(m1["actor/pg_loss"], rel=1e-4, abs=1e-6)
    for k, v in w1.items():
        torch.testing.assert_close(w2[k], v, atol=1e-6, rtol=0, msg=k)


def test_two_process_run_resumes_exactly_after_sigkill(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    first = rlx("train", *TINY, "launcher.nproc=2", "trainer.total_steps=6", f"trainer.output_dir={straight}",
                cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert [r["step"] for r in read_metrics(straight)] == list(range(1, 7))

    run = tmp_path / "run"
    args = [sys.executable, "-m", "rlx", "train", *TINY, "launcher.nproc=2", "trainer.total_steps=6",
            "trainer.save_freq=2", f"trainer.output_dir={run}"]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 300
    while time.time() < deadline and not checkpoint.list_complete(run / "checkpoints"):
        time.sleep(0.1)
    workers = children(proc.pid)
    assert workers, "rank 1 runs in its own process"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert gone(workers), "workers outlived a killed rank 0"
    resumed = rlx("train", *TINY, "launcher.nproc=2", "trainer.total_steps=6", f"trainer.output_dir={run}",
                  cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from" in resumed.stdout
    expected = {r["step"]: r for r in read_metrics(straight)}
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 7))
    for row in rows:
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean"):
            assert row[key] == pytest.approx(expected[row["step"]][key], rel=1e-5, abs=1e-7), (row["step"], key)


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_a_dead_or_hung_worker_ends_the_run_naming_it(tmp_path: Path, how: str) -> None:
    run = tmp_path / "run"
    args = [sys.executable, "-m", "rlx", "train", *TINY, "launcher.nproc=2", "launcher.timeout_s=15",
            "trainer.total_steps=100000", "trainer.save_freq=0", f"trainer.output_dir={run}"]
    err_file = tmp_path / "stderr.txt"
    with open(err_file, "w") as err_out:  # a file, not a pipe: nobody reads it while the run goes on
        proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err_out,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 300
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and
                                          (run / "metrics.jsonl").read_text().count("\n") >= 2):
        time.sleep(0.1)
    workers = children(proc.pid)
    assert len(workers) == 1
    os.kill(workers[0], signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err_file.read_text()
    assert proc.returncode == 1, err[-2000:]
    assert "Traceback" not in err.split("Error:")[-1]
    if how == "kill":
        assert "worker rank 1 failed" in err and "status -9" in err, err[-3000:]
    else:
        assert "Error: a worker did not answer within launcher.timeout_s=15 s" in err, err[-3000:]
    assert gone(workers), "a worker was left behind"
