"""``rlx rm``: reward modeling. ``rlx rm train`` trains a sequence-classification reward model on preference
pairs (``rlx.plugins.reward_modeling.trainer``); heavy libraries load inside the command."""

from __future__ import annotations

from typing import Annotated

import typer

app = typer.Typer(help="Reward models: train one on preference pairs (prompt, chosen, rejected).",
                  no_args_is_help=True)

ConfigOpt = Annotated[list[str] | None, typer.Option(
    "--config", "-c", metavar="FILE", show_default=False,
    help="YAML config file (sections model, data, optim, rm, backend, trainer, loggers). Repeat it to merge "
         "several in order. A config file replaces the built-in preset: add --preset rm_tiny to start from it.")]


@app.command("train")
def train(
    config: ConfigOpt = None,
    preset: Annotated[str | None, typer.Option("--preset", help="Built-in preset (e.g. rm_tiny).")] = None,
    model: Annotated[str | None, typer.Option(
        "--model", help="A causal LM (a new reward head is put on it) or a one-output sequence classifier "
                        "(model.path).")] = None,
    backend: Annotated[str | None, typer.Option("--backend", help="Training backend (backend.name): torch.")] = None,
    resume: Annotated[bool, typer.Option("--resume", metavar="", help="Continue from the last complete "
                                         "checkpoint (fail if there is none).")] = False,
    overrides: Annotated[list[str] | None, typer.Argument(
        help="Dotted overrides, e.g. data.train_files=pairs.parquet rm.center_rewards_coefficient=0.01",
        show_default=False)] = None,
) -> None:
    """Train a reward model with the Bradley-Terry loss. With no model, config or data, runs the built-in
    preference task (preset rm_tiny) on the CPU. The run folder's hf_model/ is what reward.path takes."""
    from rlx.config import override_key
    from rlx.plugins.reward_modeling.config import DEFAULT_PRESET, load_rm_config

    overrides = list(overrides or [])
    if resume:
        overrides.append("trainer.resume=must")
    if preset is None and not config and model is None and not any(
            override_key(o) in ("model.path", "data.train_files") for o in overrides):
        preset = DEFAULT_PRESET
        typer.echo(f"No model, config or data given: using the built-in preset {preset!r}.", err=True)
    from rlx.registry import get_plugin_manager as _pm
    from rlx.run.terminal import quiet_libraries as _quiet_libraries

    pm = _pm()
    resolved = load_rm_config(pm, preset=preset, config_file=config, model=model, backend=backend,
                              overrides=overrides)
    _quiet_libraries()
    from rlx.plugins.reward_modeling.trainer import train_reward_model

    trainer, metrics = train_reward_model(resolved, pm)
    if "val/accuracy" in metrics:
        typer.echo(f"Validation pairwise accuracy: {metrics['val/accuracy']:.4f} ({len(trainer.val_set or [])} pairs)")
    typer.echo(f"Run folder: {trainer.run_dir}")
    if resolved.config.trainer.save_hf_model:
        typer.echo(f"Reward model: {trainer.run_dir / 'hf_model'} (use it with reward.name=reward_model "
                   f"reward.path={trainer.run_dir / 'hf_model'})")
