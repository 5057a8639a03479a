"""Log-probabilities and entropies from logits, in float32 (float64 for float64 logits): the numbers every
backend, engine check and loss shares.
"""

from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, computed in float32 (float64 for float64 logits).

    H = logsumexp(z) - sum(softmax(z) * z).  Shape (…, V) -> (…).
    """
    z = logits if logits.dtype == torch.float64 else logits.float()
    probs = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (probs * z).sum(dim=-1)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] per position, computed stably in float32 (float64 for float64 logits).

    logp_t = z_t[label_t] - logsumexp(z_t).  ``logits`` (B, T, V), ``labels`` (B, T) int64 -> (B, T).
    Positions with a negative label (e.g. an ignore index of -100) get 0. Half-precision logits are
    processed one row at a time so the float32 copy never spans the whole batch.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match logits {tuple(logits.shape)}")
    valid = labels >= 0
    safe_labels = labels.clamp(min=0).unsqueeze(-1)  # (B, T, 1)

    def _rows(z: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
        z = z if z.dtype == torch.float64 else z.float()
        return z.gather(-1, lab).squeeze(-1) - torch.logsumexp(z, dim=-1)

    if logits.dtype in (torch.float32, torch.float64) or logits.dim() < 2:
        out = _rows(logits, safe_labels)
    else:
        out = torch.stack([_rows(z, lab) for z, lab in zip(logits, safe_labels, strict=True)])
    return torch.where(valid, out, torch.zeros((), dtype=out.dtype, device=out.device))
