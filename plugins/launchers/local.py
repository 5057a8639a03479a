"""The ``local`` launcher: every worker group runs in this process, one worker per role.

The controller still talks to roles only through :class:`LocalWorkerGroup`, so a multi-process or
Ray launcher can replace this one without any change to the training loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from rlx import Component, hookimpl
from rlx.batch import Batch
from rlx.context import BuildContext


class LocalOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


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
    """Combine the data-parallel ranks' results: batches are concatenated, metric dicts averaged, lists
    (one entry per optimizer step) combined entry by entry."""
    if len(results) == 1:
        return results[0]
    first = results[0]
    if isinstance(first, Batch):
        return Batch.concat(results)
    if isinstance(first, dict):
        return {k: sum(r[k] for r in results) / len(results) for k in first}
    if isinstance(first, list):
        return [gather([r[i] for r in results]) for i in range(len(first))]
    return results


class LocalWorkerGroup:
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

    def create_group(self, role: str, build: Callable[[int, int], Any], world_size: int = 1) -> LocalWorkerGroup:
        if world_size != 1:
            raise ValueError("the local launcher runs one in-process worker per role")
        group = LocalWorkerGroup(role, [build(0, 1)])
        self.groups.append(group)
        return group

    def transfer_weights(self, src: LocalWorkerGroup, dst: LocalWorkerGroup) -> None:
        """Push the source role's full weights into every destination worker (actor -> rollout)."""
        for worker in dst.workers:
            worker.update_weights(src.workers[0].named_weights())

    def shutdown(self) -> None:
        for g in self.groups:
            g.shutdown()
        self.groups.clear()


def build(options: LocalOptions | None, ctx: BuildContext) -> LocalLauncher:
    return LocalLauncher()


@hookimpl
def rlx_launchers() -> list[Component]:
    return [Component(kind="launcher", name="local", factory=build, config_model=LocalOptions,
                      summary="All roles in this process, one worker each (CPU or one GPU).")]
