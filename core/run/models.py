"""Model folders and tokenizers: a folder that cannot hold a model is named precisely, before any heavy load.

A model reference is a local folder or a hub id (``Qwen/Qwen2.5-0.5B-Instruct``). For a local folder,
:func:`check_model_folder` reads only file names, ``config.json`` and the headers of the weight files, and
says exactly what is wrong: the folder does not exist, is a file, is empty, has no ``config.json`` (or one
that is not JSON), names a ``model_type`` this version of transformers does not know, has no tokenizer
files, or has no weights (or an index whose shards are missing, or a safetensors file whose size does not
match its header). A hub id is left to ``from_pretrained``, whose failure (offline, unknown id)
:func:`load_tokenizer` turns into a message. Importing this module is cheap: transformers loads inside
the functions.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from pathlib import Path
from typing import Any

from rlx.errors import UserError, did_you_mean

# A hub id: ``name`` or ``owner/name`` (letters, digits, ``-``, ``_``, ``.``), as the hub accepts them.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")

# Files of which at least one is in every tokenizer folder: the fast tokenizer's serialisation, a
# sentencepiece or tiktoken model, or the vocabulary of a BPE / WordPiece tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "*.model", "*.spm", "*.tiktoken", "vocab.json",
                   "vocab.txt", "merges.txt")
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json",
                "pytorch_model.bin.index.json")
_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def is_local(ref: str) -> bool:
    """Whether ``ref`` means a local path rather than a hub id.

    Anything that exists on disk, starts like a path (``/``, ``.``, ``~``) or cannot be a hub id (two
    slashes, spaces) is local; ``owner/name`` that does not exist here is a hub id.
    """
    if os.path.exists(os.path.expanduser(ref)):
        return True
    if ref.startswith(("/", ".", "~")) or os.path.isabs(ref):
        return True
    return _HUB_ID.fullmatch(ref) is None


def _matching(names: list[str], patterns: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns))


def _listing(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(sorted(names)[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _folder(path: str, key: str) -> tuple[Path, list[str]]:
    """The folder and its file names; a UserError if it is missing, a file or empty."""
    folder = Path(os.path.expanduser(path))
    hint = ("Give a Hugging Face model folder (config.json, tokenizer files and weights, as written by "
            "save_pretrained) or a hub id such as Qwen/Qwen2.5-0.5B-Instruct.")
    if not folder.exists():
        raise UserError(f"{key}: the folder {path!r} does not exist.", hint)
    if not folder.is_dir():
        raise UserError(f"{key}: {path!r} is a file, not a model folder.", hint)
    try:
        names = [p.name for p in folder.iterdir()]
    except OSError as exc:
        raise UserError(f"{key}: cannot read the folder {path!r}: {exc.strerror or exc}.") from None
    if not names:
        raise UserError(f"{key}: the folder {path!r} is empty.", hint)
    return folder, names


def _run_folder_hint(folder: Path, names: list[str], path: str) -> str | None:
    """Where the model of an rlx run folder or checkpoint given as a model folder is, or None."""
    if (folder / "hf_model" / "config.json").is_file():
        return f"It is an rlx run folder: its trained model is {os.path.join(path, 'hf_model')}; give that folder."
    if "checkpoints" in names or "COMPLETE" in names:
        what = "checkpoint" if "COMPLETE" in names else "run folder"
        return (f"It is an rlx {what}: `rlx export {path} --out DIR` writes its model as a Hugging Face folder; "
                "give that folder.")
    return None


def _read_config(folder: Path, names: list[str], path: str, key: str) -> dict[str, Any]:
    if "config.json" not in names:
        raise UserError(f"{key}: the folder {path!r} has no config.json (it holds: {_listing(names)}).",
                        _run_folder_hint(folder, names, path) or
                        "A model folder written by save_pretrained has one; copy it from the model you started "
                        "from, or give the right folder.")
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{key}: {path!r}: config.json cannot be read as JSON: {exc}.") from None
    if not isinstance(config, dict):
        raise UserError(f"{key}: {path!r}: config.json holds a {type(config).__name__}, not a JSON object.")
    return config


def _check_model_type(config: dict[str, Any], path: str, key: str, trust_remote_code: bool) -> None:
    import transformers
    from transformers import CONFIG_MAPPING

    model_type = config.get("model_type")
    version = transformers.__version__
    if not isinstance(model_type, str) or not model_type:
        raise UserError(f"{key}: {path!r}: config.json has no model_type, so transformers cannot tell which "
                        "architecture it is.", "Add the model_type of the model (e.g. \"qwen2\", \"llama\").")
    if model_type in CONFIG_MAPPING:
        return
    custom = isinstance(config.get("auto_map"), dict) and "AutoConfig" in config["auto_map"]
    if custom and trust_remote_code:
        return  # the folder brings its own configuration code
    if custom:
        raise UserError(f"{key}: {path!r} is a {model_type!r} model with its own code (config.json auto_map), "
                        f"which transformers {version} does not have built in.",
                        "Set model.trust_remote_code=true to run the folder's code (only for a source you trust).")
    known = list(CONFIG_MAPPING.keys())
    raise UserError(f"{key}: {path!r}: config.json has model_type {model_type!r}, which transformers {version} "
                    f"does not know.{did_you_mean(model_type, known)}",
                    "If the model is newer than this transformers, upgrade it (pip install -U transformers); "
                    "otherwise fix model_type in config.json.")


def _safetensors_problem(file: Path) -> str | None:
    """Why a safetensors file cannot be loaded (a header that is not one, a size that does not match it),
    read from its header alone; None if it looks whole."""
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if size < 8 or length > size - 8:
                return f"its header claims {length} bytes, but the file has {size}"
            header = json.loads(f.read(length))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        return f"its header cannot be read ({type(exc).__name__})"
    expected = 8 + length + max(ends, default=0)
    if size != expected:
        return f"it has {size} bytes where its header describes {expected} (truncated or damaged)"
    return None


def _check_weights(folder: Path, names: list[str], path: str, key: str) -> None:
    for name in _matching(names, ("*.safetensors",)):
        problem = _safetensors_problem(folder / name)
        if problem is not None:
            raise UserError(f"{key}: {path!r}: the weight file {name} is not usable: {problem}.",
                            "Copy or download the file again.")
    for index in _INDEX_FILES:
        if index in names:
            try:
                weight_map = json.loads((folder / index).read_text(encoding="utf-8"))["weight_map"]
                shards = sorted(set(weight_map.values()))
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise UserError(f"{key}: {path!r}: {index} is not a weight index (a JSON object with a "
                                f"weight_map): {exc!r}.") from None
            missing = [s for s in shards if not (folder / str(s)).is_file()]
            if missing:
                raise UserError(f"{key}: {path!r}: {index} names {len(shards)} weight files, of which "
                                f"{len(missing)} are missing: {_listing(missing)}.",
                                "Copy the missing shards into the folder (an interrupted download or copy?).")
            return
    if not _matching(names, WEIGHT_FILES):
        raise UserError(f"{key}: the folder {path!r} has no weights (looked for {', '.join(WEIGHT_FILES)}; "
                        f"it holds: {_listing(names)}).",
                        "Save the model with save_pretrained, or give the folder that holds its weights.")


def _check_tokenizer(folder: Path, names: list[str], path: str, key: str, trust_remote_code: bool) -> None:
    if _matching(names, TOKENIZER_FILES):
        return
    if trust_remote_code and "tokenizer_config.json" in names:
        try:
            custom = "auto_map" in json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, TypeError):
            custom = False
        if custom:
            return  # a tokenizer class of the folder's own code names its own vocabulary files
    raise UserError(f"{key}: the folder {path!r} has no tokenizer files (looked for {', '.join(TOKENIZER_FILES)}; "
                    f"it holds: {_listing(names)}).",
                    "Save the tokenizer into the folder (tokenizer.save_pretrained(folder)), or set "
                    "model.tokenizer_path to a folder or hub id that has one.")


def check_model_folder(path: str, trust_remote_code: bool = False, *, tokenizer: bool = True,
                       weights: bool = True, key: str = "model.path") -> None:
    """Raise a :class:`UserError` saying exactly why the local folder ``path`` cannot be loaded as a model.

    Checks, in order: the folder exists, is a folder, is not empty; ``config.json`` is there, is JSON
    and names a ``model_type`` transformers knows (or brings its own code, with ``trust_remote_code``);
    tokenizer files are there (``tokenizer=False`` when the tokenizer comes from elsewhere); weights are
    there, and every shard a weight index names (``weights=False`` for a config-only check). A hub id
    (see :func:`is_local`) is not checked: ``from_pretrained`` resolves it. ``key`` names the setting in
    messages (``model.path``, ``reward.path``).
    """
    if not is_local(path):
        return
    folder, names = _folder(path, key)
    config = _read_config(folder, names, path, key)
    _check_model_type(config, path, key, trust_remote_code)
    if tokenizer:
        _check_tokenizer(folder, names, path, key, trust_remote_code)
    if weights:
        _check_weights(folder, names, path, key)


def load_tokenizer(path: str, trust_remote_code: bool, *, key: str = "model.path",
                   require_chat_template: bool = True) -> Any:
    """The tokenizer of a local folder or hub id, with a pad token and (unless ``require_chat_template``
    is off) a chat template, or a UserError.

    A local folder is checked first (it exists, is not empty, has tokenizer files); a hub id that cannot
    be loaded (offline, no such id) gets a message saying so.
    """
    from transformers import AutoTokenizer

    local = is_local(path)
    if local:
        folder, names = _folder(path, key)
        _check_tokenizer(folder, names, path, key, trust_remote_code)
    try:
        tok = AutoTokenizer.from_pretrained(os.path.expanduser(path) if local else path,
                                            trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as exc:
        text = str(exc).strip()
        if local:
            hint = ("pip install sentencepiece tiktoken" if "sentencepiece" in text or "tiktoken" in text
                    else "Check the folder's tokenizer files, or set model.tokenizer_path to another tokenizer.")
            raise UserError(f"{key}: cannot load a tokenizer from the folder {path!r}: {text}", hint) from None
        raise UserError(f"{key}: cannot load a tokenizer from the hub id {path!r} (there is no local folder of "
                        f"that name either): {text}",
                        "Give a local model folder, or a hub id that is available offline (downloaded "
                        "before, or HF_HUB_OFFLINE=0 with network access).") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None and require_chat_template:
        raise UserError(f"{key}: the tokenizer at {path!r} has no chat template.",
                        "Use an instruct/chat model, or a model.tokenizer_path whose tokenizer has one.")
    return tok


def apply_config_overrides(config: Any, overrides: dict[str, Any], *, key: str = "model.override_config") -> Any:
    """Set the attributes ``overrides`` names on the Hugging Face ``config`` (``model.override_config``) and
    return it. A mapping given for an attribute that holds a sub-config (``text_config``) sets that sub-config's
    attributes; any other value replaces the attribute whole (``rope_scaling`` takes a mapping). An attribute the
    config does not have is a :class:`~rlx.errors.ConfigError` naming it: set on a config, it would be kept and
    silently ignored by the model."""
    from rlx.errors import ConfigError

    problems = config_override_problems(config, overrides, key=key)
    if problems:
        raise ConfigError(problems)
    _set_overrides(config, overrides)
    return config


def config_override_problems(config: Any, overrides: dict[str, Any], *,
                             key: str = "model.override_config") -> list[str]:
    """What :func:`apply_config_overrides` would refuse: each attribute of ``overrides`` that ``config`` lacks."""
    problems: list[str] = []
    for name, value in overrides.items():
        where = f"{key}.{name}"
        if not hasattr(config, name):
            known = sorted(k for k in config.to_dict() if not k.startswith("_"))
            problems.append(f"{where}: the model's config ({type(config).__name__}) has no attribute {name!r}."
                            f"{did_you_mean(name, known)}")
        elif isinstance(value, dict) and _is_sub_config(getattr(config, name)):
            problems.extend(config_override_problems(getattr(config, name), value, key=where))
    return problems


def _is_sub_config(value: Any) -> bool:
    from transformers import PretrainedConfig

    return isinstance(value, PretrainedConfig)


def _set_overrides(config: Any, overrides: dict[str, Any]) -> None:
    import copy

    for name, value in overrides.items():
        if isinstance(value, dict) and _is_sub_config(getattr(config, name)):
            _set_overrides(getattr(config, name), value)
        else:
            setattr(config, name, copy.deepcopy(value))


def load_hf_config(path: str, trust_remote_code: bool, overrides: dict[str, Any] | None = None,
                   **kwargs: Any) -> Any:
    """The Hugging Face config of the model at ``path`` (``AutoConfig``, ``kwargs`` passed on) with
    ``model.override_config`` applied (:func:`apply_config_overrides`)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    return apply_config_overrides(config, overrides or {})


def check_config_overrides(cfg: Any) -> None:
    """Before any model loads: every attribute ``model.override_config`` names is one the policy's config (and
    the critic's, where ``critic.model_path`` gives another model) has; a :class:`~rlx.errors.ConfigError`
    naming each one it lacks otherwise. Reads only the configs."""
    from transformers import AutoConfig

    from rlx.errors import ConfigError
    from rlx.run.data import resolve_path

    overrides = cfg.model.override_config
    paths = [("model.path", cfg.model.path)]
    if cfg.critic.model_path:
        paths.append(("critic.model_path", cfg.critic.model_path))
    problems: list[str] = []
    for key, path in paths:
        try:
            config = AutoConfig.from_pretrained(resolve_path(path), trust_remote_code=cfg.model.trust_remote_code)
        except (OSError, ValueError) as exc:
            raise UserError(f"{key}: cannot read the model's config to check model.override_config: {exc}") from None
        found = config_override_problems(config, overrides)
        problems.extend(p if key == "model.path" else f"{p} ({key} {path!r})" for p in found)
    if problems:
        raise ConfigError(problems)
