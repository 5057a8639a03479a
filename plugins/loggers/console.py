"""The ``console`` logger: one readable line per step on stdout, and a progress bar in a terminal.

A line looks like::

    step 12/50 | reward 0.41±0.22 | len 6.1 | pg_loss -0.012 | kl 0.0031 | entropy 2.91 | grad 0.84
    | lr 1.0e-03 | 3.2 s/step | 410 tok/s

(one line on screen, broken here for width).

Only the metrics listed in :data:`LINE_FIELDS` are shown, in that order; missing ones are left out.
A step that ran validation is always printed, with its accuracy (``val acc``, greedy by default) next to
the training reward: a reward that rises on partial credit alone shows up there.
The progress bar is drawn only when stdout is a terminal; in pipes, files and CI the output is the
plain lines alone.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rlx import Component, hookimpl
from rlx.context import BuildContext


class ConsoleOptions(BaseModel):
    """Options of the ``console`` logger."""

    model_config = ConfigDict(extra="forbid")

    every: int = Field(
        1, ge=1, description="Print a line every N steps (the first and last steps are always printed)."
    )
    samples: bool = Field(
        False, description="Also print the sample rows (prompt, response, reward) when they are logged."
    )
    progress: bool = Field(True, description="Show a progress bar when stdout is a terminal.")


def fmt_number(x: float) -> str:
    """A short, stable rendering: three significant digits, scientific only for tiny values."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    a = abs(x)
    if a == 0:
        return "0"
    if a >= 1000:
        return f"{x:.0f}"
    if a < 1e-3:
        return f"{x:.1e}"
    return f"{x:.3g}"


def _sci(x: float) -> str:
    return f"{x:.1e}"


def _int(x: float) -> str:
    return f"{x:.0f}" if math.isfinite(x) else fmt_number(x)


# (metric key, label, formatter, unit suffix). A label of "" puts the unit after the value alone.
LINE_FIELDS: list[tuple[str, str, Callable[[float], str], str]] = [
    ("response_length/mean", "len", fmt_number, ""),
    ("actor/pg_loss", "pg_loss", fmt_number, ""),
    ("actor/kl_loss", "kl", fmt_number, ""),
    ("actor/entropy", "entropy", fmt_number, ""),
    ("actor/grad_norm", "grad", fmt_number, ""),
    ("actor/lr", "lr", _sci, ""),
    ("batch/equal_score_group_ratio", "same-score groups", lambda x: f"{100 * x:.0f}%", ""),
    ("val/acc", "val acc", fmt_number, ""),
    ("val/reward/mean", "val reward", fmt_number, ""),
    ("train/loss", "rm loss", fmt_number, ""),  # rlx rm train
    ("train/accuracy", "pair acc", fmt_number, ""),
    ("val/accuracy", "val pair acc", fmt_number, ""),
    ("timing/step", "", fmt_number, "s/step"),
    ("perf/tokens_per_second", "", _int, "tok/s"),
]


def _num(metrics: Mapping[str, Any], key: str) -> float | None:
    if key not in metrics:
        return None
    try:
        return float(metrics[key])
    except (TypeError, ValueError):
        return None


def _total_steps(metrics: Mapping[str, Any]) -> int | None:
    total = _num(metrics, "progress/total_steps")
    if total is None or not math.isfinite(total) or total <= 0:
        return None
    return int(total)


def format_line(metrics: Mapping[str, Any], step: int, total: int | None = None) -> str:
    """The one-line summary of a step's metrics (plain text)."""
    parts = [f"step {step}/{total}" if total else f"step {step}"]
    mean = _num(metrics, "reward/mean")
    if mean is not None:
        std = _num(metrics, "reward/std")
        parts.append(f"reward {fmt_number(mean)}" + (f"±{fmt_number(std)}" if std is not None else ""))
    for key, label, fmt, unit in LINE_FIELDS:
        value = _num(metrics, key)
        if value is None:
            continue
        text = fmt(value)
        parts.append(f"{label} {text}" if label else f"{text} {unit}")
    return " | ".join(parts)


def _clip(value: Any, limit: int = 300) -> str:
    text = str(value).replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 1] + "…"


class ConsoleLogger:
    """Prints :func:`format_line` for every ``every``-th step through a rich Console."""

    def __init__(self, options: ConsoleOptions, console: Any = None) -> None:
        if console is None:
            from rich.console import Console

            console = Console()
        self.options = options
        self.console = console
        self.total: int | None = None
        self.last_step: int | None = None
        self.last_metrics: dict[str, Any] = {}
        self.last_val_acc: float | None = None
        self.first_step: int | None = None
        self.started = time.monotonic()
        self._progress: Any = None
        self._task: Any = None
        self._finished = False

    # -- progress bar -----------------------------------------------------------------------------
    def _bar_wanted(self) -> bool:
        return self.options.progress and bool(getattr(self.console, "is_terminal", False))

    def _update_bar(self, step: int) -> None:
        if not self._bar_wanted() or self.total is None:
            return
        if self._progress is None:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[progress.description]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task("training", total=self.total)
            self._progress.start()
        self._progress.update(self._task, total=self.total, completed=min(step, self.total))

    def _stop_bar(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    # -- Logger protocol ------------------------------------------------------------------------
    def _print(self, text: str, style: str | None = None) -> None:
        # soft_wrap: a line is never broken at the console width (logs are often piped to files).
        self.console.print(text, style=style, soft_wrap=True, markup=False, highlight=False)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.total = _total_steps(metrics) or self.total
        if self.first_step is None:
            self.first_step = step
        self.last_step = step
        self.last_metrics = dict(metrics)
        self.last_val_acc = _num(metrics, "val/acc") if "val/acc" in metrics else self.last_val_acc
        validated = any(k.startswith("val/") for k in metrics)
        if step % self.options.every == 0 or step == self.first_step or step == self.total or validated:
            self._print(format_line(metrics, step, self.total))
        self._update_bar(step)

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        if not self.options.samples or not rows:
            return
        for i, row in enumerate(rows):
            head = f"sample {i} @ step {step}"
            if "reward" in row:
                head += f" | reward {_clip(row['reward'], 40)}"
            self._print(head, style="bold")
            for key, value in row.items():
                if key != "reward":
                    self._print(f"  {key}: {_clip(value)}")

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        self._stop_bar()
        # Called while an error or Ctrl-C is on its way out of the trainer (which finishes its loggers in a
        # `finally`), the run stopped: it is not done (the error's own message follows this line).
        stopped = sys.exc_info()[1] is not None
        if self.last_step is None:
            self._print("stopped before the first step" if stopped else "done: no new steps")
            return
        steps = f"step {self.last_step}" + (f"/{self.total}" if self.total else "")
        parts = [f"stopped at {steps}" if stopped else f"done: {steps}"]
        mean = _num(self.last_metrics, "reward/mean")
        if mean is not None:
            parts.append(f"{'last' if stopped else 'final'} reward {fmt_number(mean)}")
        if self.last_val_acc is not None:
            parts.append(f"last validation acc {fmt_number(self.last_val_acc)}")
        elapsed = time.monotonic() - self.started
        minutes, seconds = divmod(int(elapsed), 60)
        parts.append(f"{minutes}m{seconds:02d}s" if minutes else f"{elapsed:.1f}s")
        self._print(" | ".join(parts), style="bold")


def build(options: ConsoleOptions | None, ctx: BuildContext) -> ConsoleLogger:
    return ConsoleLogger(options or ConsoleOptions())


@hookimpl
def rlx_loggers() -> list[Component]:
    return [Component(kind="logger", name="console", factory=build, config_model=ConsoleOptions,
                      summary="Prints one line of key metrics per step, with a progress bar in a terminal.")]
