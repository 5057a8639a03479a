"""The ``jsonl`` logger: metrics as JSON Lines in the run's output folder.

File format (a contract: ``rlx`` tools and user scripts read it back with :func:`read_metrics`):

``<output_dir>/metrics.jsonl`` (the name is the ``filename`` option) holds one JSON object per
line, one line per ``log`` call, in the order they were logged::

    {"step": 12, "time": 1718000000.5, "reward/mean": 0.41, "actor/pg_loss": -0.012, ...}

- ``step`` (int) is the training step; ``time`` (float) the Unix time the line was written.
- Every other key is a metric name exactly as the trainer emitted it (``group/name``), and its
  value a float. A value that is NaN or infinite is written as ``null`` so that every line stays
  valid JSON. Metric values that are not numbers (rare) are kept as strings.
- Each line is written and flushed at once, so a crash loses no logged step; only a line being
  written at the moment of the crash can be cut short, and :func:`read_metrics` skips such a last
  line.
- A fresh run that finds an old file moves it aside to ``<filename>.prev-<YYYYmmdd-HHMMSS>``
  and starts a new one. A resumed run first drops the lines of steps after the checkpoint it resumes
  from (the interrupted run logged them, the resumed run logs them again), rewriting the file
  atomically, then appends: the file holds each step once.

``<output_dir>/samples.jsonl`` (the ``samples_filename`` option) holds the rows passed to
``log_samples``, one object per row: ``{"step": 12, "time": ..., "prompt": ..., "response": ...,
"reward": ...}``, with the same rules (NaN as ``null``, moved aside on a fresh run).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from rlx import Component, hookimpl
from rlx.context import BuildContext
from rlx.run.files import check_run_folder_links, open_append_nofollow, plain_name_problem, write_private
from rlx.run.metrics import read_metrics as read_metrics  # this logger's files read back (replay, plot, tests)

_RESERVED = ("step", "time")


class JsonlOptions(BaseModel):
    """Options of the ``jsonl`` logger."""

    model_config = ConfigDict(extra="forbid")

    filename: str = Field(
        "metrics.jsonl",
        description="Name of the file the metrics are written to, in the run's output folder (a plain name: "
        "no folders, not a file rlx itself writes there).",
    )
    samples_filename: str = Field(
        "samples.jsonl",
        description="Name of the file the sample rows (prompt, response, reward, ...) are written to, in the "
        "run's output folder (a plain name, not the metrics file).",
    )

    @field_validator("filename", "samples_filename")
    @classmethod
    def _plain_name(cls, v: str, info: ValidationInfo) -> str:
        own = "metrics.jsonl" if info.field_name == "filename" else "samples.jsonl"
        problem = plain_name_problem(v, own)
        if problem is not None:
            raise ValueError(f"{problem}; give a plain file name such as {own!r}")
        return v

    @model_validator(mode="after")
    def _two_files(self) -> JsonlOptions:
        if self.filename == self.samples_filename:
            raise ValueError(f"filename and samples_filename are both {self.filename!r}: metrics and samples need "
                             "two files")
        return self


def _clean(value: Any) -> Any:
    """A JSON-safe copy of ``value``: non-finite floats become None, array scalars plain numbers."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    tolist = getattr(value, "tolist", None)  # numpy and torch arrays and scalars
    if callable(tolist):
        try:
            return _clean(tolist())
        except Exception:
            pass
    try:
        return _clean(float(value))
    except (TypeError, ValueError):
        return str(value)


def _metric_value(value: Any) -> Any:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return _clean(value)
    return number if math.isfinite(number) else None


def _move_aside(path: Path) -> None:
    """Rename an existing, non-empty ``path`` to ``<path>.prev-<timestamp>`` (never overwriting)."""
    if not path.exists() or path.stat().st_size == 0:
        return
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.prev-{stamp}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.prev-{stamp}-{n}")
        n += 1
    os.replace(path, target)


def _drop_after(path: Path, step: int) -> None:
    """Rewrite ``path`` without the records of steps after ``step`` (and without a line cut short by a
    crash), atomically: a temporary file is written, flushed and renamed over the old one."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("step"), int) and obj["step"] <= step:
            kept.append(line + "\n")
    write_private(path, "".join(kept))


class JsonlLogger:
    """Appends one JSON object per ``log`` call to ``<output_dir>/<filename>``; see the module doc."""

    def __init__(self, metrics_path: str | os.PathLike[str], samples_path: str | os.PathLike[str],
                 resumed: bool = False, resumed_step: int = 0) -> None:
        self.path = Path(metrics_path)
        self.samples_path = Path(samples_path)
        for p in (self.path, self.samples_path):
            p.parent.mkdir(parents=True, exist_ok=True)
            check_run_folder_links(p.parent, [p.name])
            if resumed:
                _drop_after(p, resumed_step)
            else:
                _move_aside(p)

    @staticmethod
    def _append(path: Path, lines: list[str]) -> None:
        # Opened per call: every line reaches the OS as soon as it is logged, and no handle is left
        # open when a run dies without calling finish().
        # A link in the file's place is refused, never written through.
        with os.fdopen(open_append_nofollow(path), "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
            f.flush()

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        row: dict[str, Any] = {"step": int(step), "time": time.time()}
        for key, value in metrics.items():
            if key not in _RESERVED:
                row[str(key)] = _metric_value(value)
        self._append(self.path, [json.dumps(row, allow_nan=False, ensure_ascii=False)])

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        if not rows:
            return
        now = time.time()
        lines = []
        for r in rows:
            obj: dict[str, Any] = {"step": int(step), "time": now}
            obj.update({str(k): _clean(v) for k, v in r.items() if k not in _RESERVED})
            lines.append(json.dumps(obj, allow_nan=False, ensure_ascii=False))
        self._append(self.samples_path, lines)

    def finish(self) -> None:
        """Nothing to close: every line is already written."""


def build(options: JsonlOptions | None, ctx: BuildContext) -> JsonlLogger:
    options = options or JsonlOptions()
    out = Path(ctx.run.output_dir)
    return JsonlLogger(out / options.filename, out / options.samples_filename, resumed=ctx.run.resumed,
                       resumed_step=ctx.run.resumed_step)


@hookimpl
def rlx_loggers() -> list[Component]:
    return [Component(kind="logger", name="jsonl", factory=build, config_model=JsonlOptions,
                      summary="Writes metrics as JSON Lines to <output_dir>/metrics.jsonl.")]
