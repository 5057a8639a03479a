"""Run provenance: what a run was made of, written beside ``config.yaml`` as ``provenance.json``, and the
check ``rlx replay`` makes before running it again.

``provenance.json`` holds

- ``versions``: Python, rlx, torch, transformers, and the engines and libraries that change results when
  installed (vllm, sglang, peft, ray, accelerate, tokenizers, safetensors); a package that is not
  installed is ``null``. Versions come from the installed distributions' metadata (nothing is imported);
- ``plugins``: for every component the run uses (backend, rollout, algorithm, reward, launcher,
  loggers), the distribution that provides it and its version;
- ``files``: a content hash of each data file, of the model folder's ``config.json``, weights index and
  weight files, of the critic's and the reward's model folder or file when they are local; each entry
  ``{"path", "size", "sha256", "hashed"}``;
- ``command``: the command line (``argv``) and the working directory; ``created``: the time (UTC).

Hashing is capped so that a 15 GB model does not stall the start of a run: a file of at most
:data:`FULL_HASH_LIMIT` bytes is hashed whole (``"hashed": "full"``); a larger one is hashed from its
size and :data:`SAMPLE_BLOCKS` blocks of :data:`SAMPLE_BLOCK` bytes at evenly spaced offsets, the first
and the last included (``"hashed": "sampled"``), which catches a replaced, truncated or re-saved file but
not an edit confined to the unread bytes. A model given as a hub id is hashed in the Hugging Face cache
folder it loads from, whose revision is recorded too; a hub id that is not in the cache is recorded with
no hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FILENAME = "provenance.json"
FULL_HASH_LIMIT = 256 * 2**20
SAMPLE_BLOCK = 2**20
SAMPLE_BLOCKS = 16
# Distributions whose version is recorded: rlx, the model stack, and the engines.
PACKAGES = ("rlx", "torch", "transformers", "tokenizers", "safetensors", "accelerate", "peft", "vllm", "sglang",
            "ray", "pyarrow")
# Files of a model folder that decide its weights and architecture.
MODEL_FILES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json",
               "generation_config.json", "adapter_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def file_hash(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``{"path", "size", "sha256", "hashed"}`` of a file, with the capped strategy of the module doc;
    ``{"path", "missing": true}`` when there is no such file."""
    p = Path(path)
    if not p.is_file():
        return {"path": str(p), "missing": True}
    size = p.stat().st_size
    digest = hashlib.sha256()
    with open(p, "rb") as f:
        if size <= FULL_HASH_LIMIT:
            for chunk in iter(lambda: f.read(2**20), b""):
                digest.update(chunk)
            how = "full"
        else:
            digest.update(str(size).encode())
            last = size - SAMPLE_BLOCK
            for i in range(SAMPLE_BLOCKS):
                f.seek(last * i // (SAMPLE_BLOCKS - 1))
                digest.update(f.read(SAMPLE_BLOCK))
            how = "sampled"
    return {"path": str(p), "size": size, "sha256": digest.hexdigest(), "hashed": how}


def package_versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _components(config: Mapping[str, Any]) -> list[tuple[str, str]]:
    out = [(kind, str(config[kind]["name"])) for kind in ("backend", "rollout", "algorithm", "reward", "launcher")
           if isinstance(config.get(kind), Mapping) and "name" in config[kind]]
    out += [("logger", str(name)) for name in config.get("trainer", {}).get("loggers", [])]
    return out


def plugin_versions(config: Mapping[str, Any], pm: Any) -> dict[str, dict[str, str]]:
    """``{"kind/name": {"distribution", "version"}}`` of each component the config uses."""
    out = {}
    for kind, name in _components(config):
        try:
            comp = pm.get(kind, name)
        except Exception:
            continue
        out[f"{kind}/{name}"] = {"distribution": comp.distribution, "version": comp.version}
    return out


def _model_entries(key: str, ref: str) -> dict[str, Any]:
    """Hashes of a model folder's defining files, keyed ``key:filename``; a hub id is recorded unhashed."""
    from rlx.run.data import resolve_path

    folder = Path(resolve_path(ref))
    out: dict[str, Any] = {}
    if not folder.is_dir():
        if folder.is_file():
            return {key: file_hash(folder)}
        snapshot = _hub_snapshot(ref)
        if snapshot is None:
            return {key: {"path": ref, "hub_id": True}}
        out[key] = {"path": ref, "hub_id": True, "revision": snapshot.name}
        folder = snapshot
    for name in MODEL_FILES:
        if (folder / name).is_file():
            out[f"{key}:{name}"] = file_hash(folder / name)
    for weight in sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES):
        out[f"{key}:{weight.name}"] = file_hash(weight)
    return out


def _hub_snapshot(ref: str) -> Path | None:
    """The Hugging Face cache folder a hub id loads from (its name is the revision), or None if not cached."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(ref, "config.json")
    except Exception:  # not a repo id, or no huggingface_hub
        return None
    return Path(found).parent if isinstance(found, str) else None


def hash_inputs(config: Mapping[str, Any]) -> dict[str, Any]:
    """Hashes of the run's inputs: data files, the model, the critic's and the reward's model or file."""
    from rlx.run.data import resolve_path

    files: dict[str, Any] = {}
    data = config.get("data", {})
    for section in ("train_files", "val_files"):
        for i, ref in enumerate(data.get(section) or []):
            files[f"data.{section}[{i}]"] = file_hash(resolve_path(ref))
    files.update(_model_entries("model.path", config["model"]["path"]))
    critic = config.get("critic", {}).get("model_path")
    if critic:
        files.update(_model_entries("critic.model_path", critic))
    reward_path = config.get("reward", {}).get("path")
    if isinstance(reward_path, str) and reward_path:
        files.update(_model_entries("reward.path", reward_path))
    return files


def collect(config: Mapping[str, Any], pm: Any, argv: list[str] | None = None) -> dict[str, Any]:
    """The provenance record of a run of ``config`` (the resolved config, as written to config.yaml)."""
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": {"argv": list(sys.argv if argv is None else argv), "cwd": os.getcwd()},
        "versions": package_versions(),
        "plugins": plugin_versions(config, pm),
        "files": hash_inputs(config),
    }


def write(run_dir: str | os.PathLike[str], record: Mapping[str, Any]) -> Path:
    """Write ``provenance.json`` in ``run_dir`` atomically (a temporary file renamed over it, never written
    through a link; 0600 in a private run folder)."""
    from rlx.run.files import write_private

    return write_private(Path(run_dir) / FILENAME, json.dumps(record, indent=2, sort_keys=False) + "\n")


def read(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The record of ``run_dir/provenance.json``; a :class:`~rlx.errors.UserError` naming the file and the field
    when it is not valid JSON or a field has the wrong type (a file is data: it may be damaged or crafted)."""
    from rlx.errors import UserError
    from rlx.run.files import printable

    path = Path(run_dir) / FILENAME
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{printable(path)} cannot be read as JSON: {printable(exc)}.",
                        "Restore the file from the run's copy, or remove it and replay with --force.") from None
    problem = record_problem(record)
    if problem is not None:
        raise UserError(f"{printable(path)} is not a provenance record rlx wrote: {printable(problem)}.",
                        "Restore the file from the run's copy, or remove it and replay with --force.")
    return record


def record_problem(record: Any) -> str | None:
    """What makes ``record`` unlike the record :func:`collect` writes (the first thing found), or None."""
    if not isinstance(record, dict):
        return f"the top level is a {type(record).__name__}, not an object"
    for section in ("versions", "plugins", "files"):
        if not isinstance(record.get(section, {}), dict):
            return f"{section!r} is a {type(record[section]).__name__}, not an object"
    for name, version in record.get("versions", {}).items():
        if version is not None and not isinstance(version, str):
            return f"versions.{name} is {version!r}, not a version string or null"
    for comp, entry in record.get("plugins", {}).items():
        if not (isinstance(entry, dict) and all(isinstance(entry.get(k), str) for k in ("distribution", "version"))):
            return f"plugins.{comp} is {entry!r}, not {{'distribution': str, 'version': str}}"
    for key, entry in record.get("files", {}).items():
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            return f"files.{key} is {entry!r}, not an object with a 'path' string"
        for field in ("sha256", "revision"):
            if field in entry and not isinstance(entry[field], str):
                return f"files.{key}.{field} is {entry[field]!r}, not a string"
        if not entry.get("hub_id") and not entry.get("missing") and "sha256" not in entry:
            return f"files.{key} has no sha256 (nor 'missing' or 'hub_id')"
    return None


def differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Each way the current environment differs from the recorded one, as a sentence naming the file,
    package or plugin (an empty list: nothing that provenance records has changed). Text from the record is
    printed with its control characters escaped (:func:`rlx.run.files.printable`)."""
    from rlx.run.files import printable

    out = []
    for name, was in recorded.get("versions", {}).items():
        now = current.get("versions", {}).get(name)
        if name == "python":
            if now != was:
                out.append(f"Python {was} was used, this is Python {now}")
        elif now != was:
            out.append(f"package {name}: the run used {was or 'none'}, installed now: {now or 'none'}")
    for comp, was in recorded.get("plugins", {}).items():
        now = current.get("plugins", {}).get(comp)
        if now != was:
            now_text = f"{now['distribution']} {now['version']}" if now else "not installed"
            out.append(f"plugin {comp}: the run used {was['distribution']} {was['version']}, now {now_text}")
    for key, was in recorded.get("files", {}).items():
        now = current.get("files", {}).get(key)
        if was.get("hub_id"):
            if was.get("revision") and (now or {}).get("revision") != was["revision"]:
                out.append(f"{key}: {was['path']} was revision {was['revision']}, the cache now holds "
                           f"{(now or {}).get('revision') or 'none'}")
            continue
        if was.get("missing"):
            continue
        if now is None or now.get("hub_id") or now.get("missing"):
            out.append(f"{key}: {was['path']} is gone")
        elif now.get("sha256") != was.get("sha256"):
            out.append(f"{key}: {was['path']} has changed (sha256 {was['sha256'][:12]}... then, "
                       f"{now['sha256'][:12]}... now)")
    for key in current.get("files", {}):
        if key not in recorded.get("files", {}):
            out.append(f"{key}: {current['files'][key]['path']} was not part of the recorded run")
    return [printable(line) for line in out]
