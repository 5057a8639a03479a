"""The ``wandb`` logger: metrics, the config and the sample table to Weights & Biases, online or offline.

Mode ``auto`` (the default) never makes a run fail for want of a network or an account:

1. ``WANDB_MODE`` in the environment, when set, decides (``online``, ``offline``, ``disabled``);
2. otherwise the run goes online when an API key is configured (``WANDB_API_KEY``, or the key that
   ``wandb login`` saved in ``~/.netrc``), and is recorded offline when not;
3. when starting an online run fails, the run is recorded offline, with a warning.

- Every numeric metric is logged under its own name at its step; the resolved config is the run's
  config; the sample rows are a ``wandb.Table`` named ``samples`` at their step.
- An offline run is a folder ``<logdir>/wandb/offline-run-<time>-<id>/``; upload it later with
  ``wandb sync <folder>``, or read it back with :func:`read_offline_run`.
- A resumed run continues the same W&B run (its id is kept in ``<output_dir>/.rlx-wandb-run-id``).

wandb is imported only when the logger is built, never when plugins are listed.
"""

from __future__ import annotations

import json
import logging
import netrc
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlx import Component, hookimpl
from rlx.context import BuildContext
from rlx.errors import UserError, require
from rlx.plugins.loggers._common import cell, numbers, read_run_id, sample_columns, save_run_id
from rlx.registry import Requirement
from rlx.run.files import folder_option_problem, logger_folder

log = logging.getLogger(__name__)

Mode = Literal["auto", "online", "offline", "disabled"]
_RUN_ID_FILE = ".rlx-wandb-run-id"


class WandbOptions(BaseModel):
    """Options of the ``wandb`` logger."""

    model_config = ConfigDict(extra="forbid")

    project: str | None = Field(None, description="W&B project. Default: the run's project.")
    name: str | None = Field(None, description="W&B run name. Default: the run's experiment.")
    entity: str | None = Field(None, description="W&B entity (user or team). Default: your default entity.")
    mode: Mode = Field(
        "auto", description="auto: WANDB_MODE if set, else online when an API key is configured, else offline "
        "(a failed online start falls back to offline); online; offline: write the run to disk for "
        "`wandb sync`; disabled: nothing.")
    logdir: str | None = Field(None, description="Folder for W&B's run files: a relative one lies in the run's "
                               "output folder, an absolute one (or ~/...) is used as given. Default: <output_dir>.")
    group: str | None = Field(None, description="W&B group of the run.")
    tags: list[str] = Field(default_factory=list, description="W&B tags of the run.")
    samples: bool = Field(True, description="Log the sample rows as a W&B table named `samples`.")

    @field_validator("logdir")
    @classmethod
    def _inside(cls, v: str | None) -> str | None:
        problem = None if v is None else folder_option_problem(v, "wandb")
        if problem is not None:
            raise ValueError(problem)
        return v


def _has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY", "").strip():
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        found = netrc.netrc(os.environ.get("NETRC") or None).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(found and found[2])


def resolve_mode(mode: str) -> str:
    """The wandb mode (``online``, ``offline`` or ``disabled``) for an option value."""
    if mode != "auto":
        return mode
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env:
        return {"dryrun": "offline", "run": "online"}.get(env, env)
    return "online" if _has_api_key() else "offline"


class WandbLogger:
    def __init__(self, run: Any, wandb: Any, mode: str, samples: bool) -> None:
        self.run = run
        self.mode = mode
        self.samples = samples
        self._wandb = wandb

    @property
    def run_dir(self) -> Path | None:
        """The run's own folder (``offline-run-...`` or ``run-...``); None in disabled mode."""
        if self.run is None or self.mode == "disabled":
            return None
        return Path(self.run.dir).parent

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self.run is None:
            return
        data = numbers(metrics)
        if data:
            self.run.log(data, step=int(step))

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        if self.run is None or not self.samples or not rows:
            return
        columns = sample_columns(rows)
        table = self._wandb.Table(columns=columns, data=[[cell(row.get(c)) for c in columns] for row in rows])
        # commit=False: the table joins the step's metrics instead of closing the step before them.
        self.run.log({"samples": table}, step=int(step), commit=False)

    def finish(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            run.finish()
            # finish() returns before wandb's service process has written the run file; teardown waits
            # for it, so the file is complete when the run ends (and when a test reads it).
            self._wandb.teardown()


def build(options: WandbOptions | None, ctx: BuildContext) -> WandbLogger:
    options = options or WandbOptions()
    wandb = require("wandb", "wandb", "The wandb logger")
    run_info = ctx.run
    mode = resolve_mode(options.mode)
    if mode not in ("online", "offline", "disabled"):
        raise UserError(f"Unknown W&B mode {mode!r} (from WANDB_MODE).", "Use one of: online, offline, disabled.")
    logdir = logger_folder(options.logdir, run_info.output_dir, None)
    if mode != "disabled":
        logdir.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = dict(
        project=options.project or run_info.project, name=options.name or run_info.experiment,
        entity=options.entity, group=options.group, tags=options.tags or None,
        config=dict(run_info.config or {}), dir=str(logdir),
        # The run folder is not a git checkout of the user's code; W&B need not look for one.
        settings=wandb.Settings(disable_git=True, silent=True),
    )
    id_file = Path(run_info.output_dir) / _RUN_ID_FILE
    previous = read_run_id(id_file) if run_info.resumed else None
    if previous is not None:
        kwargs.update(id=previous, resume="allow", allow_val_change=True)
    try:
        run = wandb.init(mode=mode, **kwargs)
    except Exception as exc:
        if mode != "online":
            raise UserError(f"W&B could not start an {mode} run in {logdir}: {exc}",
                            "Check that the folder is writable, or set loggers.wandb.mode.") from exc
        log.warning("W&B could not start an online run (%s: %s); recording it offline in %s instead. "
                    "Upload it later with `wandb sync`.", type(exc).__name__, exc, logdir)
        mode = "offline"
        run = wandb.init(mode=mode, **kwargs)
    if mode != "disabled":
        save_run_id(id_file, str(run.id))
    return WandbLogger(run, wandb, mode, options.samples)


# ---------------------------------------------------------------------------------------------
# Reading an offline run back
# A .wandb file is a 7-byte header (":W&B", a 2-byte magic, a version byte) followed by LevelDB's log
# format: 32 KiB blocks of records, each with a 7-byte header (CRC, little-endian length, type); a
# message longer than a block is cut into FIRST, MIDDLE... LAST records. Each message is a protobuf
# ``Record`` of wandb's internal protocol.
_HEADER = 7
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _messages(data: bytes) -> Iterator[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a W&B run file (no :W&B header)")
    pos, parts = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if kind == 0 and length == 0:  # zero fill at the end of a block
            pos += left
            continue
        body = data[pos + _HEADER: pos + _HEADER + length]
        if len(body) < length:  # the last record was cut short (the run is still writing or crashed)
            return
        pos += _HEADER + length
        if kind == _FULL:
            yield body
        elif kind == _FIRST:
            parts = body
        elif kind == _MIDDLE:
            parts += body
        elif kind == _LAST:
            yield parts + body
            parts = b""


def _find_run_file(path: Path) -> Path:
    if path.is_file():
        return path
    found = sorted(path.glob("*.wandb"))
    if not found:  # a logdir: its newest run
        found = sorted(path.glob("wandb/*-run-*/*.wandb"), key=lambda p: p.stat().st_mtime)[-1:]
    if not found:
        raise FileNotFoundError(f"No W&B run file (*.wandb) in {path}")
    return found[-1]


def read_offline_run(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What a W&B run file holds: ``{"metrics": {key: [(step, value), ...]}, "config": dict,
    "samples": [{"step": s, "columns": [...], "data": [[...], ...]}, ...]}``.

    ``path`` is a run folder, its ``.wandb`` file, or the logdir (its newest run is read). Metrics are
    the history's items (wandb's own ``_step``, ``_runtime``, ``_timestamp`` left out); tables are read
    from the run's ``files/`` folder.
    """
    require("wandb", "wandb", "Reading a W&B run")
    from wandb.proto import wandb_internal_pb2 as pb

    run_file = _find_run_file(Path(path))
    metrics: dict[str, list[tuple[int, Any]]] = {}
    config: dict[str, Any] = {}
    samples: list[dict[str, Any]] = []
    for raw in _messages(run_file.read_bytes()):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):  # the config given to init comes with the run record, changes later
            updates = record.run.config.update if kind == "run" else record.config.update
            for item in updates:
                key = item.key or "/".join(item.nested_key)
                if key != "_wandb":
                    config[key] = json.loads(item.value_json)
        elif kind == "history":
            step = int(record.history.step.num)
            row: dict[str, Any] = {}
            for item in record.history.item:  # a media value comes as several items, one per field
                path = [item.key] if item.key else list(item.nested_key)
                node = row
                for part in path[:-1]:
                    node = node.setdefault(part, {})
                node[path[-1]] = json.loads(item.value_json)
            for key, value in row.items():
                if key.startswith("_"):
                    continue
                if isinstance(value, dict) and value.get("_type") == "table-file":
                    table = json.loads((run_file.parent / "files" / value["path"]).read_text(encoding="utf-8"))
                    samples.append({"step": step, "key": key, "columns": table["columns"], "data": table["data"]})
                else:
                    metrics.setdefault(key, []).append((step, value))
    return {"metrics": metrics, "config": config, "samples": samples}


@hookimpl
def rlx_loggers() -> list[Component]:
    return [Component(kind="logger", name="wandb", factory=build, config_model=WandbOptions,
                      summary="Logs to Weights & Biases: online when logged in, else offline to sync later.",
                      extra={"requires": [Requirement("wandb", "wandb", "pip install 'rlx[wandb]'")]})]
