"""The ``ray`` launcher on a local Ray instance (2 logical CPUs): the built-in job trains with the same
metrics as the local launcher's 2 processes, workers' results come back in data-parallel order, a worker
that raises or whose actor is killed ends the run naming its rank (no hang, no actor left), and bad input
(Ray missing, an unreachable address, GPUs the cluster lacks, bundles it cannot place) is one message with
exit status 2. Without ``ray`` installed only the missing-package test runs."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlx.plugins.loggers.jsonl import read_metrics

pytestmark = pytest.mark.slow
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")

TINY = ["--preset", "tiny", "trainer.test_freq=-1", "trainer.loggers=[jsonl]", "trainer.save_hf_model=false"]
RAY = ["launcher.name=ray", "launcher.nproc=2"]


def env(tmp_path: Path, **extra: str) -> dict[str, str]:
    # A private builtin cache: other runs on the machine may be writing the shared one.
    return {**os.environ, "OMP_NUM_THREADS": "1", "RLX_CACHE": str(tmp_path.parent / "rlx-cache"), **extra}


def rlx(*args: str, cwd: Path, timeout: int = 600, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rlx", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env(cwd, **extra))


def assert_user_error(run: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    for fragment in fragments:
        assert fragment in run.stderr, run.stderr[-3000:]


def descendants(pid: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_missing_ray_is_one_message(tmp_path: Path) -> None:
    """Where ray is installed, a package that fails to import stands in for it (an ImportError, as when it
    is absent); where it is not, this is the real thing."""
    shadow = tmp_path / "shadow" / "ray"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'ray'\")\n")
    run = rlx("train", *TINY, *RAY, f"trainer.output_dir={tmp_path / 'run'}", cwd=tmp_path,
              PYTHONPATH=str(shadow.parent))
    assert_user_error(run, "needs the Python package `ray`", "pip install 'rlx[ray]'")


@needs_ray
def test_unreachable_addresses_end_fast(tmp_path: Path) -> None:
    # Nothing listens on the port: refused at once.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    start = time.monotonic()
    run = rlx("train", *TINY, *RAY, f"launcher.address=127.0.0.1:{closed_port}",
              f"trainer.output_dir={tmp_path / 'a'}", cwd=tmp_path, timeout=120)
    assert_user_error(run, f"Cannot reach the Ray cluster at launcher.address='127.0.0.1:{closed_port}'",
                      "ray start --head")
    assert time.monotonic() - start < 60
    # Something listens but is no Ray head: ray.init would retry without end; connect_timeout_s bounds it.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        port = server.getsockname()[1]
        start = time.monotonic()
        run = rlx("train", *TINY, *RAY, f"launcher.address=127.0.0.1:{port}", "launcher.connect_timeout_s=5",
                  f"trainer.output_dir={tmp_path / 'b'}", cwd=tmp_path, timeout=120)
    assert_user_error(run, f"launcher.address='127.0.0.1:{port}' did not answer within "
                      "launcher.connect_timeout_s=5 s")
    assert time.monotonic() - start < 60
    run = rlx("train", *TINY, *RAY, "launcher.address=nohost", f"trainer.output_dir={tmp_path / 'c'}",
              cwd=tmp_path, timeout=120)
    assert_user_error(run, "launcher.address='nohost' is not 'auto', 'HOST:PORT' or 'ray://HOST:PORT'")


@needs_ray
def test_resources_the_cluster_lacks(tmp_path: Path) -> None:
    run = rlx("train", *TINY, *RAY, "launcher.gpus_per_worker=1", f"trainer.output_dir={tmp_path / 'a'}",
              cwd=tmp_path, timeout=300)
    assert_user_error(run, "The Ray workers need 2 GPUs (launcher.nproc=2 x launcher.gpus_per_worker) but the "
                      "cluster has 0", "launcher.nproc")
    run = rlx("train", *TINY, *RAY, "trainer.device=cuda", f"trainer.output_dir={tmp_path / 'b'}",
              cwd=tmp_path, timeout=300)
    assert_user_error(run, "trainer.device=cuda, but the Ray workers get no GPU (the cluster has none).")
    # Enough CPUs in all, but STRICT_SPREAD wants one node per worker and the local instance is one node.
    run = rlx("train", *TINY, *RAY, "launcher.placement_strategy=STRICT_SPREAD", "launcher.placement_timeout_s=3",
              f"trainer.output_dir={tmp_path / 'c'}", cwd=tmp_path, timeout=300)
    assert_user_error(run, "Ray could not place 2 workers of {'CPU': 1.0} each with strategy STRICT_SPREAD "
                      "within launcher.placement_timeout_s=3 s", "nodes: 2 CPUs, 0 GPUs")


GROUPS = textwrap.dedent('''
    import sys, time
    import torch
    from rlx.batch import Batch
    from rlx.errors import UserError
    from rlx.protocols import DispatchInfo
    from rlx.plugins.launchers.ray import RayLauncher, RayOptions

    class Worker:
        def __init__(self, rank, world, replicated=False):
            self.rank, self.world, self.replicated = rank, world, replicated

        def dispatch_info(self):
            # replicated: both ranks get the whole batch (one data-parallel rank), only rank 1 returns it
            return DispatchInfo(0, 1, self.rank == 1) if self.replicated else DispatchInfo(self.rank, self.world)

        def tag(self, batch):
            return Batch({"x": batch.tensors["x"], "rank": torch.full_like(batch.tensors["x"], self.rank)})

        def total(self, value, fail_rank=-1, user=False):
            import torch.distributed as dist
            if self.rank == fail_rank:  # the other rank waits in the all-reduce meanwhile
                time.sleep(1)
                raise (UserError if user else ValueError)(f"planted failure on rank {self.rank}")
            t = torch.tensor([float(value + self.rank)])
            dist.all_reduce(t)
            return t.item()

        def nap(self, seconds):
            if self.rank == 1:  # no collective: only the driver can notice
                time.sleep(seconds)
            return self.rank

    def build(rank, world):
        return Worker(rank, world)

    def build_replicated(rank, world):
        return Worker(rank, world, True)

    if __name__ == "__main__":
        kind = sys.argv[1]
        launcher = RayLauncher(RayOptions(nproc=2, timeout_s=5 if kind == "hang" else 600), "cpu", 0)
        dp = launcher.create_group("dp", build)
        rep = launcher.create_group("rep", build_replicated)
        batch = Batch({"x": torch.arange(6)})
        out = dp.call(Worker.tag, batch)
        print("dp", out.tensors["x"].tolist(), out.tensors["rank"].tolist())
        out = rep.call(Worker.tag, batch)
        print("rep", out.tensors["x"].tolist(), out.tensors["rank"].tolist())
        print("all", dp.call_all(Worker.total, 10))
        sys.stdout.flush()
        start = time.monotonic()
        try:
            if kind == "hang":
                dp.call_all(Worker.nap, 120)
            else:
                dp.call_all(Worker.total, 10, 1, kind == "user")
        except UserError as exc:
            print("user error:", exc)
        except SystemExit as exc:
            print("exit", exc.code)
        print("after", round(time.monotonic() - start), "ray running:", __import__("ray").is_initialized())
''')


@needs_ray
@pytest.mark.parametrize("kind", ["crash", "user", "hang"])
def test_results_in_rank_order_and_a_raising_or_hung_worker_ends_the_call(tmp_path: Path, kind: str) -> None:
    """Shards go out and come back in data-parallel order (replicated ranks: only the collected one);
    collectives run across the actors; a rank that raises while the other waits for it in a collective
    ends the call at once (launcher.timeout_s is 600 s) naming it; a rank that does not answer
    launcher.timeout_s (5 s) after the other is named as hung; either way Ray is stopped."""
    script = tmp_path / "groups.py"
    script.write_text(GROUPS)
    run = subprocess.run([sys.executable, str(script), kind], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env=env(tmp_path))
    out = run.stdout
    assert run.returncode == 0, run.stderr[-3000:]
    assert "dp [0, 1, 2, 3, 4, 5] [0, 0, 0, 1, 1, 1]" in out, out
    assert "rep [0, 1, 2, 3, 4, 5] [1, 1, 1, 1, 1, 1]" in out, out
    assert "all [21.0, 21.0]" in out, out
    if kind == "user":
        assert "user error: worker rank 1 failed: planted failure on rank 1" in out, out
    elif kind == "hang":
        assert "exit 1" in out, out
        assert ("Error: worker rank 1 did not answer within launcher.timeout_s=5 s of the others during "
                "call_all dp.nap") in run.stderr, run.stderr
    else:
        assert "exit 1" in out, out
        assert "Error: worker rank 1 failed: ValueError: planted failure on rank 1" in run.stderr, run.stderr
        assert "Stopped every worker." in run.stderr
    after = re.search(r"after (\d+) ray running: (\w+)", out)
    assert after is not None, out
    assert int(after.group(1)) < 60 and after.group(2) == "False", out


@needs_ray
def test_ray_trains_the_builtin_job_like_two_local_processes(tmp_path: Path) -> None:
    """Same seed, same data split (shards by data-parallel rank), same per-rank seeds (seed + rank): the
    2-actor Ray run and the 2-process local run log the same metrics at every step. Measured: identical to
    the last bit (float32 on gloo, same thread counts); the tolerance leaves room for round-off only."""
    steps = 3
    runs = {}
    for name, launcher in (("ray", RAY), ("local", ["launcher.nproc=2"])):
        out = tmp_path / name
        run = rlx("train", *TINY, *launcher, f"trainer.total_steps={steps}", "trainer.save_freq=3",
                  f"trainer.output_dir={out}", cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "Traceback" not in run.stderr
        runs[name] = {r["step"]: r for r in read_metrics(out)}
    # Step 0, if the preset validates before training: greedy rollouts through the workers.
    assert sorted(runs["ray"]) == sorted(runs["local"])
    assert set(range(1, steps + 1)) <= set(runs["ray"]) <= set(range(steps + 1))
    assert (tmp_path / "ray" / "checkpoints").is_dir()
    compared = 0
    for step, row in runs["local"].items():
        assert set(runs["ray"][step]) == set(row)
        for key, value in row.items():
            if key == "time" or key.startswith(("timing/", "perf/")):
                continue
            assert runs["ray"][step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)
            compared += key in ("actor/pg_loss", "actor/grad_norm", "reward/mean")
    assert compared == 3 * steps


@needs_ray
def test_a_ray_rollout_pool_generates_beside_training(tmp_path: Path) -> None:
    """Asynchronous RL (issue 27) through Ray: the rollout pool's actor generates the next step's rollouts while
    the training actor trains; every step after the first trains on rollouts one version old."""
    out = tmp_path / "async"
    run = rlx("train", *TINY, "launcher.name=ray", "launcher.nproc=1", "launcher.rollout_nproc=1",
              "trainer.max_staleness=1", "trainer.total_steps=3", f"trainer.output_dir={out}", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [r for r in read_metrics(out) if "reward/mean" in r]
    assert [r["async/staleness/max"] for r in rows] == [0.0, 1.0, 1.0]
    assert rows[1]["timing/overlap"] > 0 and rows[-1]["timing/overlap"] == 0.0


@needs_ray
def test_a_killed_worker_actor_ends_the_run_naming_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    err_file = tmp_path / "stderr.txt"
    with open(err_file, "w") as err_out:  # a file, not a pipe: nobody reads it while the run goes on
        proc = subprocess.Popen([sys.executable, "-m", "rlx", "train", *TINY, *RAY, "trainer.total_steps=100000",
                                 "trainer.save_freq=0", f"trainer.output_dir={run_dir}"],
                                cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err_out, env=env(tmp_path))
    try:
        deadline = time.time() + 300
        metrics = run_dir / "metrics.jsonl"
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None, err_file.read_text()[-3000:]
            time.sleep(0.2)
        family = descendants(proc.pid)
        actors = sorted(p for p in family if "_RayHost" in cmdline(p))
        assert len(actors) == 2, [cmdline(p) for p in family]
        os.kill(actors[-1], signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err_file.read_text()
    assert proc.returncode == 1, err[-3000:]
    assert re.search(r"Error: worker rank [01] failed: its Ray actor died", err), err[-3000:]
    assert "Traceback" not in err.split("Error:")[-1], err[-3000:]
    deadline = time.time() + 30
    while time.time() < deadline and any(alive(p) for p in family):
        time.sleep(0.2)
    assert not [cmdline(p) for p in family if alive(p)], "Ray processes outlived the run"
