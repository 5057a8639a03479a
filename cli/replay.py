"""``rlx replay RUN``: run a finished run again from its folder, and say whether its metrics came out the same.

The run's ``config.yaml`` is trained again into ``RUN/replay`` (or ``--out``), from scratch. Before
anything loads, the run's ``provenance.json`` is checked against what is installed and on disk now: a
package, plugin or Python version that differs, or a data, model or reward file whose content hash
differs, stops the replay (exit 2) with a message naming each one; ``--force`` replays anyway and
prints them as warnings. Afterwards every metric of every step is compared with the recorded
``metrics.jsonl`` (timings and throughput left out): exit 0 when all are equal, 1 when some differ.
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


def replay_command(
        run: Annotated[Path, typer.Argument(help="The run folder (it holds config.yaml and provenance.json).")],
        force: Annotated[bool, typer.Option("--force", metavar="", help="Replay even where a version or file "
                                            "differs from the recorded run (each is printed as a warning).")]
        = False,
        out: Annotated[Path | None, typer.Option("--out", help="Run folder of the replay. Default: RUN/replay.")]
        = None,
) -> None:
    """Run a run again from its folder (config.yaml), refusing where a recorded version or file hash differs."""
    import yaml

    from rlx import provenance
    from rlx.cli.main import _pm, _quiet_libraries
    from rlx.plugins.loggers.jsonl import read_metrics
    from rlx.validate import load_config

    config_path = run / "config.yaml"
    if not config_path.is_file():
        raise UserError(f"{run}: no config.yaml there.", "Give the folder of a run that rlx train started.")
    config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    pm = _pm()
    problems: list[str] = []
    if not (run / provenance.FILENAME).is_file():
        problems.append(f"{run / provenance.FILENAME} does not exist, so nothing can be checked")
    else:
        recorded = provenance.read(run)
        problems = provenance.differences(recorded, provenance.collect(config, pm))
    if problems and not force:
        raise UserError(f"Cannot replay {run} as it ran: " + "; ".join(problems) + ".",
                        "Restore them, or pass --force to replay anyway.")
    for problem in problems:
        typer.echo(f"Warning: {problem}", err=True)

    target = out or run / "replay"
    literal = str(target).replace("{", "{{").replace("}", "}}")
    resolved = load_config(pm, config_file=[str(config_path)],
                           overrides=[f"trainer.output_dir={json.dumps(literal)}", "trainer.resume=never"],
                           check_files=True, check_run_dir=True)
    _quiet_libraries()
    from rlx.trainer import Trainer

    trainer = Trainer(resolved, pm)
    trainer.fit()
    typer.echo(f"Replay folder: {trainer.run_dir}")
    if not (run / "metrics.jsonl").is_file() or not (trainer.run_dir / "metrics.jsonl").is_file():
        typer.echo("No metrics.jsonl in both folders (the jsonl logger was off): nothing to compare.")
        return
    differ = compare_metrics(read_metrics(run, dedupe=True), read_metrics(trainer.run_dir, dedupe=True))
    if differ:
        typer.echo(f"The replay differs from the recorded run in {len(differ)} value(s):")
        for line in differ[:20]:
            typer.echo(f"  {line}")
        raise typer.Exit(1)
    steps = len(read_metrics(run, dedupe=True))
    typer.echo(f"The replay's metrics equal the recorded run's at every step ({steps}) "
               f"(timing/ and perf/ metrics left out).")
