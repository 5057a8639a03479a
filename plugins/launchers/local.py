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


def gather(results: list[Any]) -> Any:
    """Combine per-worker results: batches are concatenated, metric dicts averaged."""
    if len(results) == 1:
        return results[0]
    first = results[0]
    if isinstance(first, Batch):
        return Batch.concat(results)
    if isinstance(first, dict):
        return {k: sum(r[k] for r in results) / len(results) for k in first}
    return results


class LocalWorkerGroup:
    def __init__(self, role: str, workers: list[Any]) -> None:
        self.role = role
        self.workers = workers
        self.world_size = len(workers)

    def call(self, method: str, batch: Batch, *args: Any, **kwargs: Any) -> Any:
        parts = batch.chunk(self.world_size) if self.world_size > 1 else [batch]
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
