"""The ``local`` launcher: the roles' workers on this machine.

- ``launcher.nproc=1`` (the default): every role in this process, one worker each (CPU or one GPU).
- ``launcher.nproc=N`` (``rlx train --nproc N``): N processes with ``torch.distributed`` initialised (gloo
  on the CPU, NCCL on GPUs, one GPU per process). This process is rank 0: it drives the loop and is also
  a worker; N-1 workers are spawned. Every trained role (actor, reference, critic) and the rollout
  engine are built in every process (one pool: colocated, as verl's hybrid engine); the reward runs in
  this process. Each rank gets its data-parallel shard of every call, and weights reach each rank's
  rollout engine from the actor on the same rank, inside that process.
- Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` set), the same with torchrun's
  processes: rank 0 drives, the other ranks serve.

Commands travel from rank 0 to the workers over a gloo group of their own (objects: method names,
losses, data shards), the models' collectives over the default group. A spawned worker that fails
reports its error and dies; rank 0 then names the rank and its error, stops every worker and exits
(status 1, or 2 for a user error): never a hang, never an orphan (workers also die with rank 0).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlx import Component, hookimpl
from rlx.batch import Batch, concat_rollouts
from rlx.context import BuildContext
from rlx.errors import UserError, describe_exception
from rlx.protocols import DispatchInfo

Where = Literal["workers", "driver"]


class LocalOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    nproc: int = Field(1, ge=1, le=1024, description="Worker processes (one per GPU on a GPU machine).")
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


class LocalLauncher:
    def __init__(self) -> None:
        self.groups: list[LocalWorkerGroup] = []

    def create_group(self, role: str, build: Callable[[int, int], Any], where: Where = "workers") -> LocalWorkerGroup:
        group = LocalWorkerGroup(role, [build(0, 1)])
        self.groups.append(group)
        return group

    def transfer_weights(self, src: LocalWorkerGroup, dst: LocalWorkerGroup) -> None:
        """Push the source role's full weights into the destination workers (actor -> rollout), in process."""
        for worker in dst.workers:
            worker.update_weights(src.workers[0].named_weights())

    def abort(self) -> None:
        """Nothing runs elsewhere."""

    def shutdown(self) -> None:
        for g in self.groups:
            g.shutdown()
        self.groups.clear()


# -- several processes ---------------------------------------------------------------------------------
class _Host:
    """The workers living in one process, and the loop by which rank 0 drives them."""

    def __init__(self, rank: int, world_size: int, timeout_s: float) -> None:
        import torch.distributed as dist

        self.rank, self.world_size = rank, world_size
        self.roles: dict[str, Any] = {}
        # Workers wait here while the driver works alone (scoring rewards, logging, writing checkpoint
        # markers), so launcher.timeout_s must exceed that; a dead driver ends them through their
        # parent-death signal.
        self.control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    # The driver's half of a command ------------------------------------------------------------------
    def command(self, cmd: tuple[Any, ...], shares: list[Any] | None = None) -> list[Any]:
        """Run ``cmd`` on every rank (rank r gets ``shares[r]``); the results of every rank, in rank order."""
        import torch.distributed as dist

        dist.broadcast_object_list([cmd], src=0, group=self.control)
        mine = [None]
        dist.scatter_object_list(mine, shares or [None] * self.world_size, src=0, group=self.control)
        result = self.execute(cmd, mine[0])
        results: list[Any] = [None] * self.world_size
        dist.gather_object(result, results, dst=0, group=self.control)
        return results

    # Every rank's half -------------------------------------------------------------------------------
    def serve(self) -> None:
        """Ranks > 0: run the driver's commands until it says stop. An error in a command is fatal."""
        import torch.distributed as dist

        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=self.control)
            cmd = box[0]
            if cmd[0] == "stop":
                return
            mine = [None]
            dist.scatter_object_list(mine, None, src=0, group=self.control)
            dist.gather_object(self.execute(cmd, mine[0]), None, dst=0, group=self.control)

    def execute(self, cmd: tuple[Any, ...], share: Any) -> Any:
        op = cmd[0]
        if op == "build":
            _, role, build = cmd
            worker = build(self.rank, self.world_size)
            self.roles[role] = worker
            return dispatch_info(worker, self.rank, self.world_size)
        if op == "call":
            _, role, method, args, kwargs = cmd
            return getattr(self.roles[role], method)(share, *args, **kwargs)
        if op == "call_all":
            _, role, method, args, kwargs = cmd
            return getattr(self.roles[role], method)(*args, **kwargs)
        if op == "sync":
            _, src, dst = cmd
            self.roles[dst].update_weights(self.roles[src].named_weights())
            return None
        if op == "close":
            for worker in self.roles.values():
                close = getattr(worker, "close", None)
                if close is not None:
                    close()
            self.roles.clear()
            return None
        raise ValueError(f"unknown command {op!r}")


PROCESS_GROUP_USED = False  # this process took part in a torch.distributed group (the CLI's exit reads it)


def _set_up_process(rank: int, world_size: int, init_method: str, timeout_s: float, device: str,
                    threads: int | None) -> None:
    import torch
    import torch.distributed as dist

    global PROCESS_GROUP_USED
    PROCESS_GROUP_USED = True

    if threads:
        torch.set_num_threads(threads)
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent (rank 0) dies, so no worker is left orphaned."""
    if sys.platform != "linux":
        return
    import ctypes
    import signal

    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _worker_main(rank: int, world_size: int, init_method: str, timeout_s: float, device: str,
                 threads: int | None, seed: int, errors: Any) -> None:
    """Entry point of a spawned worker process."""
    _die_with_parent()
    # Rank 0 prints what the user needs; progress bars from every rank would only repeat it (and tqdm's
    # lock would outlive this process, which ends with os._exit).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        import torch

        _set_up_process(rank, world_size, init_method, timeout_s, device, threads)
        torch.manual_seed(seed + rank)
        _Host(rank, world_size, timeout_s).serve()
    except BaseException as exc:
        user = isinstance(exc, UserError)
        errors.send((rank, user, str(exc) if user else describe_exception(exc)))
        os._exit(2 if user else 1)
    os._exit(0)


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ProcessWorkerGroup:
    """One role's workers, one per process (or Ray actor); rank r's data-parallel rank comes from its worker.
    ``launcher.run(cmd, shares)`` runs a command on every rank and returns every rank's result."""

    def __init__(self, launcher: Any, role: str, infos: list[DispatchInfo]) -> None:
        self.launcher, self.role, self.infos = launcher, role, infos
        self.world_size = len(infos)
        self.dp_size = infos[0].dp_size

    def call(self, method: str, batch: Batch | list[Batch], *args: Any, **kwargs: Any) -> Any:
        parts = shard(batch, self.dp_size)
        shares = [parts[info.dp_rank] for info in self.infos]
        results = self.launcher.run(("call", self.role, method, args, kwargs), shares)
        collected = sorted(((info.dp_rank, r) for info, r in zip(self.infos, results) if info.collect),
                           key=lambda pair: pair[0])
        return gather([r for _, r in collected])

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self.launcher.run(("call_all", self.role, method, args, kwargs))

    def shutdown(self) -> None:
        """The launcher closes every role at once."""


class ProcessLauncher:
    """N processes with torch.distributed; this process is rank 0 (see the module doc)."""

    def __init__(self, options: LocalOptions, device: str, seed: int) -> None:
        import multiprocessing as mp

        import torch

        self.options = options
        self.children: list[Any] = []
        self.stopping = self.failed = False
        self.lock = threading.Lock()
        under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
        if under_torchrun:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            init_method = "env://"
        else:
            rank, world = 0, options.nproc
            init_method = f"tcp://127.0.0.1:{_free_port()}"
        use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if use_cuda:
            if not torch.cuda.is_available():
                raise UserError("trainer.device=cuda, but no CUDA GPU is visible.",
                                "Run on a GPU machine, or use trainer.device=cpu (gloo).")
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            if local > torch.cuda.device_count():
                raise UserError(f"{local} processes on this machine need as many GPUs, but "
                                f"{torch.cuda.device_count()} are visible.",
                                f"Use --nproc {torch.cuda.device_count()} or fewer (one process per GPU).")
            if not torch.distributed.is_nccl_available():
                raise UserError("This torch build has no NCCL, which GPU workers need.",
                                "Install a CUDA build of torch, or use trainer.device=cpu.")
        threads = None if use_cuda else max(1, (os.cpu_count() or 1) // world)
        self.world_size = world
        if not under_torchrun:
            ctx = mp.get_context("spawn")
            # One pipe per worker for its last words (a pipe, not a queue: no semaphore left behind at exit).
            self.error_pipes: dict[int, Any] = {}
            for r in range(1, world):
                self.error_pipes[r], errors = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker_main, name=f"rlx-worker-{r}", daemon=True,
                                   args=(r, world, init_method, options.timeout_s, device, threads, seed, errors))
                proc.start()
                self.children.append(proc)
            threading.Thread(target=self._watch, name="rlx-worker-watchdog", daemon=True).start()
        _set_up_process(rank, world, init_method, options.timeout_s, device, threads)
        self.host = _Host(rank, world, options.timeout_s)
        if rank != 0:  # under torchrun: this process serves rank 0 and never runs the driver's loop
            try:
                self.host.serve()
            except BaseException as exc:
                print(f"Error: worker rank {rank} failed: {describe_exception(exc)}", file=sys.stderr)
                os._exit(2 if isinstance(exc, UserError) else 1)
            os._exit(0)

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

    def run(self, cmd: tuple[Any, ...], shares: list[Any] | None = None) -> list[Any]:
        """Run ``cmd`` on every rank. A worker that died or hung ends the process here with one message
        (exit status 1, or 2 for a user error in a worker), not with the collective's traceback; lines the
        loggers wrote are already on disk."""
        try:
            return self.host.command(cmd, shares)
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
        infos = self.run(("build", role, build))
        return ProcessWorkerGroup(self, role, infos)

    def transfer_weights(self, src: ProcessWorkerGroup, dst: ProcessWorkerGroup) -> None:
        """Every rank loads the actor's weights of its own process into its rollout engine."""
        self.run(("sync", src.role, dst.role))

    def abort(self) -> None:
        """After an error on rank 0, workers may be blocked in a collective: stop them by force."""
        self._kill_children()

    def shutdown(self) -> None:
        import torch.distributed as dist

        if not self.stopping and dist.is_initialized():
            self.run(("close",))
            self.stopping = True
            dist.broadcast_object_list([("stop",)], src=0, group=self.host.control)
            for proc in self.children:
                proc.join(timeout=30)
        self._kill_children()
        self.stopping = True
        if dist.is_initialized():
            dist.destroy_process_group()


def build(options: LocalOptions | None, ctx: BuildContext) -> LocalLauncher | ProcessLauncher:
    options = options or LocalOptions()
    under_torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in os.environ
    if options.nproc == 1 and not under_torchrun:
        return LocalLauncher()
    cfg = ctx.config
    device = cfg.trainer.device if cfg is not None else "auto"
    seed = cfg.trainer.seed if cfg is not None else 0
    return ProcessLauncher(options, device, seed)


@hookimpl
def rlx_launchers() -> list[Component]:
    return [Component(kind="launcher", name="local", factory=build, config_model=LocalOptions,
                      summary="Workers on this machine: in this process, or --nproc N processes with "
                      "torch.distributed (gloo on CPU, NCCL on GPU); also under torchrun.")]
