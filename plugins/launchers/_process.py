"""The launchers' shared machinery (the local and Ray launchers, and a third party's): worker groups in one
process (:class:`LocalWorkerGroup`) and over processes (:class:`ProcessWorkerGroup`), a worker process's
command loop (:class:`Host`: build, call, call_all, sync, close), the pools' layout and process groups, the
pickled-object channel between ranks, and the generate/train phase switch of a colocated rollout engine.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from rlx.batch import Batch
from rlx.dispatch import balance, dispatch_info, gather, shard, unbalance
from rlx.errors import UserError, describe_exception
from rlx.protocols import DispatchInfo, RolloutEngine, method_name

Where = Literal["workers", "driver"]


Phase = Literal["generate", "train"]


ROLLOUT_ROLES = frozenset({"rollout"})  # roles placed in the rollout pool when there is one


class LocalWorkerGroup:
    """Workers of one role in this process (the controller calls the group, never a worker)."""

    # Its calls may run in a thread beside the calls of other groups (asynchronous RL, rlx.overlap).
    overlaps_training = True

    def __init__(self, role: str, workers: list[Any]) -> None:
        self.role = role
        self.workers = workers
        self.world_size = len(workers)

    def call(self, method: Callable[..., Any], batch: Batch | list[Batch], *args: Any, **kwargs: Any) -> Any:
        name = method_name(method)
        parts = shard(batch, self.world_size)
        return gather([getattr(w, name)(p, *args, **kwargs) for w, p in zip(self.workers, parts)])

    def call_all(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        name = method_name(method)
        return [getattr(w, name)(*args, **kwargs) for w in self.workers]

    def shutdown(self) -> None:
        for w in self.workers:
            close = getattr(w, "close", None)
            if close is not None:
                close()


class PhaseSwitch:
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
        method = RolloutEngine.sleep if name == "train" else RolloutEngine.wake_up
        start = time.perf_counter()
        self.colocated_rollout.call_all(method)
        return {f"timing/{method.__name__}": time.perf_counter() - start}


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


class Host:
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


def wants_cuda(device: str) -> bool:
    import torch

    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def prepare_process(rank: int, device: str, threads: int | None, gpu: int | None = None) -> bool:
    """Threads and this process's GPU (``gpu``, or its local rank's); whether it uses CUDA."""
    import torch

    global PROCESS_GROUP_USED
    PROCESS_GROUP_USED = True

    if threads:
        torch.set_num_threads(threads)
    use_cuda = wants_cuda(device)
    if use_cuda:
        torch.cuda.set_device(gpu if gpu is not None else int(os.environ.get("LOCAL_RANK", rank)))
    return use_cuda


def set_up_process(rank: int, world_size: int, init_method: str, timeout_s: float, device: str,
                    threads: int | None) -> None:
    """One pool of ``world_size`` processes through ``init_method`` (torchrun's environment, Ray's actors)."""
    import torch.distributed as dist

    use_cuda = prepare_process(rank, device, threads)
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


def join_pools(rank: int, layout: Layout, store: Any, timeout_s: float, device: str, threads: int | None,
          mode: Any = "auto") -> Host:
    """Set up a process of a run that rlx started: its pool's default group (the training pool's is the one
    the backends use; the rollout pool has none, its engine sets up what it needs), the control group of
    every process and, with a rollout pool, the weights group of rank 0 and the rollout ranks (``mode``:
    ``launcher.weight_sync``, read on rank 0)."""
    import torch.distributed as dist

    use_cuda = prepare_process(rank, device, threads, layout.gpu(rank))
    timeout = timedelta(seconds=timeout_s)
    transport = "broadcast"
    if layout.rollout and (rank == 0 or layout.in_rollout_pool(rank)):
        transport = _transport(rank, layout, store, use_cuda, mode)
    if not layout.in_rollout_pool(rank):
        dist.init_process_group("nccl" if use_cuda else "gloo", store=dist.PrefixStore("rlx/train", store),
                                rank=rank, world_size=layout.train, timeout=timeout)
    control = _group("gloo", dist.PrefixStore("rlx/control", store), rank, layout.world, timeout)
    weights = weights_group(rank, layout, store, use_cuda, timeout_s, transport)
    return Host(rank, layout, control, weights, "cuda" if use_cuda else "cpu", transport)


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent (rank 0) dies, so no worker is left orphaned."""
    if sys.platform != "linux":
        return
    import ctypes
    import signal

    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def worker_main(rank: int, layout: Layout, port: int, timeout_s: float, device: str, threads: int | None,
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
        host = join_pools(rank, layout, store, timeout_s, device, threads)
        torch.manual_seed(seed + rank)
        host.serve()
    except BaseException as exc:
        user = isinstance(exc, UserError)
        errors.send((rank, user, str(exc) if user else describe_exception(exc)))
        os._exit(2 if user else 1)
    os._exit(0)


class ProcessWorkerGroup:
    """One role's workers, one per process (or Ray actor) of its pool (global ``ranks``); each one's
    data-parallel rank comes from its worker. ``launcher.run(cmd, shares, ranks)`` runs a command on those
    ranks and returns their results."""

    def __init__(self, launcher: Any, role: str, infos: list[DispatchInfo], ranks: list[int] | None = None) -> None:
        self.launcher, self.role, self.infos = launcher, role, infos
        self.ranks = ranks if ranks is not None else list(range(len(infos)))
        self.world_size = len(infos)
        self.dp_size = infos[0].dp_size
        roles = getattr(launcher, "balanced_roles", {})
        self.balanced = self.dp_size > 1 and role in roles
        self.share_prompts = bool(roles.get(role, False))  # a prompt's rows go to one rank together
        # Its calls may run in a thread beside other groups' (asynchronous RL, rlx.overlap) when its processes
        # hold no other role and are not the driver's: a rollout pool. Colocated, the ranks' command loops would
        # interleave two streams of commands.
        self.overlaps_training = False

    def call(self, method: Callable[..., Any], batch: Batch | list[Batch], *args: Any, **kwargs: Any) -> Any:
        batch, order = balance(batch, self.dp_size, self.share_prompts) if self.balanced else (batch, None)
        parts = shard(batch, self.dp_size)
        shares = [parts[info.dp_rank] for info in self.infos]
        results = self.launcher.run(("call", self.role, method_name(method), args, kwargs), shares, self.ranks)
        collected = sorted(((info.dp_rank, r) for info, r in zip(self.infos, results) if info.collect),
                           key=lambda pair: pair[0])
        return unbalance(gather([r for _, r in collected]), order)

    def call_all(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        return self.launcher.run(("call_all", self.role, method_name(method), args, kwargs), None, self.ranks)

    def shutdown(self) -> None:
        """The launcher closes every role at once."""
