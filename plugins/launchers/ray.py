"""The ``ray`` launcher: the roles' workers in Ray actors, on one machine or across a cluster.

``rlx train --launcher ray --nproc N`` (``pip install 'rlx[ray]'``):

- ``launcher.address`` unset: starts a local Ray instance (``launcher.num_cpus`` logical CPUs) and stops it
  at the end; ``auto`` or ``HOST:PORT`` (``ray://HOST:PORT`` through Ray Client): connects to a running
  cluster (``ray start --head`` there, see ``examples/slurm``) and leaves it running.
- One placement group of N bundles (``cpus_per_worker`` CPUs and ``gpus_per_worker`` GPUs each, placed by
  ``placement_strategy``), one actor per bundle. The actors are the N ranks of ``torch.distributed``
  (gloo on the CPU, NCCL on GPUs; rank 0 names the rendezvous: its node's address and a free port).
  Every trained role and the rollout engine are built in every actor, as under the local launcher's
  ``--nproc N`` (one pool: colocated; the engine sleeps while the models train); the reward runs in this
  process, which drives the loop and is not a rank.
- ``launcher.rollout_nproc=K``: K more actors, in a placement group of their own, hold only the rollout
  engine (a separate pool). The N training actors form the ``torch.distributed`` world the backends use;
  after each update training rank 0 broadcasts the actor's weights to the K rollout actors in buckets
  (``rlx.plugins.launchers.weight_sync``, over a group of rank 0 and the rollout actors).
- A call sends every actor its data-parallel shard at once (the workers' collectives need all ranks),
  then gathers the collected ranks' results in data-parallel order. Colocated, weights go from each actor's
  actor role to its own rollout engine inside the actor.
- A worker that raises or whose actor dies ends the run at once with a message naming its rank and
  error, and every actor is killed; a worker that does not answer within ``launcher.timeout_s`` of the
  first rank that did is reported as hung. Collectives between workers time out after the same time.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from pydantic import BaseModel, ConfigDict, Field

from rlx import Component, hookimpl
from rlx.context import BuildContext
from rlx.dispatch import balanced_roles
from rlx.errors import UserError, describe_exception, require
from rlx.plugins.launchers._process import (
    ROLLOUT_ROLES,
    Host,
    Layout,
    LocalWorkerGroup,
    PhaseSwitch,
    ProcessWorkerGroup,
    Where,
    prepare_process,
    set_up_process,
    weights_group,
)
from rlx.registry import Requirement

MAX_WORKERS = 4096


class RayOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    address: str | None = Field(None, description="Ray cluster to connect to: 'auto' (the one started on this "
                                "machine with `ray start`), 'HOST:PORT' of its head, or 'ray://HOST:PORT' (Ray "
                                "Client). Unset: start a local Ray instance for this run.")
    nproc: int = Field(1, ge=1, le=MAX_WORKERS, description="Workers (Ray actors, torch.distributed ranks) of "
                       "the training pool; one per GPU on GPU machines.")
    rollout_nproc: int = Field(0, ge=0, le=MAX_WORKERS, description="Ray actors that hold only the rollout "
                               "engine, in a placement group of their own (a separate pool; the actor's weights "
                               "are broadcast to them after each update). 0: the engine lives in every worker "
                               "(colocated).")
    gpus_per_worker: int | None = Field(None, ge=0, le=16, description="GPUs of each worker (default: 1 when "
                                        "the cluster has GPUs and trainer.device is not cpu, else 0).")
    cpus_per_worker: float = Field(1.0, gt=0, le=1024, description="Logical CPUs reserved for each worker; on "
                                   "the CPU also its torch threads.")
    timeout_s: float = Field(1800.0, gt=0, le=7 * 24 * 3600, description="Most seconds a collective between "
                             "workers may wait, and a worker may answer after the first one did, before the run "
                             "stops with an error naming the rank (a hung worker).")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="How the workers' bundles are spread over nodes (Ray placement-group strategy): PACK "
        "fills few nodes, SPREAD spreads, STRICT_* insist.")
    num_cpus: int | None = Field(None, ge=1, le=100_000, description="Logical CPUs of a local Ray instance "
                                 "(only when address is unset; default: nproc * cpus_per_worker, at least 1).")
    connect_timeout_s: float = Field(30.0, gt=0, le=3600, description="Most seconds to wait for a Ray cluster "
                                     "to answer when connecting.")
    placement_timeout_s: float = Field(120.0, gt=0, le=24 * 3600, description="Most seconds to wait for the "
                                       "cluster to place every worker's bundle.")
    bucket_size_mb: float = Field(256.0, gt=0, le=2**20, description="The actor's weights reach the rollout "
                                  "engine in buckets of at most this many MiB (a larger tensor travels alone).")
    sleep_rollout: bool = Field(True, description="The rollout engine sleeps (frees what its device memory "
                                "holds) while the models train, and wakes up before it takes new weights and "
                                "generates.")


@dataclass(frozen=True)
class _Failure:
    """What a worker sends back instead of a result when a command raised."""

    user: bool
    message: str


class _RayHost(Host):
    """The workers living in one Ray actor. Commands come from the driver through Ray, not through a gloo
    group of their own, so only ``execute`` of the local launcher's host is used (same commands, same
    behaviour: build, call, call_all, sync, close)."""

    def __init__(self, rank: int, layout: Layout, seed: int, timeout_s: float, device: str,
                 threads: int | None) -> None:
        super().__init__(rank, layout, control=None)
        self.seed, self.timeout_s, self.device, self.threads = seed, timeout_s, device, threads
        self.store: Any = None

    def rendezvous(self) -> tuple[str, int, int]:
        """Rank 0: this node's address and two ports free on it, where the training ranks meet and where
        the weights group of rank 0 and the rollout ranks meets."""
        import ray

        ports = []
        for _ in range(2):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("", 0))
                ports.append(int(s.getsockname()[1]))
        return ray.util.get_node_ip_address(), ports[0], ports[1]

    def set_up(self, master_addr: str, master_port: int, weights_port: int) -> Any:
        try:
            from datetime import timedelta

            import torch
            import torch.distributed as dist

            # Ray shows each GPU actor only its own GPUs (CUDA_VISIBLE_DEVICES), so its device is 0.
            os.environ["LOCAL_RANK"] = "0"
            layout = self.layout
            if layout.in_rollout_pool(self.rank):
                use_cuda = prepare_process(self.rank, self.device, self.threads)
            else:
                set_up_process(self.rank, layout.train, f"tcp://{master_addr}:{master_port}", self.timeout_s,
                                self.device, self.threads)
                use_cuda = dist.get_backend() == "nccl"
            if layout.rollout and (self.rank == 0 or layout.in_rollout_pool(self.rank)):
                self.store = dist.TCPStore(master_addr, weights_port, layout.rollout + 1, is_master=self.rank == 0,
                                           timeout=timedelta(seconds=self.timeout_s))
                self.weights = weights_group(self.rank, layout, self.store, use_cuda, self.timeout_s)
                self.comm_device = "cuda" if use_cuda else "cpu"
            torch.manual_seed(self.seed + self.rank)
            _quiet_transformers()
            return None
        except BaseException as exc:
            return _failure(exc)

    def run(self, cmd: tuple[Any, ...], share: Any) -> Any:
        try:
            return self.execute(cmd, share)
        except BaseException as exc:
            return _failure(exc)


def _quiet_transformers() -> None:
    """As the CLI does in its own process: Ray forwards the actors' output to the console, where a loading
    bar per role and rank would bury the run's own lines."""
    with contextlib.suppress(ImportError):
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()


def _failure(exc: BaseException) -> _Failure:
    if isinstance(exc, UserError):
        return _Failure(True, str(exc))
    return _Failure(False, describe_exception(exc))


class RayLauncher(PhaseSwitch):
    """Ray actors as the workers (see the module doc); this process drives and is not a rank."""

    def __init__(self, options: RayOptions, device: str, seed: int) -> None:
        ray = require("ray", "ray", "The ray launcher (launcher.name=ray)")
        self.ray = ray
        self.options = options
        self.sleep_rollout = options.sleep_rollout
        # Roles balanced over data-parallel ranks by tokens, and whether each shares prompts (rlx.dispatch);
        # set from the config by build().
        self.balanced_roles: dict[str, bool] = {}
        self.started = False  # a local Ray instance of this run
        self.connected = False  # ray.init called here: ray.shutdown at the end
        self.layout = Layout(options.nproc, options.rollout_nproc)
        self.actors: list[Any] = []
        self.pgs: list[Any] = []  # the training pool's placement group, and the rollout pool's
        self.closed = False
        self._connect()
        try:
            gpus = self._gpus_per_worker(device)
            self._place(gpus)
            self._start_actors(gpus, device, seed)
        except BaseException:
            self._stop()
            raise

    # -- set-up ------------------------------------------------------------------------------------
    def _connect(self) -> None:
        ray, o = self.ray, self.options
        if ray.is_initialized():  # the caller runs Ray already (a notebook, a Ray job): use it, leave it
            return
        quiet = logging.WARNING
        if o.address is None:
            cpus = o.num_cpus or max(1, math.ceil((o.nproc + o.rollout_nproc) * o.cpus_per_worker))
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level=quiet)
            self.started = self.connected = True
            return
        if o.address != "auto":
            _probe(o.address, o.connect_timeout_s)
        # ray.init retries an address that accepts connections but is no Ray head without end: bound it.
        outcome: dict[str, BaseException | None] = {}

        def connect() -> None:
            try:
                ray.init(address=o.address, logging_level=quiet)
                outcome["error"] = None
            except BaseException as exc:
                outcome["error"] = exc

        logging.getLogger("ray").addFilter(_NotMainThreadFilter())
        thread = threading.Thread(target=connect, name="rlx-ray-connect", daemon=True)
        thread.start()
        thread.join(o.connect_timeout_s)
        if "error" not in outcome:
            raise UserError(f"The Ray cluster at launcher.address={o.address!r} did not answer within "
                            f"launcher.connect_timeout_s={o.connect_timeout_s:g} s.", _ADDRESS_HINT)
        error = outcome["error"]
        if error is not None:
            raise UserError(f"Cannot connect to the Ray cluster at launcher.address={o.address!r}: "
                            f"{_first_line(error)}", _ADDRESS_HINT) from error
        self.connected = True

    def _gpus_per_worker(self, device: str) -> int:
        o = self.options
        total = self.ray.cluster_resources()
        have_gpus = int(total.get("GPU", 0))
        gpus = o.gpus_per_worker if o.gpus_per_worker is not None else int(have_gpus > 0 and device != "cpu")
        if device == "cuda" and gpus == 0:
            raise UserError("trainer.device=cuda, but the Ray workers get no GPU "
                            + ("(the cluster has none)." if have_gpus == 0 else "(launcher.gpus_per_worker=0)."),
                            "Connect to a cluster with GPUs (launcher.address), set launcher.gpus_per_worker, "
                            "or use trainer.device=cpu.")
        workers = self.layout.world
        need = {"GPU": workers * gpus, "CPU": workers * o.cpus_per_worker}
        count = f"launcher.nproc={o.nproc}"
        if o.rollout_nproc:
            count += f" + launcher.rollout_nproc={o.rollout_nproc}"
        short = [f"{need[k]:g} {k}s ({count} x {self._per_worker_key(k)}) but the cluster has "
                 f"{total.get(k, 0):g}" for k in ("GPU", "CPU") if need[k] > total.get(k, 0)]
        if short:
            raise UserError("The Ray workers need " + "; ".join(short) + ".",
                            "Use fewer workers (launcher.nproc), fewer resources per worker "
                            "(launcher.gpus_per_worker, launcher.cpus_per_worker), or add nodes to the cluster"
                            + (" (or launcher.num_cpus for the local Ray instance)." if self.started else "."))
        return gpus

    @staticmethod
    def _per_worker_key(kind: str) -> str:
        return "launcher.gpus_per_worker" if kind == "GPU" else "launcher.cpus_per_worker"

    def _bundle(self, gpus: int) -> dict[str, float]:
        bundle = {"CPU": self.options.cpus_per_worker}
        if gpus:
            bundle["GPU"] = float(gpus)
        return bundle

    def _place(self, gpus: int) -> None:
        from ray.util.placement_group import placement_group

        o = self.options
        name = f"rlx-{socket.gethostname()}-{os.getpid()}"
        self.pgs = [placement_group([self._bundle(gpus)] * o.nproc, strategy=o.placement_strategy, name=name)]
        if o.rollout_nproc:
            self.pgs.append(placement_group([self._bundle(gpus)] * o.rollout_nproc, strategy=o.placement_strategy,
                                            name=f"{name}-rollout"))
        ready, _ = self.ray.wait([pg.ready() for pg in self.pgs], num_returns=len(self.pgs),
                                 timeout=o.placement_timeout_s)
        if len(ready) < len(self.pgs):
            free = self.ray.available_resources()
            nodes = [n.get("Resources", {}) for n in self.ray.nodes() if n.get("Alive")]
            per_node = "; ".join(f"{r.get('CPU', 0):g} CPUs, {r.get('GPU', 0):g} GPUs" for r in nodes)
            raise UserError(
                f"Ray could not place {self.layout.world} workers of {self._bundle(gpus)} each with strategy "
                f"{o.placement_strategy} within launcher.placement_timeout_s={o.placement_timeout_s:g} s. Free "
                f"now: {free.get('CPU', 0):g} CPUs, {free.get('GPU', 0):g} GPUs; nodes: {per_node or 'none'}.",
                "A worker's bundle must fit on one node and STRICT_* strategies need room on one node each; "
                "lower launcher.gpus_per_worker or launcher.cpus_per_worker, use PACK or SPREAD, or wait until "
                "other jobs on the cluster release their resources.")

    def _start_actors(self, gpus: int, device: str, seed: int) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        o, layout = self.options, self.layout
        threads = None if gpus else max(1, int(o.cpus_per_worker))
        host = self.ray.remote(_RayHost)
        self.actors = [
            host.options(
                num_cpus=o.cpus_per_worker, num_gpus=gpus, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pgs[1] if layout.in_rollout_pool(r) else self.pgs[0],
                    placement_group_bundle_index=r - layout.train if layout.in_rollout_pool(r) else r),
            ).remote(r, layout, seed, o.timeout_s, device if gpus else "cpu", threads)
            for r in range(layout.world)
        ]
        addr, port, weights_port = self._gather([self.actors[0].rendezvous.remote()], "set-up", ranks=[0])[0]
        self._gather([a.set_up.remote(addr, port, weights_port) for a in self.actors], "set-up")

    # -- commands ----------------------------------------------------------------------------------
    def run(self, cmd: tuple[Any, ...], shares: list[Any] | None = None, ranks: list[int] | None = None) -> list[Any]:
        """Run ``cmd`` on the actors of ``ranks`` (default: every actor) at once (``ranks[i]`` gets
        ``shares[i]``); their results in the same order."""
        if self.closed:
            raise RuntimeError("the ray launcher is shut down")
        ranks = ranks if ranks is not None else list(range(len(self.actors)))
        shares = shares or [None] * len(ranks)
        refs = [self.actors[r].run.remote(cmd, s) for r, s in zip(ranks, shares)]
        return self._gather(refs, f"{cmd[0]} {'.'.join(str(c) for c in cmd[1:3])}".strip(), ranks=ranks)

    def _gather(self, refs: list[Any], what: str, ranks: list[int] | None = None) -> list[Any]:
        """Wait for every rank's answer. The first failure ends the run (the others may wait in a collective
        with the failed rank); so does a rank that has not answered ``timeout_s`` after the first answer."""
        ray = self.ray
        from ray.exceptions import RayActorError, RayError

        ranks = ranks if ranks is not None else list(range(len(refs)))
        rank_of = {ref: rank for ref, rank in zip(refs, ranks)}
        results: dict[int, Any] = {}
        pending = list(refs)
        first_answer: float | None = None
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in done:
                rank = rank_of[ref]
                try:
                    value = ray.get(ref)
                except RayActorError as exc:
                    self._fail(False, f"worker rank {rank} failed: its Ray actor died ({_first_line(exc)})",
                               pending, rank_of)
                except RayError as exc:
                    self._fail(False, f"worker rank {rank} failed: {_first_line(exc)}", pending, rank_of)
                if isinstance(value, _Failure):
                    dead = self._dead_actor(pending, rank_of)
                    if dead is not None:  # the root cause: this rank's collective lost a peer
                        self._fail(False, dead, pending, rank_of)
                    self._fail(value.user, f"worker rank {rank} failed: {value.message}", pending, rank_of)
                results[rank] = value
                first_answer = first_answer or time.monotonic()
            if pending and first_answer is not None and time.monotonic() - first_answer > self.options.timeout_s:
                late = sorted(rank_of[r] for r in pending)
                self._fail(False, f"worker rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} did not "
                           f"answer within launcher.timeout_s={self.options.timeout_s:g} s of the others during "
                           f"{what}; it hangs or is far slower than the others", [], rank_of)
        return [results[r] for r in ranks]

    def _dead_actor(self, pending: list[Any], rank_of: dict[Any, int]) -> str | None:
        """A message about a rank whose actor died, if one did: when a rank loses a peer in a collective it
        may report that before Ray reports the peer's death, so wait for the others briefly."""
        from ray.exceptions import RayActorError

        done, _ = self.ray.wait(pending, num_returns=len(pending), timeout=2.0) if pending else ([], [])
        for ref in done:
            try:
                self.ray.get(ref)
            except RayActorError as exc:
                return f"worker rank {rank_of[ref]} failed: its Ray actor died ({_first_line(exc)})"
            except Exception:
                continue
        return None

    def _fail(self, user: bool, message: str, pending: list[Any], rank_of: dict[Any, int]) -> NoReturn:
        """Stop every actor and end the run: a user error in a worker as a UserError (exit status 2), any
        other failure as one message on stderr and exit status 1, never a traceback of the workers."""
        still = sorted(rank_of[r] for r in pending)
        if still and any(word in message.lower() for word in ("timed out", "timeout")):
            message += f" (worker ranks still running: {still or 'none'}; one of them may hang)"
        self._stop()
        if user:
            raise UserError(message)
        print(f"Error: {message}\nStopped every worker.", file=sys.stderr, flush=True)
        raise SystemExit(1)

    def create_group(self, role: str, build: Callable[[int, int], Any],
                     where: Where = "workers") -> LocalWorkerGroup | ProcessWorkerGroup:
        if where == "driver":
            return LocalWorkerGroup(role, [build(0, 1)])
        ranks = self.layout.ranks(role)
        group = ProcessWorkerGroup(self, role, self.run(("build", role, build), None, ranks), ranks)
        group.overlaps_training = bool(self.layout.rollout) and role in ROLLOUT_ROLES and 0 not in ranks
        if role in ROLLOUT_ROLES and not self.layout.rollout:
            self.colocated_rollout = group
        return group

    def transfer_weights(self, src: ProcessWorkerGroup, dst: ProcessWorkerGroup) -> dict[str, float]:
        """Colocated: every actor loads its own actor role's weights into its own rollout engine. A rollout
        pool: rank 0 broadcasts them to the pool's actors in buckets (``rlx.plugins.launchers.weight_sync``)."""
        from rlx.plugins.launchers.weight_sync import bucket_bytes

        ranks = sorted(set(src.ranks) | set(dst.ranks))
        return dict(self.run(("sync", src.role, dst.role, bucket_bytes(self.options.bucket_size_mb)), None,
                             ranks)[0])

    # -- the end -----------------------------------------------------------------------------------
    def _stop(self) -> None:
        """Kill every actor, free the placement group, and stop Ray if this launcher started it."""
        if self.closed:
            return
        self.closed = True
        ray = self.ray
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self.actors = []
        if self.pgs:
            from ray.util.placement_group import remove_placement_group

            for pg in self.pgs:
                with contextlib.suppress(Exception):
                    remove_placement_group(pg)
            self.pgs = []
        if self.connected:  # stops a local instance; only disconnects from a cluster
            ray.shutdown()

    def abort(self) -> None:
        """After an error here, workers may be blocked in a collective: kill them."""
        self._stop()

    def shutdown(self) -> None:
        if not self.closed:
            with contextlib.suppress(Exception):  # the end of a run: close what can be closed, then kill
                self.ray.get([a.run.remote(("close",), None) for a in self.actors],
                             timeout=min(60.0, self.options.timeout_s))
        self._stop()


class _NotMainThreadFilter(logging.Filter):
    """Ray warns that it sets no SIGTERM handler when it connects from a thread other than the main one
    (as rlx does, to bound the connection time); rlx stops its actors itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "not the main thread" not in record.getMessage()


_ADDRESS_HINT = ("Start the cluster first (`ray start --head --port=6379` on the head node), check "
                 "launcher.address ('auto' on a node of the cluster, HOST:PORT of the head otherwise), or leave "
                 "launcher.address unset to start a local Ray instance.")


def _probe(address: str, timeout_s: float) -> None:
    """Fail fast when nothing listens at ``address``: ray.init would retry it for minutes."""
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise UserError(f"launcher.address={address!r} is not 'auto', 'HOST:PORT' or 'ray://HOST:PORT'.",
                        _ADDRESS_HINT)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=min(timeout_s, 10.0)):
            pass
    except OSError as exc:
        raise UserError(f"Cannot reach the Ray cluster at launcher.address={address!r}: {exc.strerror or exc}.",
                        _ADDRESS_HINT) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def build(options: RayOptions | None, ctx: BuildContext) -> RayLauncher:
    options = options or RayOptions()
    cfg = ctx.config
    device = cfg.trainer.device if cfg is not None else "auto"
    seed = cfg.trainer.seed if cfg is not None else 0
    launcher = RayLauncher(options, device, seed)
    launcher.balanced_roles = balanced_roles(cfg)
    return launcher


@hookimpl
def rlx_launchers() -> list[Component]:
    return [Component(kind="launcher", name="ray", factory=build, config_model=RayOptions,
                      summary="Workers in Ray actors, on a local Ray instance or a running cluster (many nodes): "
                      "one placement group, torch.distributed among the actors (pip install 'rlx[ray]').",
                      extra={"requires": [Requirement("ray", "ray", "pip install 'rlx[ray]'")]})]
