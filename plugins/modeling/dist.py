"""torch.distributed for the torch-based backends: the process group and a rank's device, and PyTorch
distributed checkpoints (DCP) read safely (a metadata file is unpickled with a closed set of classes, never
running code). The fsdp backends write DCP checkpoints; megatron's converter and ``rlx export`` read them.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

from rlx.errors import UserError
from rlx.plugins.modeling.model import pick_device

DCP_DIR = "dcp"


def ensure_process_group(device: str) -> None:
    """A one-rank group (gloo on the CPU, NCCL on a GPU) when no launcher initialised one."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", store=dist.HashStore(),
                            rank=0, world_size=1)


def rank_device(requested: str) -> str:
    """This rank's device: ``cpu``, or the GPU of its local rank (``LOCAL_RANK``, else rank modulo the
    visible GPUs), which becomes the current CUDA device."""
    import torch
    import torch.distributed as dist

    device = pick_device(requested)
    if device == "cpu":
        return device
    if ":" in device:
        index = int(device.split(":", 1)[1])
    else:
        count = torch.cuda.device_count()
        if count == 0:
            raise UserError(f"trainer.device={requested} but no GPU is visible.",
                            "Use trainer.device=cpu, or run on a machine with a GPU.")
        rank = dist.get_rank() if dist.is_initialized() else 0
        index = int(os.environ.get("LOCAL_RANK", rank % count))
    torch.cuda.set_device(index)
    return f"cuda:{index}"


# The globals a DCP ``.metadata`` pickle of model and optimizer state refers to; nothing else is built.
# Each one only builds a plain value: a dataclass, an enum member, a path, a size, a dtype or layout
# looked up by name.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    # megatron-core's torch_dist checkpoints (read by rlx export) keep every rank's save plan in the index
    ("torch.distributed.checkpoint.planner", name) for name in (
        "SavePlan", "WriteItem", "TensorWriteData", "WriteItemType")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):  # pickled by name
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def read_dcp_metadata(stream: Any, path: str) -> Any:
    """The ``Metadata`` of a DCP checkpoint, read without running code; anything else is refused."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(stream).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError) as exc:
        raise UserError(f"Refused to load {path}: its metadata is not a plain DCP checkpoint index that can be "
                        f"read without running code ({exc}).",
                        "rlx never unpickles arbitrary objects from checkpoints. Resume from a checkpoint "
                        "written by rlx.") from None
    if not isinstance(metadata, Metadata):
        raise UserError(f"Refused to load {path}: its metadata holds a {type(metadata).__name__}, not a "
                        "DCP Metadata.", "Resume from a checkpoint written by rlx.")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", "")
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise UserError(f"Refused to load {path}: it points at a file outside its folder ({name!r}).",
                            "Resume from a checkpoint written by rlx.")
    return metadata


def safe_dcp_reader(path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        """DCP's file reader with metadata read by :func:`read_dcp_metadata` instead of ``pickle.load``
        (once per reader: each ``dcp.load`` asks again); the tensor payloads themselves are read by DCP with
        ``torch.load(weights_only=True)``."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            meta_path = self._get_metadata_path(kwargs.get("rank"))
            read: dict[str, Any] = self.__dict__.setdefault("_rlx_read", {})
            metadata = read.get(str(meta_path))
            if metadata is None:
                try:
                    with self.fs.create_stream(meta_path, "rb") as stream:
                        metadata = read_dcp_metadata(stream, str(meta_path))
                except FileNotFoundError:
                    raise UserError(f"{meta_path} is missing: {path} is not a complete sharded checkpoint.",
                                    "Resume from another checkpoint.") from None
                read[str(meta_path)] = metadata
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(path)


def dcp_failure(exc: BaseException) -> str:
    """The cause of a failed DCP read in one line (DCP gathers every rank's traceback into one text)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _safe_planner() -> Any:
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        """Non-tensor entries (optimizer hyper-parameters) load with ``weights_only=True``; DCP's own
        ``load_bytes`` unpickles them in full."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
                raise UserError(f"Refused to load the checkpoint entry {fqn}: it is not a plain value that can "
                                f"be read without running code ({exc}).",
                                "Resume from a checkpoint written by rlx.") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafeLoadPlanner(allow_partial_load=False)
