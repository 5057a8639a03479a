"""Moving the actor's weights into the rollout engine, in buckets, without a second full copy of the model.

The rollout protocol stays ``engine.update_weights(Iterable[(name, tensor)])``; what it is given is a
generator that produces the actor's tensors bucket by bucket (at most ``bucket_bytes`` each; a larger
tensor travels alone), so an engine that loads tensors as they come (the ``hf`` engine, vLLM's
``load_weights``) never holds more than one bucket beyond its own weights.

Two transports:

- **in process** (:func:`sync_in_process`): the actor and the engine live in the same process (the
  colocated pool). The actor's tensors are handed over as they are, on their own device: no copy through
  the host, no copy at all until the engine copies them into its own weights.
- **broadcast** (:func:`broadcast_send` / :func:`broadcast_receive`): the engine lives in other processes (a
  separate rollout pool). Rank 0 of the training pool packs each bucket into one flat byte buffer and
  broadcasts it over a process group that holds it and the rollout ranks (gloo on the CPU, NCCL on GPUs);
  every rollout rank unpacks it into views of that buffer, which the engine loads. The other training ranks
  only iterate the actor's weights (a sharded actor gathers each tensor with all of its ranks).

CUDA IPC between processes on one GPU (verl's colocated vLLM path) is not built: it cannot be tested on the
CPU. A rollout engine in another process always receives its weights by broadcast.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_ALIGN = 64  # bytes: every tensor starts at a multiple, so a view of the buffer in any dtype is aligned


@dataclass
class SyncStats:
    """What one sync moved, as seen by one process: tensor bytes (no framing) and buckets."""

    bytes: int = 0
    buckets: int = 0

    def metrics(self) -> dict[str, float]:
        return {"weight_sync/bytes": float(self.bytes), "weight_sync/buckets": float(self.buckets)}


def bucket_bytes(size_mb: float) -> int:
    """``launcher.bucket_size_mb`` in bytes (at least one)."""
    return max(1, int(size_mb * 2**20))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def buckets(named: Iterable[tuple[str, torch.Tensor]], limit: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of ``named`` of at most ``limit`` bytes; a tensor larger than ``limit`` alone."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        n = _nbytes(tensor)
        if bucket and size + n > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket


def _stream(named: Iterable[tuple[str, torch.Tensor]], limit: int,
            stats: SyncStats) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket in buckets(named, limit):
        stats.buckets += 1
        for name, tensor in bucket:
            stats.bytes += _nbytes(tensor)
            yield name, tensor


def _drain(stream: Iterator[Any]) -> None:
    """Consume what an engine left unread: the actor's ranks (and a broadcast's root) go through every tensor,
    so a rank that stopped early would leave the others waiting in a collective."""
    for _ in stream:
        pass


def sync_in_process(source: Any, engine: Any, limit: int) -> SyncStats:
    """Load ``source.named_weights()`` into ``engine`` in this process, bucket by bucket."""
    stats = SyncStats()
    stream = _stream(source.named_weights(), limit, stats)
    engine.update_weights(stream)
    _drain(stream)
    return stats


def iterate_only(source: Any) -> SyncStats:
    """A training rank that neither holds the engine nor sends: take part in the actor's gathers only."""
    _drain(iter(source.named_weights()))
    return SyncStats()


# -- broadcast ---------------------------------------------------------------------------------------------
def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    """Broadcast from the group's rank 0 (``group`` is a ``torch.distributed`` process group object)."""
    group.broadcast(tensor, 0).wait()


def _send_bucket(group: Any, device: str, header: list[tuple[str, str, tuple[int, ...], int, int]],
                 data: torch.Tensor) -> None:
    import torch

    head = json.dumps(header).encode()
    sizes = torch.tensor([len(head), data.numel()], dtype=torch.int64, device=device)
    _broadcast(group, sizes)
    _broadcast(group, torch.frombuffer(bytearray(head), dtype=torch.uint8).to(device))
    _broadcast(group, data)


def broadcast_send(named: Iterable[tuple[str, torch.Tensor]], group: Any, limit: int, device: str) -> SyncStats:
    """The training pool's rank 0: broadcast ``named`` to the group's other ranks, one bucket at a time.

    A bucket is one byte buffer of ``limit`` bytes into which tensors are copied as they arrive (so this
    process holds one bucket and the tensor at hand, never the model twice); a tensor larger than
    ``limit`` is sent from its own memory. Each bucket is three broadcasts: its sizes, its header (name,
    dtype, shape, offset of each tensor) and its bytes; sizes of zero end the stream.
    """
    import torch

    stats = SyncStats()
    buffer: torch.Tensor | None = None
    header: list[tuple[str, str, tuple[int, ...], int, int]] = []
    used = 0

    def flush() -> None:
        nonlocal header, used
        if header:
            assert buffer is not None
            _send_bucket(group, device, header, buffer[:used])
            stats.buckets += 1
            header, used = [], 0

    for name, tensor in named:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        n = flat.numel()
        start = -(-used // _ALIGN) * _ALIGN
        if header and start + n > limit:
            flush()
            start = 0
        entry = (name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), start, n)
        if n > limit:  # alone, from its own memory
            _send_bucket(group, device, [(*entry[:3], 0, n)], flat.to(device))
            stats.buckets += 1
        else:
            if buffer is None:
                buffer = torch.empty(limit, dtype=torch.uint8, device=device)
            buffer[start:start + n].copy_(flat)
            header.append(entry)
            used = start + n
        stats.bytes += n
    flush()
    _broadcast(group, torch.zeros(2, dtype=torch.int64, device=device))
    return stats


def broadcast_receive(group: Any, device: str, stats: SyncStats) -> Iterator[tuple[str, torch.Tensor]]:
    """A rollout rank: the tensors :func:`broadcast_send` sends, as views of each bucket's buffer (a new
    buffer per bucket, so a view the engine keeps stays valid)."""
    import torch

    while True:
        sizes = torch.empty(2, dtype=torch.int64, device=device)
        _broadcast(group, sizes)
        head_len, data_len = (int(v) for v in sizes.tolist())
        if head_len == 0:
            return
        head = torch.empty(head_len, dtype=torch.uint8, device=device)
        _broadcast(group, head)
        header = json.loads(head.cpu().numpy().tobytes())
        data = torch.empty(data_len, dtype=torch.uint8, device=device)
        _broadcast(group, data)
        stats.buckets += 1
        for name, dtype, shape, start, n in header:
            stats.bytes += n
            yield name, data[start:start + n].view(getattr(torch, dtype)).view(shape)


def receive_into(engine: Any, group: Any, device: str) -> SyncStats:
    """A rollout rank: load the broadcast weights into ``engine``."""
    stats = SyncStats()
    stream = broadcast_receive(group, device, stats)
    engine.update_weights(stream)
    _drain(stream)
    return stats
