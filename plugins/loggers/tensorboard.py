"""The ``tensorboard`` logger: TensorBoard event files in the run folder (no service, no network).

- Every numeric metric is a scalar under its own name (``reward/mean``, ``actor/kl_loss``, ...), stored
  as a float64 tensor so the values read back are the values logged (classic scalars are float32).
- The resolved config is one text entry, ``config`` (YAML in a code block), at step 0.
- The sample rows are a text entry, ``samples`` (a Markdown table), at their step.
- A resumed run purges what the interrupted run logged after the checkpoint it resumes from.

View with ``tensorboard --logdir <output_dir>/tensorboard``; read back with :func:`read_event_files`.
The writer is torch's ``SummaryWriter``, which needs the ``tensorboard`` package.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlx import Component, hookimpl
from rlx.context import BuildContext
from rlx.errors import UserError, require
from rlx.plugins.loggers._common import cell, numbers, sample_columns
from rlx.registry import Requirement
from rlx.run.files import folder_option_problem, logger_folder


class TensorboardOptions(BaseModel):
    """Options of the ``tensorboard`` logger."""

    model_config = ConfigDict(extra="forbid")

    logdir: str | None = Field(None, description="Folder of the event files: a relative one lies in the run's output "
                               "folder, an absolute one (or ~/...) is used as given. "
                               "Default: <output_dir>/tensorboard.")
    flush_secs: int = Field(10, ge=1, le=3600, description="Write buffered events to disk at least this often.")
    samples: bool = Field(True, description="Log the sample rows as a Markdown table (text entry `samples`).")

    @field_validator("logdir")
    @classmethod
    def _inside(cls, v: str | None) -> str | None:
        problem = None if v is None else folder_option_problem(v, "tensorboard")
        if problem is not None:
            raise ValueError(problem)
        return v


def _markdown_cell(value: Any) -> str:
    return str(cell(value)).replace("|", "\\|").replace("\n", "<br>")


def samples_markdown(rows: list[dict[str, Any]]) -> str:
    columns = sample_columns(rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_markdown_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


class TensorboardLogger:
    def __init__(self, writer: Any, logdir: Path, samples: bool) -> None:
        self.writer = writer
        self.logdir = logdir
        self.samples = samples

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self.writer is None:
            return
        for key, value in numbers(metrics).items():
            self.writer.add_scalar(key, value, int(step), new_style=True, double_precision=True)

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        if self.writer is None or not self.samples or not rows:
            return
        self.writer.add_text("samples", samples_markdown(rows), int(step))

    def finish(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()


def build(options: TensorboardOptions | None, ctx: BuildContext) -> TensorboardLogger:
    import yaml

    options = options or TensorboardOptions()
    require("tensorboard", "tensorboard", "The tensorboard logger")
    from torch.utils.tensorboard import SummaryWriter

    run = ctx.run
    logdir = logger_folder(options.logdir, run.output_dir, "tensorboard")
    try:
        logdir.mkdir(parents=True, exist_ok=True)
        # purge_step: TensorBoard hides the events the interrupted run wrote after the checkpoint, so a
        # resumed run's steps are not shown twice.
        writer = SummaryWriter(str(logdir), flush_secs=options.flush_secs,
                               purge_step=run.resumed_step + 1 if run.resumed else None)
    except OSError as exc:
        raise UserError(f"The tensorboard logger cannot write to {logdir}: {exc}",
                        "Check that the folder is writable, or set loggers.tensorboard.logdir.") from exc
    if not run.resumed:
        # TensorBoard treats the first START of a log as the run's beginning and each later one (the one
        # purge_step writes on resume) as a restart that hides the steps at or after it; without this first
        # one, the resumed run's START would be taken for the beginning and nothing would be hidden.
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        writer.file_writer.add_event(Event(step=0, session_log=SessionLog(status=SessionLog.START)))
    if run.config and not run.resumed:
        text = yaml.safe_dump(dict(run.config), sort_keys=False)
        writer.add_text("config", f"```yaml\n{text}```", 0)
    return TensorboardLogger(writer, logdir, options.samples)


def read_event_files(logdir: str | os.PathLike[str]) -> dict[str, list[tuple[int, Any]]]:
    """Every entry of the event files in ``logdir``: ``{tag: [(step, value), ...]}`` in step order.

    Scalars come back as floats and text entries (``config``, ``samples``) as str; read with the
    ``EventAccumulator`` TensorBoard's plugins use, which applies a resumed run's purge.
    """
    require("tensorboard", "tensorboard", "Reading TensorBoard event files")
    from tensorboard.backend.event_processing import plugin_event_accumulator as pea
    from tensorboard.util import tensor_util

    acc = pea.EventAccumulator(str(logdir), size_guidance={pea.TENSORS: 0})
    acc.Reload()
    out: dict[str, list[tuple[int, Any]]] = {}
    for tag in acc.Tags().get("tensors", []):
        values: list[tuple[int, Any]] = []
        for e in acc.Tensors(tag):
            item = tensor_util.make_ndarray(e.tensor_proto).reshape(-1)[0]
            if isinstance(item, bytes):
                values.append((int(e.step), item.decode("utf-8")))
            else:
                values.append((int(e.step), float(item)))
        out[tag.removesuffix("/text_summary")] = sorted(values, key=lambda sv: sv[0])
    return out


@hookimpl
def rlx_loggers() -> list[Component]:
    return [Component(kind="logger", name="tensorboard", factory=build, config_model=TensorboardOptions,
                      summary="Writes TensorBoard event files (metrics, config, samples) in the run folder.",
                      extra={"requires": [Requirement("tensorboard", "tensorboard",
                                                      "pip install 'rlx[tensorboard]'")]})]
