"""What the wandb, tensorboard and mlflow loggers share: the numbers of a metrics dict, the config
flattened to dotted keys, the sample rows as columns, and the file that lets a resumed run continue
the same tracked run."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Every metric whose value is a number, under its own name, as a float (NaN and inf kept).

    The services chart numbers only; the rare metric that is text is left to ``metrics.jsonl``.
    """
    out: dict[str, float] = {}
    for key, value in metrics.items():
        try:
            out[str(key)] = float(value)
        except (TypeError, ValueError):
            continue
    return out


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def sample_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The union of the rows' keys, in first-seen order."""
    columns: list[str] = []
    for row in rows:
        for key in row:
            if key not in columns:
                columns.append(str(key))
    return columns


def cell(value: Any) -> Any:
    """A table cell: numbers and text as they are, anything else as its text."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return str(value)


def read_run_id(path: Path) -> str | None:
    """The run id a previous run of this folder saved, or None."""
    if not path.is_file():
        return None
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return text or None


def save_run_id(path: Path, run_id: str) -> None:
    # Only needed to continue the same tracked run on resume: never fail the run for it.
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(run_id, encoding="utf-8")
