"""Checkpoints that are complete or absent, never half-written.

A checkpoint is a folder ``<run>/checkpoints/global_step_N``. It is written under a temporary name,
a ``COMPLETE`` marker (holding the trainer state) is written and flushed last, and only then is
the folder renamed into place; the rename is atomic. A kill at any moment leaves either the old
set of checkpoints or the old set plus one complete new one. Left-over temporary folders are
ignored and removed by the next save.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

MARKER = "COMPLETE"
PREFIX = "global_step_"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root: Path, step: int, write: Callable[[Path], None], state: dict[str, Any],
         keep: int | None = None) -> Path:
    """Write checkpoint ``step`` under ``root`` with ``write(tmp_folder)``; return its final path."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"{PREFIX}{step}"
    tmp = root / f".tmp-{PREFIX}{step}-{os.getpid()}"
    write(tmp)
    marker = tmp / MARKER
    with open(marker, "w") as f:
        json.dump({"step": step, **state}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    replace_dir(tmp, final)
    if keep:
        for old_ckpt in list_complete(root)[:-keep]:
            shutil.rmtree(old_ckpt, ignore_errors=True)
    return final


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished folder ``tmp`` to ``final``, replacing what is there; each rename is atomic.

    An existing ``final`` is first renamed aside (``.tmp-old-...``, removed afterwards, and by the next
    save in the same folder if a kill came in between), so ``final`` always holds a complete folder.
    """
    parent = final.parent
    for stale in parent.glob(f".tmp-old-{final.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if final.exists():
        old = parent / f".tmp-old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(parent)


def list_complete(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.glob(f"{PREFIX}*"):
        suffix = p.name[len(PREFIX):]
        if suffix.isdigit() and (p / MARKER).is_file():
            found.append((int(suffix), p))
    return [p for _, p in sorted(found)]


def latest(root: Path) -> Path | None:
    done = list_complete(root)
    return done[-1] if done else None


def read_state(path: Path) -> dict[str, Any]:
    return json.loads((path / MARKER).read_text())
