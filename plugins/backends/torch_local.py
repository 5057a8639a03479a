"""The ``torch`` training backend: plain PyTorch on one process (CPU or one GPU).

The worker is :class:`rlx.plugins.modeling.worker.TorchWorker` (shared with the fsdp backends, which shard it,
and with ``rlx rm``); this module is the backend around it: its options, the role settings from the config,
and its registration.
"""

from __future__ import annotations

from rlx import Component, _compat, hookimpl
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


# Names that lived here in rlx 0.1 (issue 26 moved them); kept for one release, with a DeprecationWarning.
__getattr__ = _compat.moved_attributes(__name__, {
    "CXX_COMPILERS": "rlx.plugins.modeling.compile",
    "DEFAULT_CHUNK_SIZE": "rlx.records",
    "LAYOUT_KWARG": "rlx.plugins.modeling.packing",
    "MODEL_FILE": "rlx.plugins.modeling.worker",
    "OPTIM_FILE": "rlx.plugins.modeling.worker",
    "PACKED_SDPA": "rlx.plugins.modeling.packing",
    "PackedLayout": "rlx.plugins.modeling.packing",
    "check_attention": "rlx.plugins.modeling.model",
    "chunked_head": "rlx.plugins.modeling.head",
    "compile_decoder_layers": "rlx.plugins.modeling.compile",
    "forward_micro_batch_size": "rlx.plugins.modeling.model",
    "fused_head_supported": "rlx.plugins.modeling.head",
    "load_value_model": "rlx.plugins.modeling.model",
    "lr_lambda": "rlx.plugins.modeling.model",
    "model_inputs": "rlx.plugins.modeling.packing",
    "packed_sdpa": "rlx.plugins.modeling.packing",
    "pick_device": "rlx.plugins.modeling.model",
    "response_log_probs": "rlx.plugins.modeling.head",
    "response_values": "rlx.plugins.modeling.head",
    "restore_scheduler": "rlx.plugins.modeling.model",
    "rng_file": "rlx.plugins.modeling.model",
    "supports_packing": "rlx.plugins.modeling.packing",
    "trained_dtype": "rlx.plugins.modeling.model",
    "unpack": "rlx.plugins.modeling.packing",
    "use_packed_sdpa": "rlx.plugins.modeling.packing",
    "varlen_kernel_usable": "rlx.plugins.modeling.packing",
    "with_packed_layout": "rlx.plugins.modeling.packing",
})
