"""``rlx replay RUN``: run a finished run again from its folder, and say whether its metrics came out the same.

The run's ``config.yaml`` is trained again into ``RUN/replay`` (or ``--out``), from scratch. Before
anything loads, the run's ``provenance.json`` is checked against what is installed and on disk now: a
package, plugin or Python version that differs, or a data, model or reward file whose content hash
differs, stops the replay (exit 2) with a message naming each one; ``--force`` replays anyway and
prints them as warnings. Afterwards every metric of every step is compared with the recorded
``metrics.jsonl`` (timings and throughput left out): exit 0 when all are equal, 1 when some differ.

The run folder is data, perhaps someone else's: its files are checked before they are used (a damaged
``config.yaml``, ``provenance.json`` or ``metrics.jsonl``, or a link in place of one, is named, exit 2), a config
that asks to run code (a ``custom`` reward's Python file, ``trust_remote_code``) is refused unless
``--trust-code`` is given, and the replay writes only in its own folder (never the run's; loggers' places
outside are brought back into it). See docs/security.md.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer

from rlx.errors import UserError

# Metrics that measure the machine, not the run: left out of the comparison.
UNCOMPARED_PREFIXES = ("timing/", "perf/")


def compare_metrics(recorded: list[dict[str, Any]], replayed: list[dict[str, Any]]) -> list[str]:
    """Every (step, metric) whose value differs, is missing, or is new; empty when the runs agree."""
    def table(rows: list[dict[str, Any]]) -> dict[tuple[int, str], Any]:
        return {(row["step"], key): value for row in rows for key, value in row.items()
                if key not in ("step", "time") and not key.startswith(UNCOMPARED_PREFIXES)}

    before, after = table(recorded), table(replayed)
    out = []
    for step, key in sorted(before.keys() | after.keys()):
        was, now = before.get((step, key), "missing"), after.get((step, key), "missing")
        same = was == now or (isinstance(was, float) and isinstance(now, float) and math.isnan(was)
                              and math.isnan(now))
        if not same:
            out.append(f"step {step} {key}: {was} recorded, {now} replayed")
    return out


def _read_config(run: Path) -> tuple[Path, dict[str, Any]]:
    """The run's ``config.yaml`` as a mapping; a :class:`UserError` naming the file when it is not one."""
    import yaml

    from rlx.run.files import printable

    config_path = run / "config.yaml"
    if not config_path.is_file():
        raise UserError(f"{printable(run)}: no config.yaml there.", "Give the folder of a run that rlx train started.")
    try:
        config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UserError(f"{printable(config_path)} cannot be read as YAML: {printable(exc)}.",
                        "Restore the run's config.yaml (it is written once, when the run starts).") from None
    if not isinstance(config, dict):
        raise UserError(f"{printable(config_path)} holds a {type(config).__name__}, not the mapping of sections "
                        "that rlx train writes.", "Restore the run's config.yaml.")
    return config_path, config


def read_recorded_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a run's metrics file, each with an integer ``step``; a :class:`UserError` naming the
    file and line otherwise (read before the replay trains, so a damaged file costs no training)."""
    from rlx.run.files import printable
    from rlx.run.metrics import read_metrics

    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            if f.tell() and (f.seek(-1, 2), f.read(1))[1] != b"\n":
                raise UserError(f"{printable(path)} ends in a cut-off line (its last record has no end): the "
                                "file was truncated, or the run was stopped while writing it.",
                                "Restore the run's metrics file, or remove its last line to compare the steps "
                                "before it.")
        records = read_metrics(path, dedupe=False)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{printable(path)} cannot be read as the jsonl logger's metrics: {printable(exc)}.",
                        "Restore the run's metrics file, or remove it to replay without comparing.") from None
    for i, record in enumerate(records):
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise UserError(f"{printable(path)}: record {i + 1} has step {printable(repr(step))}, not a whole number.",
                            "Restore the run's metrics file, or remove it to replay without comparing.")
    by_step = {record["step"]: record for record in records}
    return [by_step[step] for step in sorted(by_step)]


def _check_out(run: Path, target: Path) -> None:
    """Refuse a replay folder that is the run folder, holds it, or lies in one of the run's own files."""
    from rlx.run.files import RUN_FILES, printable

    here, there = run.resolve(), target.resolve()
    own = [here / name for name in RUN_FILES if name != "replay"]
    if there == here or here.is_relative_to(there) or any(there.is_relative_to(p) for p in own):
        raise UserError(f"--out {printable(target)}: the replay would write into the run it replays "
                        f"({printable(run)}), over its record.",
                        "Leave out --out (the replay goes to RUN/replay), or give a folder outside the run.")


def _logger_places(config: dict[str, Any]) -> list[str]:
    """Overrides that bring back into the replay folder the loggers' places the run's config puts elsewhere
    (an absolute or ``~`` logdir, a tracking URI): a replay writes only in its own folder."""
    from rlx.run.files import is_outside, printable

    overrides = []
    options = config.get("loggers") if isinstance(config.get("loggers"), dict) else {}
    for name, opts in options.items():
        if not isinstance(opts, dict):
            continue
        for key in ("logdir", "tracking_uri"):
            value = opts.get(key)
            if isinstance(value, str) and (key == "tracking_uri" or is_outside(value)):
                typer.echo(f"Note: the run's loggers.{name}.{key}={printable(value)} points outside the run folder; "
                           f"the replay logs into its own folder instead.", err=True)
                overrides.append(f"loggers.{name}.{key}=null")
    return overrides


def replay_command(
        run: Annotated[Path, typer.Argument(help="The run folder (it holds config.yaml and provenance.json).")],
        force: Annotated[bool, typer.Option("--force", metavar="", help="Replay even where a version or file "
                                            "differs from the recorded run (each is printed as a warning).")]
        = False,
        out: Annotated[Path | None, typer.Option("--out", help="Run folder of the replay. Default: RUN/replay.")]
        = None,
        trust_code: Annotated[bool, typer.Option(
            "--trust-code", metavar="", help="Run the code the run's config names (a custom reward's Python file, "
            "a model folder's own code with trust_remote_code). Without it such a run is refused.")] = False,
) -> None:
    """Run a run again from its folder (config.yaml), refusing where a recorded version or file hash differs."""
    from rlx.plugins.provenance import record as provenance
    from rlx.registry import get_plugin_manager as _pm
    from rlx.run.files import check_run_folder_links, printable, refuse_code
    from rlx.run.terminal import quiet_libraries as _quiet_libraries
    from rlx.validate import load_config

    run = run.expanduser()
    if not run.is_dir():
        raise UserError(f"{printable(run)}: no config.yaml there (no such folder).",
                        "Give the folder of a run that rlx train started.")
    check_run_folder_links(run)
    config_path, config = _read_config(run)
    target = (out or run / "replay").expanduser()
    _check_out(run, target)
    pm = _pm()
    literal = str(target).replace("{", "{{").replace("}", "}}")
    overrides = [f"trainer.output_dir={json.dumps(literal)}", "trainer.resume=never", *_logger_places(config)]
    # The config is checked first, as data: its types, then whether it asks to run code, before anything loads.
    try:
        checked = load_config(pm, config_file=[str(config_path)], overrides=overrides, check_files=False)
    except UserError as exc:
        raise UserError(f"{printable(config_path)} is not a config this rlx accepts. {exc.message}", exc.hint) from None
    if not trust_code:
        refuse_code(checked.as_dict(), str(config_path), "replay")
    metrics_name = str(getattr(checked.options.get("loggers.jsonl"), "filename", "metrics.jsonl"))
    check_run_folder_links(run, [metrics_name])
    recorded_metrics = read_recorded_metrics(run / metrics_name) if (run / metrics_name).is_file() else None

    problems: list[str] = []
    if not (run / provenance.FILENAME).is_file():
        problems.append(f"{printable(run / provenance.FILENAME)} does not exist, so nothing can be checked")
    else:
        recorded = provenance.read(run)
        problems = provenance.differences(recorded, provenance.collect(checked.as_dict(), pm))
    if problems and not force:
        raise UserError(f"Cannot replay {printable(run)} as it ran: " + "; ".join(problems) + ".",
                        "Restore them, or pass --force to replay anyway.")
    for problem in problems:
        typer.echo(f"Warning: {problem}", err=True)

    resolved = load_config(pm, config_file=[str(config_path)], overrides=overrides, check_files=True,
                           check_run_dir=True)
    _quiet_libraries()
    from rlx.run.metrics import read_metrics
    from rlx.trainer import Trainer

    trainer = Trainer(resolved, pm)
    trainer.fit()
    typer.echo(f"Replay folder: {trainer.run_dir}")
    replayed = trainer.run_dir / metrics_name
    if recorded_metrics is None or not replayed.is_file():
        typer.echo("No metrics.jsonl in both folders (the jsonl logger was off): nothing to compare.")
        return
    differ = compare_metrics(recorded_metrics, read_metrics(replayed, dedupe=True))
    if differ:
        typer.echo(f"The replay differs from the recorded run in {len(differ)} value(s):")
        for line in differ[:20]:
            typer.echo(f"  {printable(line)}")
        raise typer.Exit(1)
    typer.echo(f"The replay's metrics equal the recorded run's at every step ({len(recorded_metrics)}) "
               f"(timing/ and perf/ metrics left out).")
