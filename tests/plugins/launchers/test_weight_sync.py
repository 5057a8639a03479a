"""rlx.plugins.launchers.weight_sync: buckets, the in-process sync from a real torch actor into a real hf engine, and
the
bucketed broadcast over a gloo group of 3 processes (every dtype and shape arrives bit-exact, an engine that
stops reading early does not leave the sender waiting)."""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from rlx.plugins.backends.torch_local import TorchBackend
from rlx.plugins.launchers import weight_sync
from rlx.plugins.modeling.worker import TorchBackendOptions
from rlx.plugins.rollout.hf import HFRollout, HFRolloutOptions
from rlx.protocols import RoleSpec


def test_buckets_hold_at_most_the_limit_and_a_larger_tensor_alone() -> None:
    named = [("a", torch.zeros(10)), ("b", torch.zeros(10)), ("c", torch.zeros(100)), ("d", torch.zeros(5)),
             ("e", torch.zeros(20))]  # 40, 40, 400, 20, 80 bytes
    groups = [[name for name, _ in bucket] for bucket in weight_sync.buckets(named, 100)]
    assert groups == [["a", "b"], ["c"], ["d", "e"]]
    assert weight_sync.bucket_bytes(0.5) == 2**19


@pytest.mark.parametrize("size_mb", [256.0, 0.01])
def test_in_process_sync_gives_the_engine_the_actor_weights_exactly(tiny_model_path: str, one_thread: Any,
                                                                    size_mb: float) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    actor = TorchBackend(TorchBackendOptions(), "cpu").worker(
        RoleSpec(role="actor", model_path=tiny_model_path, trainable=True, seed=0))
    engine = HFRollout(tiny_model_path, HFRolloutOptions(), "cpu", [tok.eos_token_id], tok.pad_token_id)
    with torch.no_grad():  # the engine drifts away from the actor; the sync must bring back every tensor
        for param in engine.model.parameters():
            param.add_(torch.randn_like(param))
    stats = weight_sync.sync_in_process(actor, engine, weight_sync.bucket_bytes(size_mb))
    actor_weights = dict(actor.named_weights())
    engine_weights = engine.model.state_dict()  # tied weights under both names
    for name, tensor in actor_weights.items():
        assert torch.equal(engine_weights[name], tensor), name
    total = sum(t.numel() * t.element_size() for t in actor_weights.values())
    assert stats.bytes == total
    expected = len(list(weight_sync.buckets(actor.named_weights(), weight_sync.bucket_bytes(size_mb))))
    assert stats.buckets == expected
    assert (stats.buckets == 1) == (size_mb == 256.0), stats  # the tiny model is 0.3 MiB: several buckets


def payload() -> list[tuple[str, torch.Tensor]]:
    """Every kind of tensor a model may hold: dtypes of 1 to 8 bytes, a scalar, an empty and a
    non-contiguous tensor, and one larger than the bucket."""
    gen = torch.Generator().manual_seed(3)
    return [
        ("w.f32", torch.randn(3, 5, generator=gen)),
        ("w.bf16", torch.randn(7, generator=gen).to(torch.bfloat16)),
        ("w.i64", torch.randint(-9, 9, (2, 2), generator=gen)),
        ("w.bool", torch.rand(9, generator=gen) > 0.5),
        ("w.scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("w.empty", torch.zeros(0, 4)),
        ("w.transposed", torch.randn(4, 6, generator=gen).t()),
        ("w.big", torch.randn(1000, generator=gen)),  # 4000 bytes > the 1024-byte bucket
        ("w.last", torch.randn(3, generator=gen)),
    ]


LIMIT = 1024


class Engine:
    """The rollout side of the protocol: ``update_weights`` reads the stream (only ``reads`` tensors of it
    when given, as an engine that fails to read everything)."""

    def __init__(self, reads: int | None = None) -> None:
        self.reads = reads
        self.got: list[tuple[str, torch.Tensor]] = []

    def update_weights(self, named: Any) -> None:
        for i, (name, tensor) in enumerate(named):
            if self.reads is not None and i >= self.reads:
                return
            self.got.append((name, tensor.clone()))


def _process(rank: int, port: int, results: Any) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=timedelta(seconds=60))
    group = dist.ProcessGroupGloo(dist.PrefixStore("weights", store), rank, 3, timedelta(seconds=60))
    if rank == 0:
        stats = weight_sync.broadcast_send(iter(payload()), group, LIMIT, "cpu")
        results.put((rank, stats.bytes, stats.buckets, None))
        return
    engine = Engine(reads=None if rank == 1 else 2)
    stats = weight_sync.receive_into(engine, group, "cpu")
    results.put((rank, stats.bytes, stats.buckets, [(n, t.dtype, tuple(t.shape), t.tolist()) for n, t in engine.got]))


def test_broadcast_sends_every_tensor_bit_exact_in_buckets() -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_process, args=(r, store.port, results), daemon=True) for r in range(3)]
    for p in procs:
        p.start()
    try:
        got = {rank: rest for rank, *rest in (results.get(timeout=90) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    expected = payload()
    total = sum(t.numel() * t.element_size() for _, t in expected)
    # Buckets of at most 1024 bytes, each tensor 64-byte aligned: f32|bf16|i64|bool|scalar|empty|transposed
    # fit in one, the big one goes alone, the last one opens a third.
    assert got[0][:2] == [total, 3]
    assert got[1][:2] == [total, 3]
    assert got[2][:2] == [total, 3]  # what the engine left unread was drained, so the sender finished
    for rank, reads in ((1, len(expected)), (2, 2)):
        received = got[rank][2]
        assert [r[0] for r in received] == [n for n, _ in expected][:reads]
        for (name, dtype, shape, values), (_, tensor) in zip(received, expected):
            assert dtype == tensor.dtype and shape == tuple(tensor.shape), name
            assert values == tensor.tolist(), name


def test_broadcast_pulls_the_actor_tensors_only_as_buckets_fill() -> None:
    """The sender holds one bucket and the tensor at hand, never the whole model: when a bucket goes out,
    the actor has yielded only the bucket's tensors and the one that did not fit."""
    import torch.distributed as dist

    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=30))  # one rank: itself
    pulled = 0

    def actor_weights() -> Any:
        nonlocal pulled
        for named in payload():
            pulled += 1
            yield named

    class Counting:
        """The group, noting how many tensors the actor had yielded at each broadcast."""

        def __init__(self) -> None:
            self.seen: list[int] = []

        def broadcast(self, tensor: torch.Tensor, root: int) -> Any:
            self.seen.append(pulled)
            return group.broadcast(tensor, root)

    spy = Counting()
    stats = weight_sync.broadcast_send(actor_weights(), spy, LIMIT, "cpu")
    # 3 broadcasts per bucket (sizes, header, bytes): the first 7 tensors go when the 8th (too big) arrives,
    # the 8th alone at once, the last with the end of the stream, then the end marker.
    assert spy.seen == [8, 8, 8, 8, 8, 8, 9, 9, 9, 9]
    assert stats.buckets == 3
