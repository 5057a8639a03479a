"""rlx.plugins.launchers.weight_sync's shared-memory transport (CUDA IPC on a GPU, a shared-memory segment on the
CPU: the same
code with another handle type) and the choice of transport.

On the CPU: three processes (rank 0 sends, two rollout ranks receive) over a gloo group; every dtype and shape
arrives bit-exact, the engine reads the sender's own memory (no copy), a slow engine never sees a buffer
overwritten before it acknowledged it, and an engine that stops reading early does not leave the sender
waiting. On a GPU (``-m gpu``): ``rlx train`` with a rollout process on the training GPU syncs by CUDA IPC and
its engine holds the actor's weights after every step."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import textwrap
import time
from collections import deque
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from test_weight_sync import payload as kinds

from rlx.context import BuildContext
from rlx.errors import UserError
from rlx.plugins.launchers import weight_sync
from rlx.plugins.launchers.local import LocalOptions, build
from rlx.protocols import RunInfo

pytestmark = pytest.mark.multiproc

LIMIT = 1024


def payload() -> list[tuple[str, torch.Tensor]]:
    """Every kind of tensor a model may hold (test_weight_sync's: dtypes of 1 to 8 bytes, a scalar, an empty,
    a non-contiguous tensor, one larger than the bucket), then enough rows of 100 floats that both buffers
    are reused."""
    gen = torch.Generator().manual_seed(5)
    return kinds() + [(f"row.{i}", torch.randn(100, generator=gen)) for i in range(10)]  # 400 bytes: 2 a bucket


class SlowEngine:
    """Reads the stream slowly (so a sender that overwrote a buffer too early would be caught), checks that
    each tensor lies in shared memory (the sender's buffer, not a copy), and stops after ``reads`` tensors
    when given (an engine that fails to read everything)."""

    def __init__(self, reads: int | None, delay: float) -> None:
        self.reads, self.delay = reads, delay
        self.got: list[tuple[str, torch.dtype, tuple[int, ...], list[Any]]] = []
        self.shared: list[bool] = []

    def update_weights(self, named: Any) -> None:
        for i, (name, tensor) in enumerate(named):
            if self.reads is not None and i >= self.reads:
                return
            time.sleep(self.delay)
            self.shared.append(tensor.numel() == 0 or tensor.is_shared())
            self.got.append((name, tensor.dtype, tuple(tensor.shape), tensor.tolist()))


def _process(rank: int, port: int, results: Any, delay: float, device: str) -> None:
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(0)  # every process on one GPU

    store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=timedelta(seconds=60))
    group = dist.ProcessGroupGloo(dist.PrefixStore("weights", store), rank, 3, timedelta(seconds=60))
    if rank == 0:
        rounds = [weight_sync.ipc_send(iter(payload()), group, LIMIT, device) for _ in range(2)]
        results.put((rank, [(s.bytes, s.buckets) for s in rounds], None, None))
        return
    engine = SlowEngine(reads=None if rank == 1 else 3, delay=delay)
    rounds = [weight_sync.ipc_receive_into(engine, group) for _ in range(2)]
    results.put((rank, [(s.bytes, s.buckets) for s in rounds], engine.got, engine.shared))


def _run_three(delay: float, device: str = "cpu") -> dict[int, Any]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_process, args=(r, store.port, results, delay, device),
                         daemon=True) for r in range(3)]
    for p in procs:
        p.start()
    try:
        return {rank: rest for rank, *rest in (results.get(timeout=120) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_shared_memory_sync_sends_every_tensor_bit_exact_to_every_rollout_rank(one_thread: Any, device: str) -> None:
    """Two syncs in a row, the engines reading 5 ms per tensor. Rank 1 reads everything; rank 2 stops after
    3 tensors, the rest is drained, so the sender finishes both syncs. On a GPU the three processes share
    one GPU (CUDA IPC handles); on the CPU, shared-memory segments."""
    got = _run_three(delay=0.005, device=device)
    expected = payload()
    total = sum(t.numel() * t.element_size() for _, t in expected)
    # 64-byte aligned buckets of at most 1024 bytes: the first 7 tensors, the big one alone, then 5 buckets
    # of two 400-byte rows, which alternate between the two buffers (each is filled three times in all).
    for rank in (0, 1, 2):
        assert got[rank][0] == [(total, 7), (total, 7)], rank
    for rank, reads in ((1, len(expected)), (2, 3)):
        _, received, shared = got[rank]
        assert len(received) == 2 * reads
        assert all(shared), "the engine reads the sender's shared buffer, not a copy"
        for i, (name, dtype, shape, values) in enumerate(received):
            want_name, want = expected[i % reads]
            assert (name, dtype, shape) == (want_name, want.dtype, tuple(want.shape))
            assert values == want.tolist(), f"{name} changed under the engine (buffer reused before the ack?)"


def test_the_sender_keeps_at_most_two_buckets_in_flight_and_never_writes_into_one() -> None:
    """Rank 0 against a group that plays one rollout rank: it maps each bucket's memory as a rollout rank
    would (here the very memory rank 0 wrote), and acknowledges the oldest bucket only when rank 0 waits for
    it. At most two buckets are ever unacknowledged, and no bucket's bytes change before it is acknowledged
    (rank 0 packs the next bucket into the other buffer while this one is read)."""
    import torch.distributed as dist

    real = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=30))

    class Loopback:
        def __init__(self) -> None:
            self.unacked: deque[tuple[torch.Tensor, torch.Tensor]] = deque()  # (mapped, as sent), oldest first
            self.acked = 0
            self.peaks: list[int] = []
            self.changed: list[int] = []

        def size(self) -> int:
            return 2

        def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
            if tensors[0].dtype == torch.uint8:  # a message (its length goes first, as int64)
                message = pickle.loads(tensors[0].numpy().tobytes())
                if message is not None:
                    mapped = weight_sync._open(message[2])
                    self.unacked.append((mapped, mapped.clone()))
                    self.peaks.append(len(self.unacked))
            return real.barrier()

        def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
            if self.unacked:  # an acknowledgement, else the final "released"
                mapped, sent = self.unacked.popleft()
                if not torch.equal(mapped, sent):
                    self.changed.append(self.acked)
                tensors[0].fill_(self.acked)
                self.acked += 1
            return real.barrier()

    group = Loopback()
    stats = weight_sync.ipc_send(iter(payload()), group, LIMIT, "cpu")
    assert stats.buckets == 7 and group.acked == 7
    assert max(group.peaks) == 2, group.peaks
    assert group.changed == [], f"buckets {group.changed} were overwritten before they were acknowledged"


@pytest.mark.parametrize(("mode", "sender", "receivers", "expected"), [
    ("auto", None, [None, None], "broadcast"),  # the CPU: gloo
    ("broadcast", None, [None], "broadcast"),
    ("auto", "GPU-a", ["GPU-b", "GPU-c"], "broadcast"),  # GPUs of their own: NCCL
    ("auto", "GPU-a", ["GPU-a", "GPU-a"], "cuda_ipc"),  # rank 0's GPU, whatever its index there
    ("cuda_ipc", "GPU-a", ["GPU-a"], "cuda_ipc"),
    ("cuda_ipc", None, [None], "needs CUDA GPUs"),
    ("cuda_ipc", "GPU-a", ["GPU-a", "GPU-b"], r"rollout pool ranks \[1\] run on other GPUs"),
    ("auto", "GPU-a", ["GPU-b", "GPU-a"], r"rollout pool ranks \[0\] run on other GPUs"),
    ("broadcast", "GPU-a", ["GPU-b", "GPU-a"], "NCCL refuses two ranks on one GPU"),
])
def test_the_transport_follows_the_gpus_uuids(mode: Any, sender: str | None, receivers: list[str | None],
                                              expected: str) -> None:
    if expected in ("broadcast", "cuda_ipc"):
        assert weight_sync.choose(mode, sender, receivers) == expected
    else:
        with pytest.raises(UserError, match=expected):
            weight_sync.choose(mode, sender, receivers)


def _ctx() -> BuildContext:
    return BuildContext(None, RunInfo("/tmp", "p", "e", {}))


def test_cuda_ipc_on_the_cpu_and_a_transport_without_a_rollout_pool_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="but there is none"):
        build(LocalOptions(nproc=2, weight_sync="broadcast"), _ctx())
    run = subprocess.run([sys.executable, "-m", "rlx", "train", "--preset", "tiny", "trainer.device=cpu",
                          "launcher.rollout_nproc=1", "launcher.weight_sync=cuda_ipc",
                          f"trainer.output_dir={tmp_path}"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 2, run.stderr[-2000:]
    assert "launcher.weight_sync=cuda_ipc needs CUDA GPUs" in run.stderr and "Traceback" not in run.stderr


def test_the_rollout_pool_shares_rank_0s_gpu_when_told_to_or_when_no_gpu_is_left() -> None:
    from rlx.plugins.launchers.local import Layout, plan

    def placed(gpus: int | None, **options: Any) -> tuple[bool, list[int]]:
        layout = plan(LocalOptions(**options), gpus)
        return layout.share_gpu, [layout.gpu(r) for r in range(layout.world)]

    assert placed(1, rollout_nproc=1) == (True, [0, 0])  # auto, one GPU: CUDA IPC
    assert placed(1, rollout_nproc=2) == (True, [0, 0, 0])
    assert placed(2, rollout_nproc=1) == (False, [0, 1])  # auto, a GPU each: broadcast
    assert placed(3, nproc=2, rollout_nproc=1) == (False, [0, 1, 2])
    assert placed(2, nproc=2, rollout_nproc=1) == (True, [0, 1, 0])
    assert placed(2, rollout_nproc=1, weight_sync="cuda_ipc") == (True, [0, 0])
    assert placed(None, nproc=2, rollout_nproc=1) == (False, [0, 1, 2])  # the CPU: no GPU indices used
    assert plan(LocalOptions(nproc=2), 2) == Layout(2)
    with pytest.raises(UserError, match=r"(?s)2 processes \(1 training \+ 1 rollout.*weight_sync=broadcast.*share"):
        plan(LocalOptions(rollout_nproc=1, weight_sync="broadcast"), 1)
    with pytest.raises(UserError, match="2 processes on this machine need as many GPUs, but 1"):
        plan(LocalOptions(nproc=2, rollout_nproc=1), 1)  # sharing rank 0's GPU, training still needs 2
    with pytest.raises(UserError, match="weight_sync=cuda_ipc needs CUDA GPUs"):
        plan(LocalOptions(rollout_nproc=1, weight_sync="cuda_ipc"), None)


GPU_RUN = textwrap.dedent('''
    import json, os, sys
    import torch
    from rlx.registry import get_plugin_manager
    from rlx.trainer import Trainer
    from rlx.validate import load_config

    class Checked(Trainer):
        """After every step: the rollout process's engine holds the actor's weights (in the engine's dtype)."""
        steps = []

        def train_step(self, examples):
            metrics = super().train_step(examples)
            actor = {n: t.detach().cpu() for n, t in self.actor.call_all(object.__getattribute__, "model")[0]
                     .state_dict().items()}
            [model] = self.rollout.call_all(object.__getattribute__, "model")  # pickled over from its process
            engine = {n: t.detach().cpu() for n, t in model.state_dict().items()}
            self.steps.append({
                "differ": [n for n, t in actor.items() if not torch.equal(engine[n], t.to(engine[n].dtype))],
                "bytes": sum(t.numel() * t.element_size() for t in actor.values()),
                "fingerprint": float(sum(t.double().sum() for t in actor.values())),
                "metrics": metrics,
            })
            return metrics

    if __name__ == "__main__":
        pm = get_plugin_manager()
        trainer = Checked(load_config(pm, preset="tiny", overrides=sys.argv[2:]), pm)
        trainer.fit()
        json.dump({"steps": Checked.steps}, open(sys.argv[1], "w"))
        sys.stdout.flush()
        os._exit(0)  # as the CLI does after torch.distributed was used
''')


@pytest.mark.gpu
@pytest.mark.slow
def test_a_rollout_process_on_the_training_gpu_gets_the_weights_by_cuda_ipc(tmp_path: Path) -> None:
    """One GPU, one training process and one rollout process (launcher.rollout_nproc=1, weight_sync=auto):
    NCCL cannot join two processes on one GPU, so the weights travel by CUDA IPC, in 0.05 MiB buckets (the
    tiny model is 0.31 MiB: both buffers are refilled several times), and after every step the engine holds
    the actor's weights exactly (cast to its dtype, as it loads them). The engine sleeps while the models
    train, as a colocated one does: it shares the GPU."""
    script = tmp_path / "gpu_run.py"
    script.write_text(GPU_RUN)
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, str(script), str(out), "trainer.device=cuda", "trainer.total_steps=3",
                          "trainer.test_freq=-1", "trainer.loggers=[jsonl]", "trainer.save_hf_model=false",
                          "trainer.save_freq=0", "data.train_batch_size=16", "actor.ppo_mini_batch_size=8",
                          "rollout.n=4", "rollout.name=hf", "launcher.rollout_nproc=1",
                          "launcher.bucket_size_mb=0.05", f"trainer.output_dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "RLX_CACHE": str(tmp_path / "cache"),  # one GPU, even on a larger host
                              "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Weight sync: cuda_ipc (rank 0 to 1 rollout process(es) on training rank 0's GPU" in run.stdout
    steps = json.loads(out.read_text())["steps"]
    assert len(steps) == 3
    for step in steps:
        m = step["metrics"]
        assert step["differ"] == [], step["differ"]
        assert m["weight_sync/bytes"] == step["bytes"] and m["weight_sync/buckets"] > 4
        assert m["timing/weight_sync"] > 0 and "timing/sleep" in m and "timing/wake_up" in m
    assert len({s["fingerprint"] for s in steps}) == 3, "the actor changed at every step"
