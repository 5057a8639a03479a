"""The ``local`` launcher: the roles' workers on this machine.

- ``launcher.nproc=1`` (the default): every role in this process, one worker each (CPU or one GPU).
- ``launcher.nproc=N`` (``rlx train --nproc N``): N processes with ``torch.distributed`` initialised (gloo
  on the CPU, NCCL on GPUs, one GPU per process). This process is rank 0: it drives the loop and is also
  a worker; the others are spawned. Every trained role (actor, reference, critic) is built in each of the
  N processes (the training pool); the reward runs in this process. Each rank gets its data-parallel
  shard of every call.
- Placement of the rollout engine: ``launcher.rollout_nproc=0`` (the default) builds it in every training
  process (colocated, as verl's hybrid engine): it sleeps while the models train, wakes up before new
  weights are loaded and responses generated (``launcher.sleep_rollout``), and takes the actor's weights
  inside the process. ``launcher.rollout_nproc=K`` starts K more processes that hold only the rollout
  engine (a separate pool; world size N + K): ``generate`` goes to them, training calls to the training
  pool, and after each update rank 0 sends the actor's weights to them in buckets
  (``rlx.plugins.launchers.weight_sync``):
  by broadcast when they have GPUs of their own, by CUDA IPC when they share training rank 0's GPU
  (``launcher.weight_sync``). Each pool's processes form their own default ``torch.distributed`` group (the
  training pool's is the one the backends use); commands and the weights travel over groups of their own.
- Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` set), the same with torchrun's
  processes (one pool): rank 0 drives, the other ranks serve.

Commands travel from rank 0 to each worker over a gloo group of their own (objects: method names,
losses, data shards; point to point, so a command reaches only the ranks of the role it names). A
spawned worker that fails reports its error and dies; rank 0 then names the rank and its error, stops
every worker and exits (status 1, or 2 for a user error): never a hang, never an orphan (workers also
die with rank 0).
"""


from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlx import Component, hookimpl
from rlx.batch import Batch, concat_rollouts
from rlx.context import BuildContext
from rlx.errors import UserError, describe_exception
from rlx.protocols import DispatchInfo

Where = Literal["workers", "driver"]
Phase = Literal["generate", "train"]
ROLLOUT_ROLES = frozenset({"rollout"})  # roles placed in the rollout pool when there is one


class LocalOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    nproc: int = Field(1, ge=1, le=1024, description="Worker processes of the training pool (one per GPU on a "
                       "GPU machine).")
    rollout_nproc: int = Field(0, ge=0, le=1024, description="Processes that hold only the rollout engine (a "
                               "separate pool, on GPUs of their own or on training rank 0's GPU: "
                               "launcher.weight_sync; the actor's weights reach them after each update). 0: the "
                               "engine lives in every training process (colocated).")
    bucket_size_mb: float = Field(256.0, gt=0, le=2**20, description="The actor's weights reach the rollout "
                                  "engine in buckets of at most this many MiB (a larger tensor travels alone).")
    sleep_rollout: bool = Field(True, description="A colocated rollout engine sleeps (frees what its device "
                                "memory holds) while the models train, and wakes up before it takes new weights "
                                "and generates.")
    weight_sync: Literal["auto", "broadcast", "cuda_ipc"] = Field(
        "auto", description="How a separate rollout pool gets the actor's weights on GPUs. broadcast: the pool's "
        "processes have GPUs of their own and training rank 0 broadcasts over NCCL. cuda_ipc: the pool's "
        "processes run on training rank 0's GPU and map its buffers (CUDA IPC). auto: broadcast when the machine "
        "has a GPU for every process, cuda_ipc otherwise. On the CPU: broadcast over gloo. A colocated engine "
        "(launcher.rollout_nproc=0) takes them in process whatever this says.")
    timeout_s: float = Field(1800.0, gt=0, description="Most seconds a collective between workers may wait "
                             "before the run stops with an error naming the rank (a hung worker).")


# -- data-parallel dispatch -------------------------------------------------------------------------
def shard(value: Any, parts: int) -> list[Any]:
    """Split a call's data argument by data-parallel rank: a batch into ``parts`` nearly equal chunks, a
    list of batches (mini-batches of an update) chunk by chunk; anything else goes whole to every rank."""
    if parts == 1:
        return [value]
    if isinstance(value, Batch):
        if len(value) < parts:
            raise ValueError(f"{len(value)} rows cannot be split over {parts} data-parallel ranks")
        return value.chunk(parts)
    if isinstance(value, list) and value and all(isinstance(v, Batch) for v in value):
        per_item = [shard(v, parts) for v in value]
        return [[chunks[r] for chunks in per_item] for r in range(parts)]
    return [value] * parts


def balanced_roles(config: Any) -> frozenset[str]:
    """The roles whose calls are balanced over data-parallel ranks by tokens: those with dynamic batch sizes
    (``actor.use_dynamic_bsz``, which the reference follows, and ``critic.use_dynamic_bsz``), as verl
    balances under dynamic batch sizes. Without it a rank's micro-batches are counted in rows, and moving
    rows between ranks would only change the float order of the update's sums."""
    if config is None:
        return frozenset()
    return frozenset(role for role, on in (("actor", config.actor.use_dynamic_bsz),
                                           ("ref", config.actor.use_dynamic_bsz),
                                           ("critic", config.critic.use_dynamic_bsz)) if on)


def balance(value: Any, parts: int) -> tuple[Any, list[int] | None]:
    """A call's data reordered so that :func:`shard` gives every data-parallel rank as many rows as before
    with nearly equal token counts (``rlx.step.balanced_order``), and the order to undo on its per-row
    results (None: nothing to undo; the mini-batches of an update, each balanced, return metrics)."""
    from rlx.step import balance_for_ranks, balanced_order

    if isinstance(value, Batch):
        order = balanced_order(value, parts)
        return (value, None) if order is None else (value.index(order), order)
    if isinstance(value, list) and value and all(isinstance(v, Batch) for v in value):
        return [balance_for_ranks(v, parts) for v in value], None
    return value, None


def unbalance(result: Any, order: list[int] | None) -> Any:
    """Per-row results of a balanced call back in the rows' original order."""
    if order is None or not isinstance(result, Batch):
        return result
    inverse = [0] * len(order)
    for position, row in enumerate(order):
        inverse[row] = position
    return result.index(inverse)


def gather(results: list[Any]) -> Any:
    """Combine the data-parallel ranks' results: batches are concatenated (rollouts of different response
    widths padded first), metric dicts averaged, lists (one entry per optimizer step) entry by entry."""
    if len(results) == 1:
        return results[0]
    first = results[0]
    if isinstance(first, Batch):
        return concat_rollouts(results, int(first.meta.get("pad_token_id", 0)))
    if isinstance(first, dict):
        return {k: sum(r[k] for r in results) / len(results) for k in first}
    if isinstance(first, list):
        return [gather([r[i] for r in results]) for i in range(len(first))]
    return results


def dispatch_info(worker: Any, rank: int, world_size: int) -> DispatchInfo:
    """What a worker reports (``worker.dispatch_info()``); by default each rank is its own data-parallel rank."""
    info = getattr(worker, "dispatch_info", None)
    return info() if callable(info) else DispatchInfo(rank, world_size, True)


# -- one process ---------------------------------------------------------------------------------------
class LocalWorkerGroup:
    """Workers of one role in this process (the controller calls the group, never a worker)."""

    def __init__(self, role: str, workers: list[Any]) -> None:
        self.role = role
        self.workers = workers
        self.world_size = len(workers)

    def call(self, method: str, batch: Batch | list[Batch], *args: Any, **kwargs: Any) -> Any:
        parts = shard(batch, self.world_size)
        return gather([getattr(w, method)(p, *args, **kwargs) for w, p in zip(self.workers, parts)])

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(w, method)(*args, **kwargs) for w in self.workers]

    def shutdown(self) -> None:
        for w in self.workers:
            close = getattr(w, "close", None)
            if close is not None:
                close()


class _PhaseSwitch:
    """The generate / train phase of a launcher whose rollout engine shares devices with training: the
    engine sleeps while the models train and wakes up before it takes new weights and generates. The
    engine decides what sleeping frees (the ``hf`` engine moves its weights to host memory on a GPU and does
    nothing on the CPU). An engine in a pool of its own never sleeps: nothing else needs its memory."""

    current: Phase = "generate"  # engines are built awake
    colocated_rollout: Any = None  # the rollout worker group, when it shares devices with training
    sleep_rollout: bool = True

    def phase(self, name: Phase) -> dict[str, float]:
        if name == self.current:
            return {}
        self.current = name
        if self.colocated_rollout is None or not self.sleep_rollout:
            return {}
        method = "sleep" if name == "train" else "wake_up"
        start = time.perf_counter()
        self.colocated_rollout.call_all(method)
        return {f"timing/{method}": time.perf_counter() - start}


class LocalLauncher(_PhaseSwitch):
    def __init__(self, options: LocalOptions | None = None) -> None:
        self.options = options or LocalOptions()
        self.sleep_rollout = self.options.sleep_rollout
        self.groups: list[LocalWorkerGroup] = []

    def create_group(self, role: str, build: Callable[[int, int], Any], where: Where = "workers") -> LocalWorkerGroup:
        group = LocalWorkerGroup(role, [build(0, 1)])
        self.groups.append(group)
        if role in ROLLOUT_ROLES and where == "workers":
            self.colocated_rollout = group
        return group

    def transfer_weights(self, src: LocalWorkerGroup, dst: LocalWorkerGroup) -> dict[str, float]:
        """Hand the source role's weights to the destination workers (actor -> rollout), in process."""
        from rlx.plugins.launchers.weight_sync import bucket_bytes, sync_in_process

        limit = bucket_bytes(self.options.bucket_size_mb)
        stats = [sync_in_process(src.workers[0], worker, limit) for worker in dst.workers]
        return stats[0].metrics()

    def abort(self) -> None:
        """Nothing runs elsewhere."""

    def shutdown(self) -> None:
        for g in self.groups:
            g.shutdown()
        self.groups.clear()


# -- several processes ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """Global ranks ``0..train-1`` are the training pool, ``train..train+rollout-1`` the rollout pool
    (none: the rollout engine is colocated in the training pool). On GPUs every training rank takes the GPU
    of its index; the rollout pool takes the next ones, or, with ``share_gpu``, runs on training rank 0's."""

    train: int
    rollout: int = 0
    share_gpu: bool = False

    def gpu(self, rank: int) -> int:
        return 0 if self.share_gpu and self.in_rollout_pool(rank) else rank

    @property
    def world(self) -> int:
        return self.train + self.rollout

    def in_rollout_pool(self, rank: int) -> bool:
        return rank >= self.train

    def ranks(self, role: str) -> list[int]:
        """The global ranks where ``role`` is built."""
        if self.rollout and role in ROLLOUT_ROLES:
            return list(range(self.train, self.world))
        return list(range(self.train))

    def pool_rank(self, rank: int) -> tuple[int, int]:
        """(rank within its pool, the pool's size)."""
        return (rank - self.train, self.rollout) if self.in_rollout_pool(rank) else (rank, self.train)


def _send_object(group: Any, obj: Any, dst: int) -> list[Any]:
    """Start sending ``obj`` (pickled: its length, then its bytes) to ``dst`` of ``group``; the returned works
    hold the buffers and must be waited on."""
    import torch

    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    return [(group.send([size], dst, 0), size), (group.send([data], dst, 0), data)]


def _wait(works: list[Any]) -> None:
    for work, _ in works:
        work.wait()


def _recv_object(group: Any, src: int) -> Any:
    import torch

    size = torch.empty(1, dtype=torch.int64)
    group.recv([size], src, 0).wait()
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    group.recv([data], src, 0).wait()
    return pickle.loads(data.numpy().tobytes())


class _Host:
    """The workers living in one process, and the loop by which rank 0 drives them.

    ``control``: a gloo group of every process (rank 0 sends each command and data share to the ranks it
    concerns and collects their results, point to point). ``weights``: on rank 0 and the rollout pool's
    ranks, when there is one, the group over which the actor's weights are broadcast.
    """

    def __init__(self, rank: int, layout: Layout, control: Any, weights: Any = None, comm_device: str = "cpu",
                 transport: str = "broadcast") -> None:
        self.rank, self.layout = rank, layout
        self.control, self.weights, self.comm_device = control, weights, comm_device
        self.transport = transport  # between rank 0 and a rollout pool: broadcast or cuda_ipc
        self.roles: dict[str, Any] = {}

    # The driver's half of a command ------------------------------------------------------------------
    def command(self, cmd: tuple[Any, ...], shares: list[Any] | None, ranks: list[int]) -> list[Any]:
        """Run ``cmd`` on ``ranks`` (``ranks[i]`` gets ``shares[i]``); their results, in the same order."""
        shares = shares or [None] * len(ranks)
        sends = [_send_object(self.control, (cmd, share), r) for r, share in zip(ranks, shares) if r != self.rank]
        results = {r: self.execute(cmd, share) for r, share in zip(ranks, shares) if r == self.rank}
        for r in ranks:
            if r != self.rank:
                results[r] = _recv_object(self.control, r)
        for works in sends:
            _wait(works)
        return [results[r] for r in ranks]

    def stop(self) -> None:
        for r in range(1, self.layout.world):
            _wait(_send_object(self.control, (("stop",), None), r))

    # Every rank's half -------------------------------------------------------------------------------
    def serve(self) -> None:
        """Ranks > 0: run the driver's commands until it says stop. An error in a command is fatal."""
        # Workers wait here while the driver works alone (scoring rewards, logging, writing checkpoint
        # markers) or drives the other pool, so launcher.timeout_s must exceed that; a dead driver ends them
        # through their parent-death signal.
        while True:
            cmd, share = _recv_object(self.control, 0)
            if cmd[0] == "stop":
                return
            _wait(_send_object(self.control, self.execute(cmd, share), 0))

    def execute(self, cmd: tuple[Any, ...], share: Any) -> Any:
        op = cmd[0]
        if op == "build":
            _, role, build = cmd
            rank, size = self.layout.pool_rank(self.rank)
            worker = build(rank, size)
            self.roles[role] = worker
            return dispatch_info(worker, rank, size)
        if op == "call":
            _, role, method, args, kwargs = cmd
            return getattr(self.roles[role], method)(share, *args, **kwargs)
        if op == "call_all":
            _, role, method, args, kwargs = cmd
            return getattr(self.roles[role], method)(*args, **kwargs)
        if op == "sync":
            _, src, dst, limit = cmd
            return self.sync(self.roles.get(src), self.roles.get(dst), limit).metrics()
        if op == "close":
            for worker in self.roles.values():
                close = getattr(worker, "close", None)
                if close is not None:
                    close()
            self.roles.clear()
            return None
        raise ValueError(f"unknown command {op!r}")

    def sync(self, source: Any, engine: Any, limit: int) -> Any:
        """This process's part of one actor -> rollout sync (``rlx.plugins.launchers.weight_sync``)."""
        from rlx.plugins.launchers import weight_sync

        if source is not None and engine is not None:
            return weight_sync.sync_in_process(source, engine, limit)
        ipc = self.transport == "cuda_ipc"
        if source is not None and self.weights is not None:
            send = weight_sync.ipc_send if ipc else weight_sync.broadcast_send
            return send(source.named_weights(), self.weights, limit, self.comm_device)
        if source is not None:
            return weight_sync.iterate_only(source)
        if engine is not None and ipc:
            return weight_sync.ipc_receive_into(engine, self.weights)
        if engine is not None:
            return weight_sync.receive_into(engine, self.weights, self.comm_device)
        return weight_sync.SyncStats()


PROCESS_GROUP_USED = False  # this process took part in a torch.distributed group (the CLI's exit reads it)


def _use_cuda(device: str) -> bool:
    import torch

    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def _prepare(rank: int, device: str, threads: int | None, gpu: int | None = None) -> bool:
    """Threads and this process's GPU (``gpu``, or its local rank's); whether it uses CUDA."""
    import torch

    global PROCESS_GROUP_USED
    PROCESS_GROUP_USED = True

    if threads:
        torch.set_num_threads(threads)
    use_cuda = _use_cuda(device)
    if use_cuda:
        torch.cuda.set_device(gpu if gpu is not None else int(os.environ.get("LOCAL_RANK", rank)))
    return use_cuda


def _set_up_process(rank: int, world_size: int, init_method: str, timeout_s: float, device: str,
                    threads: int | None) -> None:
    """One pool of ``world_size`` processes through ``init_method`` (torchrun's environment, Ray's actors)."""
    import torch.distributed as dist

    use_cuda = _prepare(rank, device, threads)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))


def _group(backend: str, store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    """A process group outside the default one (it may join processes of different pools)."""
    import torch.distributed as dist

    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def weights_group(rank: int, layout: Layout, store: Any, use_cuda: bool, timeout_s: float,
                  transport: str = "broadcast") -> Any:
    """With a rollout pool, on rank 0 and the rollout ranks: the group over which rank 0 sends the actor's
    weights (a broadcast: NCCL on GPUs, gloo on the CPU; CUDA IPC: gloo, for the handles and
    acknowledgements); None elsewhere."""
    import torch.distributed as dist

    if not layout.rollout or not (rank == 0 or layout.in_rollout_pool(rank)):
        return None
    nccl = use_cuda and transport == "broadcast"
    return _group("nccl" if nccl else "gloo", dist.PrefixStore("rlx/weights", store),
                  0 if rank == 0 else rank - layout.train + 1, layout.rollout + 1, timedelta(seconds=timeout_s))


def _gpu_uuid() -> str:
    import torch

    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def _transport(rank: int, layout: Layout, store: Any, use_cuda: bool, mode: Any) -> str:
    """Rank 0 and the rollout ranks: how the weights travel between them. Each publishes its GPU's UUID in
    the store; rank 0 chooses (``rlx.plugins.launchers.weight_sync.choose``: a user error there ends the run
    before anything is built) and publishes the choice, which the rollout ranks read."""
    from rlx.plugins.launchers import weight_sync

    store.set(f"rlx/gpu/{rank}", _gpu_uuid() if use_cuda else "")
    if rank != 0:
        return store.get("rlx/transport").decode()
    gpus = [store.get(f"rlx/gpu/{r}").decode() or None for r in range(layout.train, layout.world)]
    chosen = weight_sync.choose(mode, _gpu_uuid() if use_cuda else None, gpus)
    store.set("rlx/transport", chosen)
    return chosen


def _join(rank: int, layout: Layout, store: Any, timeout_s: float, device: str, threads: int | None,
          mode: Any = "auto") -> _Host:
    """Set up a process of a run that rlx started: its pool's default group (the training pool's is the one
    the backends use; the rollout pool has none, its engine sets up what it needs), the control group of
    every process and, with a rollout pool, the weights group of rank 0 and the rollout ranks (``mode``:
    ``launcher.weight_sync``, read on rank 0)."""
    import torch.distributed as dist

    use_cuda = _prepare(rank, device, threads, layout.gpu(rank))
    timeout = timedelta(seconds=timeout_s)
    transport = "broadcast"
    if layout.rollout and (rank == 0 or layout.in_rollout_pool(rank)):
        transport = _transport(rank, layout, store, use_cuda, mode)
    if not layout.in_rollout_pool(rank):
        dist.init_process_group("nccl" if use_cuda else "gloo", store=dist.PrefixStore("rlx/train", store),
                                rank=rank, world_size=layout.train, timeout=timeout)
    control = _group("gloo", dist.PrefixStore("rlx/control", store), rank, layout.world, timeout)
    weights = weights_group(rank, layout, store, use_cuda, timeout_s, transport)
    return _Host(rank, layout, control, weights, "cuda" if use_cuda else "cpu", transport)


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent (rank 0) dies, so no worker is left orphaned."""
    if sys.platform != "linux":
        return
    import ctypes
    import signal

    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _worker_main(rank: int, layout: Layout, port: int, timeout_s: float, device: str, threads: int | None,
                 seed: int, errors: Any) -> None:
    """Entry point of a spawned worker process."""
    _die_with_parent()
    # Rank 0 prints what the user needs; progress bars from every rank would only repeat it (and tqdm's
    # lock would outlive this process, which ends with os._exit).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        import torch
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, layout.world, is_master=False, timeout=timedelta(seconds=timeout_s))
        host = _join(rank, layout, store, timeout_s, device, threads)
        torch.manual_seed(seed + rank)
        host.serve()
    except BaseException as exc:
        user = isinstance(exc, UserError)
        errors.send((rank, user, str(exc) if user else describe_exception(exc)))
        os._exit(2 if user else 1)
    os._exit(0)


def plan(options: LocalOptions, gpus: int | None) -> Layout:
    """The pools of a run that rlx starts, on ``gpus`` visible GPUs (None: the CPU). A rollout pool shares
    training rank 0's GPU (and gets the weights by CUDA IPC) with ``launcher.weight_sync=cuda_ipc``, or with
    ``auto`` when the machine has no GPU left for it; otherwise every process takes a GPU of its own."""
    train, rollout, mode = options.nproc, options.rollout_nproc, options.weight_sync
    if gpus is None:
        if mode == "cuda_ipc":
            raise UserError("launcher.weight_sync=cuda_ipc needs CUDA GPUs, but this run is on the CPU.",
                            "Use launcher.weight_sync=auto or broadcast on the CPU (gloo).")
        return Layout(train, rollout)
    share = rollout > 0 and (mode == "cuda_ipc" or (mode == "auto" and train + rollout > gpus))
    layout = Layout(train, rollout, share)
    need = train if share else layout.world
    if need > gpus:
        pools = (f" ({train} training + {rollout} rollout, launcher.rollout_nproc, launcher.weight_sync={mode})"
                 if rollout and not share else "")
        shared = (" or let the rollout pool share training rank 0's GPU (launcher.weight_sync=auto or cuda_ipc)"
                  if mode == "broadcast" else "")
        raise UserError(f"{need} processes{pools} on this machine need as many GPUs, but {gpus} are visible.",
                        f"Use {gpus} processes or fewer (one process per GPU){shared}.")
    return layout


class ProcessWorkerGroup:
    """One role's workers, one per process (or Ray actor) of its pool (global ``ranks``); each one's
    data-parallel rank comes from its worker. ``launcher.run(cmd, shares, ranks)`` runs a command on those
    ranks and returns their results."""

    def __init__(self, launcher: Any, role: str, infos: list[DispatchInfo], ranks: list[int] | None = None) -> None:
        self.launcher, self.role, self.infos = launcher, role, infos
        self.ranks = ranks if ranks is not None else list(range(len(infos)))
        self.world_size = len(infos)
        self.dp_size = infos[0].dp_size
        self.balanced = self.dp_size > 1 and role in getattr(launcher, "balanced_roles", frozenset())

    def call(self, method: str, batch: Batch | list[Batch], *args: Any, **kwargs: Any) -> Any:
        batch, order = balance(batch, self.dp_size) if self.balanced else (batch, None)
        parts = shard(batch, self.dp_size)
        shares = [parts[info.dp_rank] for info in self.infos]
        results = self.launcher.run(("call", self.role, method, args, kwargs), shares, self.ranks)
        collected = sorted(((info.dp_rank, r) for info, r in zip(self.infos, results) if info.collect),
                           key=lambda pair: pair[0])
        return unbalance(gather([r for _, r in collected]), order)

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self.launcher.run(("call_all", self.role, method, args, kwargs), None, self.ranks)

    def shutdown(self) -> None:
        """The launcher closes every role at once."""


class ProcessLauncher(_PhaseSwitch):
    """The training pool's N processes (and the rollout pool's K) with torch.distributed; this process is
    rank 0 (see the module doc)."""

    balanced_roles: frozenset[str] = frozenset()  # see balanced_roles(); set from the config by build()

    def __init__(self, options: LocalOptions, device: str, seed: int) -> None:
        import multiprocessing as mp

        import torch
        import torch.distributed as dist

        self.options = options
        self.sleep_rollout = options.sleep_rollout
        self.children: list[Any] = []
        self.stopping = self.failed = False
        self.lock = threading.Lock()
        under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
        if under_torchrun:
            if options.rollout_nproc:
                raise UserError(f"launcher.rollout_nproc={options.rollout_nproc} needs processes that rlx starts "
                                "itself; under torchrun every process is in one pool.",
                                "Run `rlx train --nproc N launcher.rollout_nproc=K` without torchrun, or leave "
                                "launcher.rollout_nproc at 0 (the rollout engine colocated with training).")
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            self.layout = Layout(world)
        else:
            rank = 0
            world = options.nproc + options.rollout_nproc
        use_cuda = _use_cuda(device)
        if use_cuda and not torch.cuda.is_available():
            raise UserError("trainer.device=cuda, but no CUDA GPU is visible.",
                            "Run on a GPU machine, or use trainer.device=cpu (gloo).")
        count = torch.cuda.device_count() if use_cuda else None
        if not under_torchrun:
            self.layout = plan(options, count)
        if count is not None:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            if under_torchrun and local > count:
                raise UserError(f"{local} processes on this machine need as many GPUs, but {count} are visible.",
                                f"Use {count} processes or fewer in all (one process per GPU).")
            if not dist.is_nccl_available():
                raise UserError("This torch build has no NCCL, which GPU workers need.",
                                "Install a CUDA build of torch, or use trainer.device=cpu.")
        threads = None if use_cuda else max(1, (os.cpu_count() or 1) // world)
        self.world_size = world
        if under_torchrun:
            _set_up_process(rank, world, "env://", options.timeout_s, device, threads)
            control = dist.new_group(backend="gloo", timeout=timedelta(seconds=options.timeout_s))
            self.host = _Host(rank, self.layout, control)
            if rank != 0:  # this process serves rank 0 and never runs the driver's loop
                try:
                    self.host.serve()
                except BaseException as exc:
                    print(f"Error: worker rank {rank} failed: {describe_exception(exc)}", file=sys.stderr)
                    os._exit(2 if isinstance(exc, UserError) else 1)
                os._exit(0)
            return
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=options.timeout_s))
        ctx = mp.get_context("spawn")
        # One pipe per worker for its last words (a pipe, not a queue: no semaphore left behind at exit).
        self.error_pipes: dict[int, Any] = {}
        for r in range(1, world):
            self.error_pipes[r], errors = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker_main, name=f"rlx-worker-{r}", daemon=True,
                               args=(r, self.layout, store.port, options.timeout_s, device, threads, seed, errors))
            proc.start()
            self.children.append(proc)
        threading.Thread(target=self._watch, name="rlx-worker-watchdog", daemon=True).start()
        self.store = store  # the rendezvous lives as long as this process serves it
        try:
            self.host = _join(0, self.layout, store, options.timeout_s, device, threads, options.weight_sync)
        except UserError:  # e.g. no transport reaches the rollout pool: the workers wait in the rendezvous
            self._kill_children()
            raise
        if self.layout.rollout:
            where = ("on training rank 0's GPU" if self.layout.share_gpu else
                     "on GPUs of their own" if use_cuda else "on the CPU")
            print(f"Weight sync: {self.host.transport} (rank 0 to {self.layout.rollout} rollout process(es) "
                  f"{where}, buckets of {options.bucket_size_mb:g} MiB).", flush=True)

    def _watch(self) -> None:
        """Rank 0's watchdog: a worker that dies ends the run at once, naming it (rank 0 may be blocked in
        a collective with it and could not notice otherwise)."""
        from multiprocessing.connection import wait

        children = list(self.children)
        alive = {p.sentinel: r for r, p in enumerate(children, start=1)}
        while alive and not self.stopping:
            for sentinel in wait(list(alive), timeout=1.0):
                alive.pop(sentinel)
                if self.stopping:
                    return
                failure = self._dead_worker(children)
                if failure is not None and self._report(*failure):
                    os._exit(2 if failure[0] else 1)

    def _dead_worker(self, children: list[Any]) -> tuple[bool, str] | None:
        """(user error?, message) about a worker that has died, waiting briefly for it to be gone (a collective
        may notice a dead peer before its process is reaped) and for its own report."""
        deadline = time.monotonic() + 2
        dead = [(r, p) for r, p in enumerate(children, start=1) if not p.is_alive()]
        while not dead and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = [(r, p) for r, p in enumerate(children, start=1) if not p.is_alive()]
        if not dead:
            return None
        rank, proc = dead[0]
        with contextlib.suppress(OSError, EOFError, KeyError):  # a worker killed from outside says nothing
            pipe = self.error_pipes[rank]
            if pipe.poll(max(0.0, deadline - time.monotonic())):
                rank, user, message = pipe.recv()
                return user, f"worker rank {rank} failed: {message}"
        return False, f"worker rank {rank} failed: exited with status {proc.exitcode}"

    def _report(self, user: bool, message: str) -> bool:
        """Print the failure once (the watchdog and the main thread may both see it); stop every worker."""
        with self.lock:
            if self.failed:
                return False
            self.failed = True
        print(f"Error: {message}\nStopping every worker.", file=sys.stderr, flush=True)
        self._kill_children()
        return True

    def _kill_children(self) -> None:
        self.stopping = True
        for proc in self.children:
            if proc.is_alive():
                proc.kill()
        for proc in self.children:
            proc.join(timeout=5)
        if self.children:
            for pipe in self.error_pipes.values():
                pipe.close()
            self.children = []

    def run(self, cmd: tuple[Any, ...], shares: list[Any] | None = None, ranks: list[int] | None = None) -> list[Any]:
        """Run ``cmd`` on ``ranks`` (default: every rank). A worker that died or hung ends the process here with
        one message (exit status 1, or 2 for a user error in a worker), not with the collective's traceback;
        lines the loggers wrote are already on disk."""
        try:
            return self.host.command(cmd, shares, ranks if ranks is not None else list(range(self.world_size)))
        except Exception as exc:
            failure = self._dead_worker(self.children) if self.children else None
            if failure is None and any(w in str(exc).lower() for w in ("timed out", "timeout")):
                alive = [r for r, p in enumerate(self.children, start=1) if p.is_alive()]
                failure = (False, f"a worker did not answer within launcher.timeout_s={self.options.timeout_s:g} "
                           f"s during {cmd[0]} {'.'.join(str(c) for c in cmd[1:3])} (worker ranks still running: "
                           f"{alive or 'none'}); it hangs or is far slower than the others")
            if failure is None:
                raise
            if not self._report(*failure):
                time.sleep(60)  # the watchdog is reporting the same failure and ends the process
            # Not SystemExit: tearing down a process group with a broken peer aborts in C++ at exit.
            sys.stdout.flush()
            os._exit(2 if failure[0] else 1)

    def create_group(self, role: str, build: Callable[[int, int], Any],
                     where: Where = "workers") -> LocalWorkerGroup | ProcessWorkerGroup:
        if where == "driver":
            return LocalWorkerGroup(role, [build(0, 1)])
        ranks = self.layout.ranks(role)
        group = ProcessWorkerGroup(self, role, self.run(("build", role, build), None, ranks), ranks)
        # A rollout pool on training rank 0's GPU shares its memory with training: it sleeps as a colocated
        # engine does.
        if role in ROLLOUT_ROLES and (not self.layout.rollout or self.layout.share_gpu):
            self.colocated_rollout = group
        return group

    def transfer_weights(self, src: ProcessWorkerGroup, dst: ProcessWorkerGroup) -> dict[str, float]:
        """Colocated: every rank loads the actor's weights of its own process into its rollout engine. A
        rollout pool: rank 0 broadcasts them to the pool in buckets while the other training ranks take part
        in the actor's gathers (``rlx.plugins.launchers.weight_sync``)."""
        from rlx.plugins.launchers.weight_sync import bucket_bytes

        ranks = sorted(set(src.ranks) | set(dst.ranks))
        results = self.run(("sync", src.role, dst.role, bucket_bytes(self.options.bucket_size_mb)), None, ranks)
        return dict(results[0])

    def abort(self) -> None:
        """After an error on rank 0, workers may be blocked in a collective: stop them by force."""
        self._kill_children()

    def shutdown(self) -> None:
        import torch.distributed as dist

        if not self.stopping and dist.is_initialized():
            self.run(("close",))
            self.stopping = True
            self.host.stop()
            for proc in self.children:
                proc.join(timeout=30)
        self._kill_children()
        self.stopping = True
        if dist.is_initialized():
            dist.destroy_process_group()


def build(options: LocalOptions | None, ctx: BuildContext) -> LocalLauncher | ProcessLauncher:
    options = options or LocalOptions()
    if options.weight_sync != "auto" and not options.rollout_nproc:
        raise UserError(f"launcher.weight_sync={options.weight_sync} chooses how a separate rollout pool gets the "
                        "actor's weights, but there is none (launcher.rollout_nproc=0): the engine lives in every "
                        "training process and takes them in process.",
                        "Set launcher.rollout_nproc=K for a rollout pool, or leave launcher.weight_sync=auto.")
    under_torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in os.environ
    if options.nproc == 1 and not options.rollout_nproc and not under_torchrun:
        return LocalLauncher(options)
    cfg = ctx.config
    device = cfg.trainer.device if cfg is not None else "auto"
    seed = cfg.trainer.seed if cfg is not None else 0
    launcher = ProcessLauncher(options, device, seed)
    launcher.balanced_roles = balanced_roles(cfg)
    return launcher


@hookimpl
def rlx_launchers() -> list[Component]:
    return [Component(kind="launcher", name="local", factory=build, config_model=LocalOptions,
                      summary="Workers on this machine: in this process, or --nproc N processes with "
                      "torch.distributed (gloo on CPU, NCCL on GPU), the rollout engine colocated or in "
                      "launcher.rollout_nproc processes of its own; also under torchrun.")]
