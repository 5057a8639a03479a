"""The ``torch`` training backend: plain PyTorch on one process (CPU or one GPU).

The worker is :class:`rlx.plugins.modeling.worker.TorchWorker` (shared with the fsdp backends, which shard it,
and with ``rlx rm``); this module is the backend around it: its options, the role settings from the config,
and its registration.
"""

from __future__ import annotations

from rlx import Component, hookimpl
from rlx.context import BuildContext
from rlx.plugins.modeling.checks import CONFIG_PROBLEMS
from rlx.plugins.modeling.model import settings_of, with_role_settings
from rlx.plugins.modeling.worker import TorchBackendOptions, TorchWorker
from rlx.protocols import RoleSpec
from rlx.records import RoleSettings


class TorchBackend:
    """Builds :class:`TorchWorker` s for roles; picklable so process launchers can ship it."""

    def __init__(self, options: TorchBackendOptions, device: str,
                 settings: dict[str, RoleSettings] | None = None) -> None:
        self.options, self.device, self.settings = options, device, settings or {}

    def worker(self, spec: RoleSpec, rank: int = 0, world_size: int = 1) -> TorchWorker:
        return TorchWorker(with_role_settings(spec, self.settings), self.options, self.device, rank, world_size)


def build(options: TorchBackendOptions | None, ctx: BuildContext) -> TorchBackend:
    device = ctx.config.trainer.device if ctx.config is not None else "auto"
    return TorchBackend(options or TorchBackendOptions(), device, settings_of(ctx))


@hookimpl
def rlx_train_backends() -> list[Component]:
    return [Component(kind="backend", name="torch", factory=build, config_model=TorchBackendOptions,
                      extra=CONFIG_PROBLEMS,
                      summary="Plain PyTorch on one process (CPU or one GPU); AdamW, grad accumulation.")]
