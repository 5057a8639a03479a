"""The ``swanlab`` logger: metrics and sample rows to SwanLab (https://swanlab.cn), cloud or offline.

Mode ``auto`` (the default) never makes a run fail for want of a network or an account:

1. ``SWANLAB_MODE`` in the environment, when set, decides (``cloud``/``online``, ``offline``, ...);
2. otherwise the run goes to the cloud when an API key is configured (``SWANLAB_API_KEY``, a
   ``.env`` file, or the key saved by ``swanlab login``), and is recorded offline when not;
3. when starting a cloud (or ``local``) run fails, the run is recorded offline, with a warning.

An offline run is a folder ``<logdir>/run-<time>-<id>/`` holding ``run-<id>.swanlab``; upload it
later with ``swanlab sync <folder>``, or read its metrics back with :func:`read_offline_run`.

swanlab is imported only when the logger is built, never when plugins are listed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlx import Component, hookimpl
from rlx.context import BuildContext
from rlx.errors import UserError, require
from rlx.registry import Requirement
from rlx.run.files import folder_option_problem, logger_folder

log = logging.getLogger(__name__)

Mode = Literal["auto", "cloud", "offline", "local", "disabled"]
_RUN_ID_FILE = ".rlx-swanlab-run-id"  # in logdir: lets a resumed run continue the same cloud run


class SwanlabOptions(BaseModel):
    """Options of the ``swanlab`` logger."""

    model_config = ConfigDict(extra="forbid")

    project: str | None = Field(None, description="SwanLab project name. Default: the run's project.")
    experiment: str | None = Field(
        None, description="SwanLab experiment name. Default: the run's experiment."
    )
    mode: Mode = Field(
        "auto",
        description="auto: SWANLAB_MODE if set, else cloud when an API key is configured, else offline "
        "(a failed cloud start falls back to offline); cloud: upload to swanlab.cn; offline: write the "
        "run to disk for `swanlab sync`; local: the local dashboard (needs swanboard); disabled: nothing.",
    )
    logdir: str | None = Field(
        None, description="Folder for SwanLab's run files: a relative one lies in the run's output folder, an "
        "absolute one (or ~/...) is used as given. Default: <output_dir>/swanlab."
    )
    workspace: str | None = Field(
        None, description="SwanLab workspace (organization) of the project. Default: your own account."
    )

    @field_validator("logdir")
    @classmethod
    def _inside(cls, v: str | None) -> str | None:
        problem = None if v is None else folder_option_problem(v, "swanlab")
        if problem is not None:
            raise ValueError(problem)
        return v


# ---------------------------------------------------------------------------------------------
# Mode selection
def _has_api_key() -> bool:
    """Whether swanlab would find an API key: environment, .env, secrets dir or a saved login."""
    if os.environ.get("SWANLAB_API_KEY", "").strip():
        return True
    try:  # swanlab 0.10: the settings object resolves env, .env files and the saved .netrc login
        from swanlab.sdk.internal.settings import create_settings

        return bool(create_settings().api_key)
    except Exception:
        pass
    try:
        import swanlab

        return bool(getattr(swanlab.Settings(), "api_key", None))
    except Exception:
        return False


def resolve_mode(mode: str) -> str:
    """The swanlab mode (``online``, ``offline``, ``local`` or ``disabled``) for an option value."""
    if mode == "auto":
        env = os.environ.get("SWANLAB_MODE", "").strip().lower()
        if env:
            mode = env
        else:
            return "online" if _has_api_key() else "offline"
    return {"cloud": "online"}.get(mode, mode)


# ---------------------------------------------------------------------------------------------
# The logger
class SwanlabLogger:
    """Forwards ``log`` and ``log_samples`` to a SwanLab run started by :func:`build`."""

    def __init__(self, run: Any, swanlab: Any, mode: str) -> None:
        self.run = run
        self.mode = mode
        self._swanlab = swanlab

    @property
    def run_dir(self) -> Path | None:
        """The folder of the run's files (None in disabled mode)."""
        if self.run is None or self.mode == "disabled":
            return None
        try:
            return Path(self.run.dir)
        except Exception:
            return None

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self.run is None:
            return
        data: dict[str, float] = {}
        for key, value in metrics.items():
            try:
                data[str(key)] = float(value)
            except (TypeError, ValueError):
                continue  # SwanLab charts numbers only
        if data:
            self.run.log(data, step=int(step))

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        if self.run is None or not rows:
            return
        Text = getattr(self._swanlab, "Text", None)
        if Text is None:
            return
        texts = []
        for row in rows:
            body = "\n\n".join(f"{k}: {v}" for k, v in row.items() if k != "reward")
            caption = f"reward {_fmt(row['reward'])}" if "reward" in row else None
            texts.append(Text(body, caption=caption))
        self.run.log({"samples": texts}, step=int(step))

    def finish(self) -> None:
        run, self.run = self.run, None
        if run is not None and getattr(run, "alive", True):
            run.finish()


def _fmt(value: Any) -> str:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return str(value)
    return f"{x:.4g}" if math.isfinite(x) else str(x)


def build(options: SwanlabOptions | None, ctx: BuildContext) -> SwanlabLogger:
    options = options or SwanlabOptions()
    swanlab = require("swanlab", "swanlab", "The swanlab logger")
    run_info = ctx.run
    logdir = logger_folder(options.logdir, run_info.output_dir, "swanlab")
    mode = resolve_mode(options.mode)
    if mode not in ("online", "offline", "local", "disabled"):
        raise UserError(f"Unknown SwanLab mode {mode!r} (from SWANLAB_MODE).",
                        "Use one of: cloud, offline, local, disabled.")
    if mode != "disabled":
        logdir.mkdir(parents=True, exist_ok=True)

    kwargs: dict[str, Any] = dict(
        project=options.project or run_info.project,
        experiment_name=options.experiment or run_info.experiment,
        workspace=options.workspace,
        config=dict(run_info.config or {}),
        logdir=str(logdir),
        settings=swanlab.Settings(interactive=False),  # never wait for keyboard input mid-run
    )
    id_file = logdir / _RUN_ID_FILE
    if mode == "online" and run_info.resumed and id_file.is_file():
        run_id = id_file.read_text(encoding="utf-8").strip()
        if run_id:
            kwargs.update(id=run_id, resume="allow")

    try:
        run = swanlab.init(mode=mode, **kwargs)
    except Exception as exc:
        if mode not in ("online", "local"):
            raise UserError(f"SwanLab could not start an {mode} run in {logdir}: {exc}",
                            "Check that the folder is writable, or set the swanlab logger's mode.") from exc
        log.warning("SwanLab could not start a %s run (%s: %s); recording it offline in %s instead. "
                    "Upload it later with `swanlab sync`.", "cloud" if mode == "online" else mode,
                    type(exc).__name__, exc, logdir)
        kwargs.pop("id", None)
        kwargs.pop("resume", None)
        mode = "offline"
        run = swanlab.init(mode=mode, **kwargs)

    if mode == "online":
        # Only needed to continue the same cloud run on resume: never fail the run for it.
        with contextlib.suppress(Exception):
            id_file.write_text(str(run.id), encoding="utf-8")
    return SwanlabLogger(run, swanlab, mode)


# ---------------------------------------------------------------------------------------------
# Reading an offline run back
def _find_run_file(path: Path) -> Path:
    if path.is_file():
        return path
    found = sorted(path.glob("*.swanlab"))
    if not found:  # a logdir: take the newest run folder in it
        found = sorted(path.glob("*/*.swanlab"), key=lambda p: p.stat().st_mtime)
        found = found[-1:]
    if not found:
        raise FileNotFoundError(f"No SwanLab run file (*.swanlab) in {path}")
    return found[-1]


def read_offline_run(path: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """The scalar metrics of a run SwanLab wrote to disk: ``{key: [(step, value), ...]}``.

    ``path`` is a run folder, its ``.swanlab`` file, or a logdir (its newest run is read). The file
    is the format of swanlab 0.10: LevelDB-log framed protobuf ``Record`` messages, read with
    swanlab's own reader and message classes (so it needs the swanlab version that wrote it).
    Values are in logging order; NaN stays NaN.
    """
    require("swanlab", "swanlab", "Reading a SwanLab run")
    try:
        from swanlab.proto.swanlab.record.v1.record_pb2 import Record
        from swanlab.sdk.internal.core_python.store import DataStoreReader
    except ImportError as exc:
        raise UserError(f"This swanlab version cannot be read by rlx ({exc}).",
                        "rlx reads offline runs of swanlab 0.10.") from exc

    run_file = _find_run_file(Path(path))
    reader = DataStoreReader()
    reader.open(run_file)
    out: dict[str, list[tuple[int, float]]] = {}
    try:
        for raw in reader:
            rec = Record()
            rec.ParseFromString(raw)
            if rec.HasField("scalar"):
                s = rec.scalar
                out.setdefault(s.key, []).append((int(s.step), float(s.value.number)))
    finally:
        reader.close()
    return out


@hookimpl
def rlx_loggers() -> list[Component]:
    return [Component(kind="logger", name="swanlab", factory=build, config_model=SwanlabOptions,
                      summary="Logs to SwanLab: to the cloud when logged in, else offline to sync later.",
                      extra={"requires": [Requirement("swanlab", "swanlab", "pip install 'rlx[swanlab]'")]})]
