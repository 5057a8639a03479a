"""The files of a run folder, written and read as data: never through a symbolic link, never outside.

- :func:`write_private` writes a file atomically (a new temporary file in the same folder, flushed, renamed over
  the old one) without following a link: a link planted in the file's place is replaced, not written through.
- :func:`open_append_nofollow` opens a file for appending, refusing a link in its place.
- :func:`check_run_folder_links` refuses a run folder whose own files (``config.yaml``, ``metrics.jsonl``,
  ``checkpoints``, ...) are symbolic links, naming each.
- :func:`printable` escapes the control characters of a string read from a file before it reaches a terminal.

A file rlx creates in a private folder (one that only its owner can enter, as ``trainer.private_run_dir``
makes the run folder) is created 0600; in any other folder it is created as the umask says.
"""

from __future__ import annotations

import errno
import os
import stat
import unicodedata
from collections.abc import Iterable
from pathlib import Path

from rlx.errors import UserError

# The names rlx itself writes in a run folder: no logger file-name option may take one of them.
RUN_FILES = ("config.yaml", "provenance.json", "metrics.jsonl", "samples.jsonl", "checkpoints", "hf_model",
             "replay", "COMPLETE", "mlflow.db", "mlartifacts", "tensorboard", "swanlab", "wandb",
             ".rlx-export", ".rlx-mlflow-run-id", ".rlx-wandb-run-id", ".rlx-swanlab-run-id")
# Of those, the ones whose being a link would make rlx read or write elsewhere.
LINK_CHECKED = ("config.yaml", "provenance.json", "metrics.jsonl", "samples.jsonl", "checkpoints", "hf_model",
                "mlflow.db", "mlartifacts", "tensorboard", ".rlx-mlflow-run-id", ".rlx-wandb-run-id")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def is_private(folder: str | os.PathLike[str]) -> bool:
    """Whether only the owner can enter ``folder`` (no group or other permission bits)."""
    try:
        return stat.S_IMODE(os.stat(folder).st_mode) & 0o077 == 0
    except OSError:
        return False


def make_tree_private(folder: str | os.PathLike[str]) -> None:
    """Make ``folder`` and everything under it owner-only (folders 0700, files 0600), never following a
    link (a link itself is left as it is)."""
    root = Path(folder)
    if not root.is_symlink():
        os.chmod(root, 0o700)
    for here, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(here) / name
            if path.is_symlink():
                continue
            os.chmod(path, 0o700 if path.is_dir() else 0o600)


def _mode_for(folder: Path) -> int:
    return 0o600 if is_private(folder) else 0o666  # 0o666: the umask decides


def _link_error(path: Path) -> UserError:
    return UserError(f"{printable(str(path))} is a symbolic link; rlx does not write through links in run folders.",
                     "Remove the link (or copy the file it points at in its place) and run again.")


def write_private(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically, never through a link.

    The temporary file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` beside ``path`` (0600 in a private
    folder), flushed to disk, and renamed over ``path``: a link in ``path``'s place is replaced, its target
    left as it is, and a reader sees the old file or the new one, never a part.
    """
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    mode = _mode_for(path.parent)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    for _ in range(2):
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, mode)
            break
        except FileExistsError:  # a stale temporary file of this pid (or a planted link): not ours to follow
            tmp.unlink()
    else:  # pragma: no cover - the unlink above always frees the name
        raise FileExistsError(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def open_append_nofollow(path: str | os.PathLike[str]) -> int:
    """A file descriptor of ``path`` opened for appending (created if missing, 0600 in a private folder);
    a symbolic link in its place is refused (:class:`UserError`)."""
    path = Path(path)
    try:
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, _mode_for(path.parent))
    except OSError as exc:
        if exc.errno == errno.ELOOP or path.is_symlink():
            raise _link_error(path) from None
        raise


def check_run_folder_links(run_dir: str | os.PathLike[str], names: Iterable[str] = ()) -> None:
    """Refuse (:class:`UserError`) a run folder whose own files are symbolic links, naming each of them.

    Checked: :data:`LINK_CHECKED` and ``names`` (a logger's own file names). A folder that does not exist
    yet has nothing to check.
    """
    folder = Path(run_dir)
    if not folder.is_dir():
        return
    links = []
    for name in dict.fromkeys([*LINK_CHECKED, *names]):
        p = folder / name
        if p.is_symlink():
            links.append(f"{name} -> {printable(os.readlink(p))}")
    if links:
        raise UserError(f"The run folder {printable(str(folder))} holds symbolic links in place of its own files: "
                        + "; ".join(links) + ". rlx reads and writes a run folder's files only as they are, "
                        "never through a link (it could point anywhere).",
                        "Replace each link by a copy of the file it points at, or use another folder.")


def printable(text: object) -> str:
    """``text`` with every control, format or unassigned character (Unicode category C: ESC, newlines,
    bidi overrides, ...) written as its escape (``\\x1b``, ``\\n``, ``\\u202e``), safe to print."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(ch.encode("unicode_escape").decode("ascii") if unicodedata.category(ch)[0] == "C" else ch
                   for ch in s)


def plain_name_problem(value: str, own: str | None = None) -> str | None:
    """Why ``value`` cannot be a file name in the run folder, or None: it must be one plain name (no ``/`` or
    ``\\``, not ``.`` or ``..``, no control characters) and not a file rlx itself writes there (``own``, the
    option's default, excepted)."""
    if not value or not value.strip():
        return "an empty name"
    if "/" in value or "\\" in value or os.path.isabs(value):
        return f"{printable(value)!r} is a path, not a plain file name inside the run folder"
    if value in (".", ".."):
        return f"{value!r} is a folder, not a file name"
    if not value.isprintable():
        return f"{printable(value)!r} holds control characters"
    if value != value.strip():
        return f"{value!r} starts or ends with a space"
    if value != own and value.casefold() in {name.casefold() for name in RUN_FILES}:
        return f"{value!r} is a file rlx itself writes in the run folder (names are compared ignoring case, " \
               "as some file systems do)"
    return None


def folder_option_problem(value: str, own: str | None = None) -> str | None:
    """Why ``value`` cannot be a logger's folder option, or None. A relative folder lies inside the run folder:
    it may not climb out with ``..`` nor start with one of rlx's own names (``own`` excepted); an absolute one
    (or ``~/...``) is the user's explicit choice of another place (``rlx replay`` puts it back in the run
    folder)."""
    if not value or not value.strip():
        return "an empty folder name"
    if not value.isprintable():
        return f"{printable(value)!r} holds control characters"
    if is_outside(value):
        return None
    parts = Path(value.replace("\\", "/")).parts
    if ".." in parts:
        return f"{value!r} climbs out of the run folder with '..'; give a folder inside it, or an absolute path"
    if parts and parts[0] != own and parts[0] in RUN_FILES:
        return f"{value!r} is inside {parts[0]!r}, which rlx itself writes in the run folder"
    return None


def is_outside(value: str) -> bool:
    """Whether a logger's folder option names a place of its own (absolute, or under ``~``) rather than a
    folder inside the run folder."""
    return os.path.isabs(value) or value.startswith("~")


def logger_folder(option: str | None, output_dir: str | os.PathLike[str], default: str | None) -> Path:
    """Where a logger's folder option points: ``output_dir/default`` when unset (``output_dir`` itself when
    ``default`` is None), a relative folder inside ``output_dir``, an absolute one (or ``~/...``) as given."""
    if not option:
        return Path(output_dir) / default if default else Path(output_dir)
    if is_outside(option):
        return Path(os.path.expanduser(option))
    return Path(output_dir) / option


def _walk(tree: object, prefix: str = "") -> list[tuple[str, object]]:
    """``(dotted key, value)`` of every leaf and every mapping of ``tree`` (lists indexed ``key[i]``)."""
    out: list[tuple[str, object]] = [(prefix, tree)] if prefix else []
    if isinstance(tree, dict):
        for key, value in tree.items():
            out += _walk(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            out += _walk(value, f"{prefix}[{i}]")
    return out


def code_requests(config: object) -> list[str]:
    """What a config asks to run as code, one sentence each: a ``trust_remote_code`` that is on (a model
    folder's own Python), a reward that imports a Python file (``custom``, or any ``.py`` path under
    ``reward``), names an interpreter (``python``) or runs model-written programs outside the sandbox
    (``sandbox: none``). Empty: the config runs only installed code."""
    out = []
    covered: set[str] = set()  # the path keys of custom rewards already named
    for key, value in _walk(config):  # a mapping comes before its keys
        last = key.rsplit(".", 1)[-1]
        shown = printable(value)
        if last == "trust_remote_code" and value not in (False, None, "false", "False", 0):
            out.append(f"{key}: {'true' if value is True else shown} (runs the model folder's own Python code)")
        if not (key == "reward" or key.startswith("reward.")):
            continue
        if isinstance(value, dict) and value.get("name") == "custom":
            options = value.get("options") if isinstance(value.get("options"), dict) else {}
            path = value.get("path", options.get("path"))
            covered |= {f"{key}.path", f"{key}.options.path"}
            out.append(f"{key}.name: custom (imports the Python file {printable(path)})")
        elif last == "path" and isinstance(value, str) and value.endswith(".py") and key not in covered:
            out.append(f"{key}: {shown} (a Python file to import)")
        elif last == "python" and isinstance(value, str) and value:
            out.append(f"{key}: {shown} (an interpreter to run)")
        elif last == "sandbox" and value == "none":
            out.append(f"{key}: none (runs model-written programs outside the sandbox)")
    return out


def refuse_code(config: object, source: str, command: str) -> None:
    """Raise :class:`UserError` when ``config`` (read from ``source``, a file of a run folder) asks to run code
    (:func:`code_requests`): rlx runs a folder's code only when the person at the keyboard passes
    ``--trust-code`` to ``command``."""
    asks = code_requests(config)
    if asks:
        raise UserError(f"{printable(source)} asks to run code: " + "; ".join(asks) + ". A run folder is data: "
                        f"`rlx {command}` runs code it names only when you say so.",
                        f"Read what it names; if you trust it, run `rlx {command} ... --trust-code`.")
