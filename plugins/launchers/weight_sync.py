"""Moving the actor's weights into the rollout engine, in buckets, without a second full copy of the model.

The rollout protocol stays ``engine.update_weights(Iterable[(name, tensor)])``; what it is given is a
generator that produces the actor's tensors bucket by bucket (at most ``bucket_bytes`` each; a larger
tensor travels alone), so an engine that loads tensors as they come (the ``hf`` engine, vLLM's
``load_weights``) never holds more than one bucket beyond its own weights.

Three transports (:func:`choose` picks one from ``launcher.weight_sync`` and where the processes run):

- **in process** (:func:`sync_in_process`): the actor and the engine live in the same process (the
  colocated pool). The actor's tensors are handed over as they are, on their own device: no copy through
  the host, no copy at all until the engine copies them into its own weights.
- **broadcast** (:func:`broadcast_send` / :func:`broadcast_receive`): the engine lives in other processes on
  other devices (a separate rollout pool). Rank 0 of the training pool packs each bucket into one flat byte
  buffer and broadcasts it over a process group that holds it and the rollout ranks (gloo on the CPU, NCCL
  on GPUs); every rollout rank unpacks it into views of that buffer, which the engine loads. The other
  training ranks only iterate the actor's weights (a sharded actor gathers each tensor with all of its ranks).
- **shared memory** (:func:`ipc_send` / :func:`ipc_receive_into`; ``cuda_ipc``): the engine lives in other
  processes on the same GPU as training rank 0 (NCCL refuses two ranks on one GPU). Rank 0 packs each bucket
  into one of two device buffers, which alternate, and hands every rollout rank a handle to it (CUDA IPC on
  a GPU; on the CPU the same code shares a shared-memory segment, which is how the protocol is tested without
  a GPU); the engine loads views of the buffer itself, and the rollout rank acknowledges each bucket once the
  engine is done with it, so rank 0 may fill that buffer again. The handles and acknowledgements travel over
  a gloo group of rank 0 and the rollout ranks, as small pickled messages: a gloo group has the launcher's
  collective timeout, so a rollout rank that dies or hangs ends the run with the launcher's usual message,
  and it exists under every launcher (pipes would be a second channel to watch, local to one machine).
"""

from __future__ import annotations

import json
import pickle
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from rlx.errors import UserError
from rlx.plugins.modeling.weights import _nbytes, buckets

if TYPE_CHECKING:
    import torch

Mode = Literal["auto", "broadcast", "cuda_ipc"]
Transport = Literal["broadcast", "cuda_ipc"]  # between processes; in process needs no choice

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


def _pack(named: Iterable[tuple[str, torch.Tensor]], limit: int, stats: SyncStats,
          open_bucket: Callable[[], torch.Tensor], send: Callable[[Header, torch.Tensor], None],
          send_alone: Callable[[Header, torch.Tensor], None]) -> None:
    """Copy ``named``'s tensors, as bytes, into buckets of at most ``limit`` bytes (each tensor at a multiple of
    ``_ALIGN``) and hand each full bucket to ``send`` with its header (name, dtype, shape, offset, bytes of
    every tensor). ``open_bucket`` gives the buffer the next bucket is packed into; a tensor larger than
    ``limit`` goes to ``send_alone`` as its own flat bytes."""
    import torch

    buffer: torch.Tensor | None = None
    header: Header = []
    used = 0

    def flush() -> None:
        nonlocal header, used
        if header:
            assert buffer is not None
            send(header, buffer[:used])
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
        if n > limit:
            send_alone([(*entry[:3], 0, n)], flat)
            stats.buckets += 1
        else:
            if not header:
                buffer = open_bucket()
            buffer[start:start + n].copy_(flat)
            header.append(entry)
            used = start + n
        stats.bytes += n
    flush()


def broadcast_send(named: Iterable[tuple[str, torch.Tensor]], group: Any, limit: int, device: str) -> SyncStats:
    """The training pool's rank 0: broadcast ``named`` to the group's other ranks, one bucket at a time.

    A bucket is one byte buffer of ``limit`` bytes into which tensors are copied as they arrive (so this
    process holds one bucket and the tensor at hand, never the model twice); a tensor larger than
    ``limit`` is sent from its own memory. Each bucket is three broadcasts: its sizes, its header (name,
    dtype, shape, offset of each tensor) and its bytes; sizes of zero end the stream.
    """
    import torch

    stats = SyncStats()
    buffer: list[torch.Tensor] = []  # the one bucket buffer, made at the first bucket

    def open_bucket() -> torch.Tensor:
        if not buffer:
            buffer.append(torch.empty(limit, dtype=torch.uint8, device=device))
        return buffer[0]

    _pack(named, limit, stats, open_bucket,
          send=lambda header, data: _send_bucket(group, device, header, data),
          send_alone=lambda header, flat: _send_bucket(group, device, header, flat.to(device)))
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


# -- choosing a transport ----------------------------------------------------------------------------------
def choose(mode: Mode, sender_gpu: str | None, receiver_gpus: list[str | None]) -> Transport:
    """The transport between training rank 0 and a separate rollout pool, from ``launcher.weight_sync`` and
    the physical GPU (its UUID, None on the CPU) of rank 0 and of each rollout rank. UUIDs, not indices:
    processes may see the GPUs under different ``CUDA_VISIBLE_DEVICES``."""
    same = [gpu is not None and gpu == sender_gpu for gpu in receiver_gpus]
    if mode == "cuda_ipc" or (mode == "auto" and sender_gpu is not None and any(same)):
        if sender_gpu is None:
            raise UserError("launcher.weight_sync=cuda_ipc needs CUDA GPUs, but this run is on the CPU.",
                            "Use launcher.weight_sync=auto or broadcast on the CPU.")
        if not all(same):
            apart = [r for r, s in enumerate(same) if not s]
            raise UserError(f"CUDA IPC reaches only processes on training rank 0's GPU, but rollout pool ranks "
                            f"{apart} run on other GPUs (and NCCL cannot broadcast to the others, which share a "
                            "GPU with rank 0).",
                            "Put the whole rollout pool on rank 0's GPU (launcher.weight_sync=cuda_ipc) or give "
                            "every process a GPU of its own (launcher.weight_sync=broadcast).")
        return "cuda_ipc"
    if any(same):  # mode == "broadcast"
        raise UserError("launcher.weight_sync=broadcast, but a rollout process shares training rank 0's GPU: "
                        "NCCL refuses two ranks on one GPU.",
                        "Use launcher.weight_sync=auto or cuda_ipc, or give every process a GPU of its own.")
    return "broadcast"


# -- shared memory: CUDA IPC on a GPU, a shared-memory segment on the CPU -----------------------------------
Header = list[tuple[str, str, tuple[int, ...], int, int]]


def _post(group: Any, obj: Any, dst: int) -> list[Any]:
    """Start sending ``obj`` pickled (its length, then its bytes) to ``dst``; the returned works hold the
    buffers until waited on. Sends are never waited on at once: each side may be sending to the other."""
    import torch

    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    return [(group.send([size], dst, 0), size), (group.send([data], dst, 0), data)]


def _take(group: Any, src: int) -> Any:
    import torch

    size = torch.empty(1, dtype=torch.int64)
    group.recv([size], src, 0).wait()
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    group.recv([data], src, 0).wait()
    return pickle.loads(data.numpy().tobytes())


def _settle(works: list[Any]) -> None:
    for work, _ in works:
        work.wait()


def _handle(memory: torch.Tensor) -> bytes:
    """What another process needs to map ``memory`` (torch's own sharing: a CUDA IPC handle of the
    allocation, or on the CPU a file descriptor of the shared-memory segment, passed by multiprocessing's
    resource sharer). One per receiver: a CPU descriptor can be taken only once."""
    from multiprocessing.reduction import ForkingPickler

    # Importing torch.multiprocessing registers how storages pickle for sharing (ForkingPickler).
    from torch.multiprocessing.reductions import reduce_tensor

    return bytes(ForkingPickler.dumps(reduce_tensor(memory)))


def _open(handle: bytes) -> torch.Tensor:
    """The sender's memory, mapped into this process."""
    import torch

    rebuild, args = pickle.loads(handle)
    if rebuild.__name__ == "rebuild_cuda_tensor":
        # Argument 6 is the sender's device index, which names another GPU here when the processes see
        # different CUDA_VISIBLE_DEVICES; choose() checked that this process's GPU is the sender's.
        args = (*args[:6], torch.cuda.current_device(), *args[7:])
    return rebuild(*args)


def _sync_device(memory: torch.Tensor) -> None:
    """Wait until every copy this process queued on the GPU has finished: the sender before another
    process reads a bucket (its copies run on its own streams, which the reader cannot wait on), the
    receiver before saying it is done reading one."""
    import torch

    if memory.is_cuda:
        torch.cuda.synchronize(memory.device)


class _Sender:
    """Training rank 0's side: buckets handed out and not yet acknowledged by every rollout rank, oldest
    first, each with the memory it lives in (kept alive until then) and its slot (0 or 1, the buffer it
    was packed into; None for a tensor sent from its own memory)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.receivers = range(1, group.size())
        self.pending: deque[tuple[int | None, torch.Tensor, list[Any]]] = deque()
        self.sent = 0

    def send(self, header: Header, memory: torch.Tensor, slot: int | None) -> None:
        while len(self.pending) >= 2:  # at most two buckets in flight: the memory held stays two buckets
            self.settle_oldest()
        _sync_device(memory)
        works = [w for r in self.receivers for w in _post(self.group, (header, slot, _handle(memory)), r)]
        self.pending.append((slot, memory, works))
        self.sent += 1

    def settle_oldest(self) -> None:
        import torch

        works = self.pending[0][2]  # popped only once acknowledged: its memory stays alive until then
        expected = self.sent - len(self.pending)
        for r in self.receivers:
            ack = torch.empty(1, dtype=torch.int64)
            self.group.recv([ack], r, 0).wait()
            if int(ack.item()) != expected:
                raise RuntimeError(f"weight sync: rollout rank {r} acknowledged bucket {int(ack.item())}, "
                                   f"expected {expected}")
        _settle(works)
        self.pending.popleft()

    def free(self, slot: int) -> None:
        """Return once no rollout rank reads buffer ``slot`` any more."""
        while any(s == slot for s, _, _ in self.pending):
            self.settle_oldest()

    def finish(self) -> None:
        """End the stream; return once every rollout rank has released every buffer."""
        import torch

        works = [w for r in self.receivers for w in _post(self.group, None, r)]
        while self.pending:
            self.settle_oldest()
        for r in self.receivers:  # the engine has returned and dropped every view
            self.group.recv([torch.empty(1, dtype=torch.int64)], r, 0).wait()
        _settle(works)


def _shared(n: int, device: str) -> torch.Tensor:
    import torch

    memory = torch.empty(n, dtype=torch.uint8, device=device)
    return memory if memory.is_cuda else memory.share_memory_()


def ipc_send(named: Iterable[tuple[str, torch.Tensor]], group: Any, limit: int, device: str) -> SyncStats:
    """Training rank 0: hand ``named`` to the group's other ranks (on this GPU, or on the CPU) through two
    shared buffers of ``limit`` bytes that alternate: while the rollout ranks load one, the next bucket is
    packed into the other. A tensor larger than ``limit`` is shared from its own memory on the GPU (from a
    shared copy on the CPU, where sharing would move the actor's own tensor into shared memory)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.ipc_collect()  # buffers of the previous sync that a rollout rank released late
    stats = SyncStats()
    sender = _Sender(group)
    slots: list[torch.Tensor | None] = [None, None]
    slot = 0

    def open_bucket() -> torch.Tensor:
        sender.free(slot)
        if slots[slot] is None:
            slots[slot] = _shared(limit, device)
        memory = slots[slot]
        assert memory is not None
        return memory

    def send(header: Header, data: torch.Tensor) -> None:
        nonlocal slot
        sender.send(header, data, slot)
        slot = 1 - slot

    def send_alone(header: Header, flat: torch.Tensor) -> None:
        if torch.device(device).type == "cuda":
            own = flat.to(device)
        else:
            own = _shared(flat.numel(), device)
            own.copy_(flat)
        sender.send(header, own, None)

    _pack(named, limit, stats, open_bucket, send, send_alone)
    sender.finish()
    return stats

def ipc_receive(group: Any, stats: SyncStats) -> Iterator[tuple[str, torch.Tensor]]:
    """A rollout rank: the tensors :func:`ipc_send` shares, as views of the sender's buffers. A view is
    valid until the engine asks for a tensor of the next bucket: then this rank waits for the engine's
    copies to finish and acknowledges the bucket, and the sender may overwrite it."""
    import torch

    held: dict[int | None, torch.Tensor] = {}  # the buffers mapped here, kept mapped for the whole sync
    acks: list[Any] = []
    count = 0
    while True:
        message = _take(group, 0)
        if message is None:
            break
        header, slot, handle = message
        memory = _open(handle)
        if slot is not None:
            held[slot] = memory
        stats.buckets += 1
        for name, dtype, shape, start, n in header:
            stats.bytes += n
            yield name, memory[start:start + n].view(getattr(torch, dtype)).view(shape)
        _sync_device(memory)
        del memory
        ack = torch.tensor([count], dtype=torch.int64)
        acks.append((group.send([ack], 0, 0), ack))
        count += 1
    _settle(acks)


def ipc_receive_into(engine: Any, group: Any) -> SyncStats:
    """A rollout rank: load the shared weights into ``engine``, then tell the sender that every buffer is
    released (the engine has returned, so it holds no view any more)."""
    import torch

    stats = SyncStats()
    stream = ipc_receive(group, stats)
    engine.update_weights(stream)
    _drain(stream)
    del stream
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    done = torch.zeros(1, dtype=torch.int64)
    group.send([done], 0, 0).wait()
    return stats
