"""The batch that flows between roles: named tensors sharing a first dimension, plus per-row
Python values (data source, ground truth, ...). Nothing else rides along: what a seam needs besides the
columns is an argument of its own (a temperature, a :class:`rlx.records.LossContext`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {k: int(v.shape[0]) for k, v in self.tensors.items()}
        sizes.update({k: len(v) for k, v in self.non_tensors.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch columns differ in length: {sizes}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return int(v.shape[0])
        for lst in self.non_tensors.values():
            return len(lst)
        return 0

    def __getitem__(self, key: str) -> Any:
        if key in self.tensors:
            return self.tensors[key]
        return self.non_tensors[key]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def update(self, other: Batch | None = None, **tensors: torch.Tensor) -> Batch:
        """Add columns in place (from another batch of the same length, or tensors) and return self."""
        if other is not None:
            if len(other) != len(self):
                raise ValueError(f"cannot merge a batch of {len(other)} rows into one of {len(self)}")
            self.tensors.update(other.tensors)
            self.non_tensors.update(other.non_tensors)
        for k, v in tensors.items():
            if self.tensors or self.non_tensors:
                assert v.shape[0] == len(self), f"{k} has {v.shape[0]} rows, batch has {len(self)}"
            self.tensors[k] = v
        return self

    def select(self, *keys: str) -> Batch:
        return Batch({k: self.tensors[k] for k in keys if k in self.tensors},
                     {k: self.non_tensors[k] for k in keys if k in self.non_tensors})

    def index(self, idx: torch.Tensor | Sequence[int] | slice) -> Batch:
        """Rows picked by a slice, a list of indices or an index tensor."""
        import torch

        if isinstance(idx, slice):
            rows = list(range(len(self)))[idx]
            tensors = {k: v[idx] for k, v in self.tensors.items()}
        else:
            rows = [int(i) for i in (idx.tolist() if isinstance(idx, torch.Tensor) else idx)]
            it = torch.as_tensor(rows, dtype=torch.long)
            tensors = {k: v.index_select(0, it.to(v.device)) for k, v in self.tensors.items()}
        non = {k: [v[i] for i in rows] for k, v in self.non_tensors.items()}
        return Batch(tensors, non)

    def split(self, size: int) -> list[Batch]:
        """Consecutive chunks of ``size`` rows (the last may be shorter)."""
        return [self.index(slice(i, i + size)) for i in range(0, len(self), size)]

    def chunk(self, parts: int) -> list[Batch]:
        """``parts`` nearly equal consecutive chunks (data-parallel split)."""
        n = len(self)
        bounds = [n * i // parts for i in range(parts + 1)]
        return [self.index(slice(bounds[i], bounds[i + 1])) for i in range(parts)]

    def repeat_interleave(self, repeats: int) -> Batch:
        """Each row ``repeats`` times in a row: row 0, row 0, ..., row 1, row 1, ..."""
        tensors = {k: v.repeat_interleave(repeats, dim=0) for k, v in self.tensors.items()}
        non = {k: [x for x in v for _ in range(repeats)] for k, v in self.non_tensors.items()}
        return Batch(tensors, non)

    def to(self, device: str | torch.device) -> Batch:
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, self.non_tensors)

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        import torch

        if not batches:
            return Batch()
        first = batches[0]
        tensors = {k: torch.cat([b.tensors[k] for b in batches], dim=0) for k in first.tensors}
        non = {k: [x for b in batches for x in b.non_tensors[k]] for k in first.non_tensors}
        return Batch(tensors, non)


# Per-row tensors whose second dimension is the prompt (left-padded) or the response (right-padded).
_PROMPT_KEYS = {"prompts": "pad", "prompt_mask": 0}
_RESPONSE_KEYS = {"responses": "pad", "response_mask": 0, "rollout_log_probs": 0.0, "response_versions": 0,
                  "loss_mask": 0, "rejection_mask": 0}


def trained_mask(batch: Batch) -> torch.Tensor:
    """The response tokens the losses, advantages and their statistics count: ``response_mask`` (B, R), times
    ``loss_mask`` where the batch has one (multi-turn episodes, rlx.agent: 0 on the tokens of tool results, which
    the model reads but did not write), times ``rejection_mask`` where it has one (algorithm.rollout_correction's
    rejection: 0 on the tokens it rejected). Forward passes attend to every token of ``response_mask``."""
    mask = batch["response_mask"]
    for key in ("loss_mask", "rejection_mask"):
        if key in batch.tensors:
            mask = mask * batch[key].to(mask.device, mask.dtype)
    return mask


def concat_rollouts(parts: Sequence[Batch], pad_token_id: int) -> Batch:
    """Concatenate rollout batches whose prompts and responses were padded to different widths."""
    import torch.nn.functional as F

    if len(parts) == 1:
        return parts[0]
    out = []
    for part in parts:
        tensors = dict(part.tensors)
        for keys, left in ((_PROMPT_KEYS, True), (_RESPONSE_KEYS, False)):
            first = next(iter(keys))
            if first not in part.tensors:  # not a rollout batch (e.g. log-probs of equal width)
                continue
            width = max(p[first].shape[1] for p in parts)
            for key, fill in keys.items():
                if key in tensors and tensors[key].shape[1] < width:
                    extra = width - tensors[key].shape[1]
                    value = pad_token_id if fill == "pad" else fill
                    tensors[key] = F.pad(tensors[key], (extra, 0) if left else (0, extra), value=value)
        out.append(Batch(tensors, part.non_tensors))
    return Batch.concat(out)
