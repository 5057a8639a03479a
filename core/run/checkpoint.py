"""Checkpoints that are complete and intact, or not used at all.

A checkpoint is a folder ``<run>/checkpoints/global_step_N``. It is written under a temporary name;
then a ``COMPLETE`` marker is written and flushed last, and only then is the folder renamed into
place (the rename is atomic). The marker holds the trainer state and a manifest of every other file
in the folder: its size and SHA-256. A kill at any moment leaves either the old set of checkpoints
or the old set plus one complete new one; a file damaged later (truncated, deleted, replaced) is
caught by :func:`verify` before the checkpoint is trusted.

Folders that rlx writes into (the run folder, ``checkpoints/``, the temporary and final checkpoint
and export folders) are never reached through a symbolic link: a planted link could otherwise make
rlx write into, or delete, whatever it points at.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlx.errors import UserError

MARKER = "COMPLETE"
PREFIX = "global_step_"
FORMAT = 2  # markers of format 1 (rlx 0.1.0) hold the state but no manifest
_CHUNK = 1 << 22


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise UserError(f"{path} is a symbolic link; rlx does not write through links into run folders.",
                        "Remove the link (or choose another trainer.output_dir) and run again.")


def make_dir(path: Path, private: bool = False) -> None:
    """Create ``path`` (and its parents) unless it exists; refuse if ``path`` is a symbolic link.

    ``private``: a folder created here is readable by its owner only (0700); an existing one is left as
    it is.
    """
    _refuse_link(path)
    if path.is_dir():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700 if private else 0o777)
    except FileExistsError:
        _refuse_link(path)
        if not path.is_dir():
            raise UserError(f"{path} exists and is not a folder.", "Move it away or choose another path.") from None


def remove_tree(path: Path) -> None:
    """Delete a folder of rlx's own, or just the link if ``path`` is a symbolic link (never its target)."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size": bytes, "sha256": hex}}`` for every file under ``folder`` but the marker."""
    files: dict[str, dict[str, Any]] = {}
    for p in sorted(folder.rglob("*")):
        if p.is_symlink():
            raise RuntimeError(f"checkpoint writer left a symbolic link at {p}")
        if p.is_file() and p.name != MARKER:
            files[p.relative_to(folder).as_posix()] = {"size": p.stat().st_size, "sha256": file_digest(p)}
    return files


def save(root: Path, step: int, write: Callable[[Path], None], state: dict[str, Any],
         keep: int | None = None) -> Path:
    """Write checkpoint ``step`` under ``root`` with ``write(tmp_folder)``; return its final path.

    ``root`` and the checkpoint folder are private (0700) when the folder holding them is (the run folder)."""
    from rlx.run.files import is_private, make_tree_private

    make_dir(root, private=is_private(root.parent))
    for stale in root.glob(".tmp-*"):
        remove_tree(stale)
    final = root / f"{PREFIX}{step}"
    tmp = root / f".tmp-{PREFIX}{step}-{os.getpid()}"
    write(tmp)  # makes tmp (the folder is made private below, with what the backend wrote in it)
    marker = tmp / MARKER
    with open(marker, "w") as f:
        json.dump({"step": step, "format": FORMAT, "files": manifest(tmp), **state}, f)
        f.flush()
        os.fsync(f.fileno())
    if is_private(root):  # what the backends wrote (torch.save, safetensors) got the umask's modes
        make_tree_private(tmp)
    _fsync_dir(tmp)
    replace_dir(tmp, final)
    if keep:
        for old_ckpt in list_complete(root)[:-keep]:
            remove_tree(old_ckpt)
    return final


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished folder ``tmp`` to ``final``, replacing what is there; each rename is atomic.

    An existing ``final`` is first renamed aside (``.tmp-old-...``, removed afterwards, and by the next
    save in the same folder if a kill came in between), so ``final`` always holds a complete folder.
    ``final`` must not be a symbolic link.
    """
    _refuse_link(final)
    parent = final.parent
    for stale in parent.glob(f".tmp-old-{final.name}-*"):
        remove_tree(stale)
    if final.exists():
        old = parent / f".tmp-old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        remove_tree(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(parent)


def list_complete(root: Path) -> list[Path]:
    """Checkpoints under ``root`` that carry a ``COMPLETE`` marker, oldest first (not yet verified)."""
    if not root.is_dir():
        return []
    found = []
    for p in root.glob(f"{PREFIX}*"):
        suffix = p.name[len(PREFIX):]
        if suffix.isdigit() and not p.is_symlink() and (p / MARKER).is_file():
            found.append((int(suffix), p))
    return [p for _, p in sorted(found)]


def latest(root: Path) -> Path | None:
    done = list_complete(root)
    return done[-1] if done else None


def read_state(path: Path) -> dict[str, Any]:
    """The trainer state in ``path``'s marker; a :class:`UserError` if the marker is not valid."""
    marker = path / MARKER
    try:
        state = json.loads(marker.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{marker} is not a valid checkpoint marker ({exc}).",
                        "Delete that checkpoint folder; the previous one is used instead.") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or isinstance(state["step"], bool):
        raise UserError(f"{marker} is not a valid checkpoint marker (no integer 'step').",
                        "Delete that checkpoint folder; the previous one is used instead.")
    return state


def verify(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be trusted, or ``None`` if every file is as recorded.

    Checks that the marker is valid JSON for this folder's step, and that every file in its manifest
    exists with the recorded size and SHA-256. A marker without a manifest (written by rlx 0.1.0)
    passes the marker checks only.
    """
    try:
        state = read_state(path)
    except UserError as exc:
        return exc.message
    if path.name != f"{PREFIX}{state['step']}":
        return f"{path / MARKER} records step {state['step']}, not the folder's step"
    files = state.get("files")
    if files is None and state.get("format", 1) == 1:
        return None
    if not isinstance(files, dict) or not files:
        return f"{path / MARKER} has no valid file manifest"
    for rel, meta in files.items():
        p = path / rel
        if not isinstance(meta, dict) or ".." in Path(rel).parts or Path(rel).is_absolute():
            return f"{path / MARKER} has a bad manifest entry {rel!r}"
        if p.is_symlink() or not p.is_file():
            return f"{p} is missing"
        size = p.stat().st_size
        if size != meta.get("size"):
            return f"{p} has {size} bytes, {meta.get('size')} were written"
        if file_digest(p) != meta.get("sha256"):
            return f"{p} does not match the checksum recorded when it was written"
    return None


def latest_verified(root: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint that passes :func:`verify`, and the newer ones that failed, with why."""
    rejected: list[tuple[Path, str]] = []
    for path in reversed(list_complete(root)):
        problem = verify(path)
        if problem is None:
            return path, rejected
        rejected.append((path, problem))
    return None, rejected


def torch_load(path: str | os.PathLike[str], map_location: Any = None) -> Any:
    """``torch.load`` that never runs code: ``weights_only=True``, and a file that needs real unpickling
    (a planted pickle, or an object other than tensors and plain containers) is refused with a message."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{path} is missing from the checkpoint.",
                        "Resume from another checkpoint (delete the damaged folder).") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"Refused to load {path}: it is not a plain tensor file that can be read without "
                        f"running code ({first}).",
                        "rlx never unpickles checkpoint files, since that can run code. Use a checkpoint "
                        "written by rlx, or re-save its tensors with safetensors.") from None


def resume_point(ckpt_root: Path, run_dir: Path, mode: str) -> Path | None:
    """The checkpoint a run in ``run_dir`` resumes from under ``trainer.resume`` = ``mode`` (auto, must,
    never): the newest one whose files are all as they were written (:func:`verify`).

    A damaged newer checkpoint is named and skipped; if checkpoints exist but none verifies, the run
    stops rather than start over in a folder that holds a run.
    """
    import sys

    last, rejected = latest_verified(ckpt_root)
    for path, why in rejected:
        print(f"Warning: checkpoint {path.name} cannot be trusted ({why}); "
              + (f"using {last.name} instead." if last is not None else "skipping it."), file=sys.stderr)
    if last is None and rejected and mode != "never":
        raise UserError(f"{ckpt_root} holds checkpoints, but none can be trusted: "
                        + "; ".join(f"{p.name}: {why}" for p, why in rejected) + ".",
                        "Delete the damaged checkpoint folders to start over, or choose another "
                        "trainer.output_dir or trainer.experiment.")
    if mode == "must" and last is None:
        raise UserError(f"--resume was asked for, but {ckpt_root} holds no complete checkpoint.",
                        "Check trainer.output_dir (and trainer.project/experiment).")
    if mode == "never" and (last is not None or rejected):
        name = (last or rejected[0][0]).name
        raise UserError(f"{run_dir} already holds checkpoints (latest {name}); a new run would "
                        "overwrite them.",
                        "Choose another trainer.output_dir or trainer.experiment, or use trainer.resume=auto.")
    return last


# What a run trains and how: resuming a run folder with any of these changed would continue one run with
# another's math, so it is refused. Everything else may change on resume (length, validation, logging,
# checkpointing, micro-batching and memory, engines, launcher). A section named alone is compared whole,
# its plugin's options included; keys that only one of the two configs has (another rlx version) are skipped.
RESUME_KEYS: dict[str, tuple[str, ...] | None] = {
    "model": ("path", "tokenizer_path", "dtype", "lora_rank", "lora_alpha", "target_modules", "exclude_modules",
              "lora_dropout"),
    "data": ("train_files", "prompt_key", "max_prompt_length", "max_response_length", "train_batch_size",
             "shuffle", "filter_overlong_prompts"),
    "actor": ("optim", "model_dtype", "ppo_mini_batch_size", "ppo_epochs", "shuffle"),
    "critic": ("model_path", "optim", "model_dtype", "ppo_epochs", "cliprange_value", "warmup_steps"),
    "rollout": ("n", "temperature", "top_p", "top_k"),
    "backend": ("name",),
    "algorithm": None,
    "reward": None,
    "agent": ("name", "tools", "format", "max_turns", "interactions"),  # episodes of another shape train something else
    "trainer": ("seed",),
}


def _flat(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}"))
        return out
    return {prefix: value}


# The same for `rlx rm train`'s runs: what a reward model is trained from and on.
RM_RESUME_KEYS: dict[str, tuple[str, ...] | None] = {
    "model": ("path", "tokenizer_path", "dtype"), "data": None, "optim": None, "rm": None,
    "backend": ("name",), "trainer": ("seed",),
}


def resume_differences(old: dict[str, Any], new: dict[str, Any],
                       keys_of: dict[str, tuple[str, ...] | None] | None = None) -> list[str]:
    """``key: old -> new`` for each key of :data:`RESUME_KEYS` (or ``keys_of``) on which two run configs
    differ."""
    diffs = []
    for section, keys in (RESUME_KEYS if keys_of is None else keys_of).items():
        a, b = old.get(section) or {}, new.get(section) or {}
        if keys is not None:
            a = {k: a[k] for k in keys if k in a}
            b = {k: b[k] for k in keys if k in b}
        fa, fb = _flat(a, section), _flat(b, section)
        for key in fa:
            if key in fb and fa[key] != fb[key]:
                diffs.append(f"{key}: {fa[key]!r} -> {fb[key]!r}")
    return diffs


def check_resumable(run_dir: Path, ckpt: Path, config: dict[str, Any],
                    keys_of: dict[str, tuple[str, ...] | None] | None = None) -> None:
    """Refuse to resume the run in ``run_dir`` (from ``ckpt``) with a config that trains something else."""
    import yaml

    recorded = run_dir / "config.yaml"
    try:
        old = yaml.safe_load(recorded.read_text())
    except FileNotFoundError:
        return  # nothing recorded to compare with; the run writes its record
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UserError(f"{recorded} cannot be read ({type(exc).__name__}), so rlx cannot tell whether "
                        f"{ckpt.name} belongs to this config.",
                        "Restore that file, or set trainer.experiment=NAME for a new run.") from None
    if not isinstance(old, dict):
        raise UserError(f"{recorded} is not a mapping, so rlx cannot tell whether {ckpt.name} belongs to this "
                        "config.", "Restore that file, or set trainer.experiment=NAME for a new run.")
    diffs = resume_differences(old, config, keys_of)
    if diffs:
        raise UserError(f"{run_dir} holds a run ({ckpt.name}) whose config differs from this one in what it "
                        f"trains: {'; '.join(diffs)}. rlx resumes a run only with the settings it started with.",
                        "Set trainer.experiment=NAME (or trainer.output_dir=DIR) to start a new run, or run "
                        "again without those changes to continue this one.")
