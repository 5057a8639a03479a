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
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlx import Component, _compat, hookimpl
from rlx.context import BuildContext
from rlx.dispatch import balanced_roles
from rlx.errors import UserError, describe_exception
from rlx.plugins.launchers._process import (
    ROLLOUT_ROLES,
    Host,
    Layout,
    LocalWorkerGroup,
    PhaseSwitch,
    ProcessWorkerGroup,
    Where,
    join_pools,
    set_up_process,
    wants_cuda,
    worker_main,
)


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


# -- one process ---------------------------------------------------------------------------------------


class LocalLauncher(PhaseSwitch):
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


class ProcessLauncher(PhaseSwitch):
    """The training pool's N processes (and the rollout pool's K) with torch.distributed; this process is
    rank 0 (see the module doc)."""

    def __init__(self, options: LocalOptions, device: str, seed: int) -> None:
        import multiprocessing as mp

        import torch
        import torch.distributed as dist

        self.options = options
        self.sleep_rollout = options.sleep_rollout
        # Roles balanced over data-parallel ranks by tokens, and whether each shares prompts (rlx.dispatch);
        # set from the config by build().
        self.balanced_roles: dict[str, bool] = {}
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
        use_cuda = wants_cuda(device)
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
            set_up_process(rank, world, "env://", options.timeout_s, device, threads)
            control = dist.new_group(backend="gloo", timeout=timedelta(seconds=options.timeout_s))
            self.host = Host(rank, self.layout, control)
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
            proc = ctx.Process(target=worker_main, name=f"rlx-worker-{r}", daemon=True,
                               args=(r, self.layout, store.port, options.timeout_s, device, threads, seed, errors))
            proc.start()
            self.children.append(proc)
        threading.Thread(target=self._watch, name="rlx-worker-watchdog", daemon=True).start()
        self.store = store  # the rendezvous lives as long as this process serves it
        try:
            self.host = join_pools(0, self.layout, store, options.timeout_s, device, threads, options.weight_sync)
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
        group.overlaps_training = bool(self.layout.rollout) and role in ROLLOUT_ROLES and 0 not in ranks
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


# Names that lived here in rlx 0.1 (issue 26 moved them); kept for one release, with a DeprecationWarning.
__getattr__ = _compat.moved_attributes(__name__, {
    "PROCESS_GROUP_USED": "rlx.plugins.launchers._process",
    "Phase": "rlx.plugins.launchers._process",
    "balance": "rlx.dispatch",
    "dispatch_info": "rlx.dispatch",
    "gather": "rlx.dispatch",
    "shard": "rlx.dispatch",
    "unbalance": "rlx.dispatch",
    "weights_group": "rlx.plugins.launchers._process",
})
