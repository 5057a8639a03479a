"""Provenance: what a run was made from (versions, plugins, the hashes of its data and model files), written
as ``provenance.json`` when a run starts (:mod:`~rlx.plugins.provenance.record`, through ``rlx_on_train_start``),
and ``rlx replay`` (:mod:`~rlx.plugins.provenance.command`), which checks a run folder against it and trains it
again. It observes the run and never steers it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlx import hookimpl


@hookimpl
def rlx_on_train_start(config: Mapping[str, Any], output_dir: str, plugins: Any, resumed: bool) -> None:
    from rlx.plugins.provenance import record

    # A run's record is written once, by the run that made it; a resume leaves it as it is.
    if not resumed or not (Path(output_dir) / record.FILENAME).exists():
        record.write(output_dir, record.collect(config, plugins))


@hookimpl
def rlx_cli_commands(app: Any) -> None:
    from rlx.plugins.provenance.command import replay_command

    app.command("replay")(replay_command)
