"""``rlx plot RUN [RUN...]``: the learning curves a user looks at first, from each run's ``metrics.jsonl``.

The panels are reward, validation accuracy, KL, entropy, response length and step time (each drawn when
at least one run has it); ``--metrics`` picks other metric names. With ``--out FILE.png`` the runs are
overlaid in one figure per metric (matplotlib, the ``plot`` extra); without it, each metric is a small
text chart in the terminal, one sparkline per run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer

from rlx.errors import UserError, did_you_mean, require

# (panel title, metric names to try in order: the first one a run has is drawn)
PANELS: list[tuple[str, list[str]]] = [
    ("reward", ["reward/mean"]),
    ("accuracy", ["val/acc", "val/reward/mean"]),
    ("KL", ["actor/kl_loss", "actor/ppo_kl", "critic/kl"]),
    ("entropy", ["actor/entropy"]),
    ("response length", ["response_length/mean"]),
    ("step time (s)", ["timing/step"]),
]
SPARKS = "▁▂▃▄▅▆▇█"
TEXT_WIDTH = 60
MAX_STEP = 2**53  # steps a float (a plot axis) holds exactly


def _metrics_file(run: str) -> Path:
    from rlx.run.data import os_error_text

    path = Path(run).expanduser()
    try:
        if path.is_dir():
            path = path / "metrics.jsonl"
        found = path.is_file()
    except OSError as exc:  # permission denied on a folder of the path, and the like
        raise UserError(f"{run}: cannot read it: {os_error_text(exc)}.") from None
    if not found:
        raise UserError(f"{run}: no metrics.jsonl there.",
                        "Give a run folder (trainer.output_dir of a run logged with the jsonl logger) or a "
                        "metrics.jsonl file.")
    return path


def _step(value: Any) -> int | None:
    """A record's step as an int, or None when it is not a whole number a float can hold exactly."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return None
    return int(value) if abs(value) <= MAX_STEP else None


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or None (NaN, infinite, too large, or not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def read_series(path: Path) -> tuple[dict[str, list[tuple[int, float]]], int, int]:
    """``({metric: [(step, value), ...]}, lines skipped, values skipped)`` of a metrics file.

    A line is skipped (and counted) when it is not a JSON object with a whole-number ``step``; the last
    record of a step wins, as after a resume. A metric is a key with a number in some record; its values
    that are not finite numbers (NaN and infinity, stored as null by the jsonl logger; text; a number too
    large for a float) are not drawn and are counted. A last line without its newline is the one a
    running job is writing, left out without a count.
    """
    from rlx.run.data import os_error_text

    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UserError(f"{path}: cannot read it: {os_error_text(exc)}.") from None
    lines = text.splitlines()
    if lines and not text.endswith(("\n", "\r")):
        lines.pop()  # still being written
    records: dict[int, dict[str, Any]] = {}
    bad_lines = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            bad_lines += 1
            continue
        step = _step(obj.get("step")) if isinstance(obj, dict) else None
        if step is None:
            bad_lines += 1
            continue
        records[step] = obj
    metrics = {key for rec in records.values() for key, value in rec.items()
               if key not in ("step", "time") and not isinstance(value, bool) and isinstance(value, (int, float))}
    out: dict[str, list[tuple[int, float]]] = {}
    bad_values = 0
    for step in sorted(records):
        for key, value in records[step].items():
            if key not in metrics:
                continue
            number = _finite(value)
            if number is None:
                bad_values += 1
            else:
                out.setdefault(key, []).append((step, number))
    return out, bad_lines, bad_values


def load_series(run: str) -> dict[str, list[tuple[int, float]]]:
    """``{metric: [(step, value), ...]}`` of a run, saying on one line what was skipped (see
    :func:`read_series`); a :class:`UserError` when nothing is left to plot."""
    path = _metrics_file(run)
    series, bad_lines, bad_values = read_series(path)
    skipped = [f"{bad_lines} line{' that is' if bad_lines == 1 else 's that are'} not a JSON object with a "
               "whole-number step" if bad_lines else "",
               f"{bad_values} value{' that is' if bad_values == 1 else 's that are'} NaN, infinite or not a number"
               if bad_values else ""]
    said = " and ".join(part for part in skipped if part)
    if not series:
        raise UserError(f"{path}: nothing to plot: no line has a whole-number step and a finite number for a "
                        "metric" + (f" (skipped {said})." if said else "."),
                        "rlx plot reads the metrics.jsonl the jsonl logger writes: one JSON object per line with "
                        "a step and metric values.")
    if said:
        typer.echo(f"Warning: {path}: skipped {said} (not drawn).", err=True)
    return series


def run_labels(runs: list[str]) -> list[str]:
    """Short names for the legend: each run's folder name, with its parent where two would clash."""
    paths = [Path(r).expanduser().resolve() for r in runs]
    paths = [p.parent if p.name == "metrics.jsonl" else p for p in paths]
    names = [p.name for p in paths]
    return [f"{p.parent.name}/{name}" if names.count(name) > 1 else name for p, name in zip(paths, names)]


def choose_panels(series: list[dict[str, list[tuple[int, float]]]],
                  metrics: list[str] | None) -> list[tuple[str, str]]:
    """(title, metric) of each panel to draw."""
    present = sorted({k for s in series for k in s})
    if metrics:
        unknown = [m for m in metrics if m not in present]
        if unknown:
            hints = "".join(did_you_mean(m, present) for m in unknown)
            raise UserError(f"No run has the metric(s) {', '.join(unknown)}.{hints}",
                            f"Metrics in these runs: {', '.join(present)}.")
        return [(m, m) for m in metrics]
    chosen = []
    for title, names in PANELS:
        found = next((n for n in names if any(n in s for s in series)), None)
        if found is not None:
            chosen.append((title, found))
    if not chosen:
        raise UserError("None of the runs has any of the usual metrics (reward/mean, val/acc, actor/kl_loss, "
                        "actor/entropy, response_length/mean, timing/step).",
                        "Name the ones to plot with --metrics.")
    return chosen


def sparkline(values: list[float], width: int = TEXT_WIDTH) -> str:
    """``values`` as at most ``width`` block characters (averaged in equal bins), scaled to their range."""
    if not values:
        return ""
    if len(values) > width:
        binned = []
        for i in range(width):
            lo, hi = i * len(values) // width, (i + 1) * len(values) // width
            part = values[lo:max(hi, lo + 1)]
            binned.append(sum(part) / len(part))
        values = binned
    low, high = min(values), max(values)
    if high == low:
        return SPARKS[len(SPARKS) // 2 - 1] * len(values)
    return "".join(SPARKS[round((v - low) / (high - low) * (len(SPARKS) - 1))] for v in values)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def text_chart(panels: list[tuple[str, str]], series: list[dict[str, list[tuple[int, float]]]],
               labels: list[str]) -> str:
    width = max(len(label) for label in labels)
    lines = []
    for title, metric in panels:
        lines.append(f"{title} ({metric})" if title != metric else metric)
        for label, runs in zip(labels, series):
            points = runs.get(metric, [])
            if not points:
                lines.append(f"  {label:<{width}}  (none)")
                continue
            values = [v for _, v in points]
            lines.append(f"  {label:<{width}}  {sparkline(values)}  {_fmt(values[0])} -> {_fmt(values[-1])} "
                         f"(min {_fmt(min(values))}, max {_fmt(max(values))}; steps {points[0][0]}-{points[-1][0]})")
    return "\n".join(lines)


def write_png(out: Path, panels: list[tuple[str, str]], series: list[dict[str, list[tuple[int, float]]]],
              labels: list[str]) -> None:
    require("matplotlib", "plot", "rlx plot --out")
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, (title, metric) in zip(axes.flat, panels):
        for i, (label, runs) in enumerate(zip(labels, series)):
            points = runs.get(metric, [])
            if points:
                ax.plot([s for s, _ in points], [v for _, v in points], label=label, color=f"C{i % 10}",
                        marker="o" if len(points) < 3 else None, linewidth=1.5)
        ax.set_title(title if title == metric else f"{title}\n{metric}", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    legend: dict[str, object] = {}
    for ax in axes.flat:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(name, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=min(len(legend), 4) or 1,
               frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100)
    except OSError as exc:  # a folder that cannot be made or written, a file in the way, a full disk
        raise UserError(f"--out {out}: cannot write the picture there ({exc.strerror or exc}).",
                        "Give a file in a folder you can write to.") from None
    finally:
        plt.close(fig)


def plot_command(
        runs: Annotated[list[str], typer.Argument(help="Run folders (or metrics.jsonl files) to overlay.")],
        out: Annotated[Path | None, typer.Option("--out", "-o", help="Write a PNG here (needs matplotlib: "
                                                  "pip install matplotlib, or rlx's plot extra); "
                                                  "without it, text charts.")] = None,
        metrics: Annotated[list[str] | None, typer.Option(
            "--metrics", "-m", help="Metric names to plot instead of the usual ones (repeat or comma-separate), "
            "e.g. -m reward/mean,actor/grad_norm")] = None,
) -> None:
    """Learning curves (reward, accuracy, KL, entropy, response length, step time) of one or more runs."""
    wanted = [m.strip() for item in metrics or [] for m in item.split(",") if m.strip()] or None
    series = [load_series(run) for run in runs]
    labels = run_labels(runs)
    panels = choose_panels(series, wanted)
    if out is None:
        typer.echo(text_chart(panels, series, labels))
        return
    if out.suffix.lower() != ".png":
        raise UserError(f"--out {out}: rlx plot writes PNG files; name it *.png.")
    write_png(out, panels, series, labels)
    typer.echo(f"Wrote {out}: {', '.join(m for _, m in panels)} for {len(runs)} run(s).")
