"""Reward modeling: ``rlx rm train`` trains a sequence-classification reward model on preference pairs
(:mod:`~rlx.plugins.reward_modeling.trainer`, its config :mod:`~rlx.plugins.reward_modeling.config`). A
plugin that adds its command to the CLI through ``rlx_cli_commands``; the trained model is then scored by
the ``reward_model`` reward."""

from __future__ import annotations

from typing import Any

from rlx import hookimpl


@hookimpl
def rlx_cli_commands(app: Any) -> None:
    from rlx.plugins.reward_modeling.command import app as rm_app

    app.add_typer(rm_app, name="rm")
