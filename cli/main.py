"""The ``rlx`` command. Commands are thin: they parse arguments and call the core.

Nothing here imports torch at module level, so ``rlx --help`` and ``rlx plugins list`` stay fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from rlx import __version__
from rlx.cli import data as data_cli
from rlx.cli import eval as eval_cli
from rlx.cli import export as export_cli
from rlx.cli import plot as plot_cli
from rlx.cli import scaffold
from rlx.errors import ConfigError, UserError


class OverridesCommand(TyperCommand):
    """A command whose free arguments are ``KEY=VALUE`` config overrides. An option it does not have that is a
    config key written with dashes, as argparse-based tools take their settings (``--actor.optim.lr=1e-6``,
    ``--total_steps 10``), is answered with the override to write instead."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        given = list(args)  # click's parser consumes the list it is given
        try:
            return super().parse_args(ctx, args)
        except Exception as exc:  # click's NoSuchOption, from the click typer uses (its own or the installed one)
            if type(exc).__name__ == "NoSuchOption" and isinstance(getattr(exc, "option_name", None), str):
                _explain_unknown_option(exc, given)
            raise


def _explain_unknown_option(exc: Any, args: list[str]) -> None:
    """Add to click's "No such option: --x" the config key meant, written as an override."""
    option: str = exc.option_name
    possible = [p for p in (getattr(exc, "possibilities", None) or []) if p != "--help"]
    value = "VALUE"
    for i, arg in enumerate(args):
        if arg.startswith(option + "="):
            value = arg[len(option) + 1:] or value
            break
        if arg == option and i + 1 < len(args) and not args[i + 1].startswith("-"):
            value = args[i + 1]
            break
    name = option.lstrip("-").replace("-", "_")
    keys = [name] if "." in name else [] if possible else _config_keys_ending(name)
    hint = ""
    if keys:
        hint = ("Config keys are set as KEY=VALUE, without dashes: " + " or ".join(f"{k}={value}" for k in keys)
                + ".")
    elif not possible:
        hint = ("Config keys are set as KEY=VALUE, without dashes (e.g. actor.optim.lr=1e-6); `rlx config show` "
                "lists them.")
    if possible:
        exc.message = f"{exc.message} (Possible options: {', '.join(sorted(possible))})"
    exc.possibilities = None
    if hint:
        exc.message = f"{exc.message}\n{hint}"


def _config_keys_ending(name: str) -> list[str]:
    """The dotted keys of the core config whose last part is ``name`` (``lr`` -> actor.optim.lr, critic.optim.lr)."""
    from rlx.config import RLXConfig, _as_model

    found: list[str] = []

    def walk(model: Any, prefix: str) -> None:
        for field_name, field in model.model_fields.items():
            sub = _as_model(field.annotation)
            if sub is not None:
                walk(sub, f"{prefix}{field_name}.")
            elif field_name == name:
                found.append(prefix + field_name)

    walk(RLXConfig, "")
    return found


app = typer.Typer(name="rlx", help="Reinforcement-learning post-training (PPO, GRPO) for Hugging Face LLMs.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
plugins_app = typer.Typer(help="List and inspect plugins.", no_args_is_help=True)
config_app = typer.Typer(help="Show or check the resolved configuration.", no_args_is_help=True)
app.add_typer(plugins_app, name="plugins")
app.add_typer(config_app, name="config")
app.add_typer(data_cli.app, name="data")
app.command("eval", cls=OverridesCommand)(eval_cli.eval_command)
app.command("export")(export_cli.export_command)
app.command("plot")(plot_cli.plot_command)
plugins_app.command("new")(scaffold.new_plugin)

EXIT_USER_ERROR = 2
PLUGINS_TABLE_WIDE = 140  # columns from which `rlx plugins list` shows every column, summaries whole


def _version(value: bool) -> None:
    if value:
        typer.echo(f"rlx {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, metavar="",
                                          help="Print the version and exit.")] = False,
) -> None:
    """rlx: PPO and GRPO for Hugging Face models, with plugins for backends, engines, algorithms, rewards.

    torch uses half of the CPU cores unless OMP_NUM_THREADS (or backend.num_threads) says otherwise, so
    that two rlx processes (a run and an evaluation) do not slow each other down.
    """


def _pm():
    from rlx.registry import get_plugin_manager

    return get_plugin_manager()


def _quiet_libraries() -> None:
    from rlx.run.terminal import quiet_libraries

    quiet_libraries()


# -- plugins -----------------------------------------------------------------------------------
@plugins_app.command("list")
def plugins_list(as_json: Annotated[bool, typer.Option("--json", metavar="", help="Machine-readable output.")]
                 = False,
                 ) -> None:
    """Every component of every installed plugin: distribution, version, kind, name, status."""
    pm = _pm()
    rows: list[dict[str, Any]] = [
        {"distribution": c.distribution, "version": c.version, "kind": c.kind, "name": c.name,
         "status": "ok", "plugin": c.plugin, "summary": c.summary}
        for c in pm.components().values()
    ]
    for p in pm.plugins:
        if p.status != "ok":
            rows.append({"distribution": p.distribution, "version": p.version, "kind": "-", "name": p.name,
                         "status": p.status, "plugin": p.name, "summary": p.error})
    rows += [{"distribution": c.distribution, "version": c.version, "kind": c.kind, "name": c.name,
              "status": "disabled", "plugin": c.plugin, "summary": c.summary} for c in pm.disabled_components]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    # Narrow terminals: one line per component (the summary cut to the width, a failure's message kept
    # whole) and the distributions in a footnote, instead of six wrapped columns.
    narrow = console.width < PLUGINS_TABLE_WIDE
    table = Table(title="rlx plugins", expand=narrow)
    columns = ("kind", "name", "status", "summary") if narrow else (
        "kind", "name", "distribution", "version", "status", "summary")
    if narrow and all(r["status"] == "ok" for r in rows):
        columns = tuple(c for c in columns if c != "status")
    for col in columns:
        table.add_column(col, overflow="fold", no_wrap=narrow and col != "summary",
                         ratio=1 if narrow and col == "summary" else None)
    for r in rows:
        ok = r["status"] == "ok"
        cells = {"kind": r["kind"], "name": r["name"], "distribution": r["distribution"], "version": r["version"],
                 "status": Text(r["status"], style="" if ok else "red"),
                 # Text, not markup: an install hint's extras ('rlx[vllm]') are not style tags.
                 "summary": Text(r["summary"], no_wrap=narrow and ok, overflow="ellipsis" if narrow and ok
                                 else "fold")}
        table.add_row(*(cells[c] for c in columns))
    console.print(table)
    if narrow:
        dists: dict[str, int] = {}
        for r in rows:
            key = f"{r['distribution']} {r['version']}".strip()
            dists[key] = dists.get(key, 0) + 1
        console.print(Text("From: " + "; ".join(f"{d} ({n})" for d, n in dists.items()) + ". Whole summaries: "
                           "`rlx plugins show NAME`, `rlx plugins list --json`, or a terminal of "
                           f"{PLUGINS_TABLE_WIDE}+ columns."))


@plugins_app.command("show")
def plugins_show(name: Annotated[str, typer.Argument(help="Component name, e.g. grpo or hf.")],
                 kind: Annotated[str | None, typer.Option(help="Component kind if the name is ambiguous.")]
                 = None) -> None:
    """A component's options, with their types, defaults and help."""
    from rlx.components import KINDS
    from rlx.errors import did_you_mean

    if kind is not None and kind not in KINDS:
        raise UserError(f"--kind {kind}: no such component kind.{did_you_mean(kind, KINDS)} "
                        f"Kinds: {', '.join(KINDS)}.")
    pm = _pm()
    found = [pm.get(kind, name)] if kind else pm.find(name)
    if not found:
        names = sorted({n for (_, n) in pm.components()})
        raise UserError(f"No component named {name!r}.{did_you_mean(name, names)}",
                        "Run `rlx plugins list` to see every component.")
    for comp in found:
        typer.echo(f"{comp.kind} {comp.name!r}  (plugin {comp.plugin}, {comp.distribution} {comp.version})")
        if comp.summary:
            typer.echo(f"  {comp.summary}")
        model = _options_model(comp)
        if model is None:
            typer.echo("  (no options)")
            continue
        section = {"logger": f"loggers.{comp.name}"}.get(comp.kind, comp.kind)
        typer.echo(f"  options (set as {section}.KEY=VALUE):")
        for fname, field in model.model_fields.items():
            ann = field.annotation
            ann = ann.__name__ if isinstance(ann, type) else str(ann).replace("typing.", "")
            default = "(required)" if field.is_required() else repr(field.get_default(call_default_factory=True))
            typer.echo(f"    {fname}: {ann} = {default}")
            if field.description:
                typer.echo(f"        {field.description}")


def _options_model(comp: Any) -> Any:
    """A component's options model, or a :class:`UserError` naming the plugin when it is broken."""
    from pydantic import BaseModel

    from rlx.errors import describe_exception
    from rlx.registry import describe_component

    what = describe_component(comp)
    try:
        model = comp.load_config_model()
    except Exception as exc:
        raise UserError(f"Cannot load the options of {what}: {describe_exception(exc)}",
                        "Reinstall or update that plugin, or report the fault to its authors.") from exc
    if model is not None and not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise UserError(f"The config_model of {what} must be a pydantic model class; got {model!r}.",
                        "Reinstall or update that plugin, or report the fault to its authors.")
    return model


# -- config -------------------------------------------------------------------------------------
ConfigOpt = Annotated[list[str] | None, typer.Option(
    "--config", "-c", metavar="FILE", show_default=False,
    help="YAML config file. Repeat it to merge several in order (a later file's keys win). A config file "
         "replaces the built-in preset: add --preset tiny to start from it.")]
PresetOpt = Annotated[str | None, typer.Option("--preset", help="Built-in preset (e.g. tiny).")]
BackendOpt = Annotated[str | None, typer.Option("--backend", help="Training backend (backend.name).")]
RolloutOpt = Annotated[str | None, typer.Option("--rollout", help="Rollout engine (rollout.name).")]
AlgorithmOpt = Annotated[str | None, typer.Option("--algorithm", help="Algorithm (algorithm.name).")]
RewardOpt = Annotated[str | None, typer.Option("--reward", help="Reward (reward.name).")]
ModelOpt = Annotated[str | None, typer.Option("--model", help="Model path or hub id (model.path).")]
LauncherOpt = Annotated[str | None, typer.Option("--launcher", help="Launcher (launcher.name): local or ray.")]
NprocOpt = Annotated[int | None, typer.Option(
    "--nproc", help="Worker processes (launcher.nproc): one per GPU; on the CPU, torch.distributed over gloo.")]
OverridesArg = Annotated[list[str] | None, typer.Argument(
    help="Dotted overrides, e.g. actor.optim.lr=1e-6 data.train_batch_size=64", show_default=False)]

DEFAULT_PRESET = "tiny"


def _resolve(config: list[str] | None, preset: str | None, backend: str | None, rollout: str | None,
             algorithm: str | None, reward: str | None, model: str | None, overrides: list[str] | None,
             check_files: bool = True, launcher: str | None = None, nproc: int | None = None) -> Any:
    from rlx.config import override_key
    from rlx.validate import load_config

    overrides = list(overrides or [])
    shortcuts = {"backend": backend, "rollout": rollout, "algorithm": algorithm, "reward": reward, "model": model,
                 "launcher": launcher, "nproc": nproc}
    # With no model, config file, data or preset, run the built-in job. Someone who names a component
    # (`rlx train --algorithm ppo`) is adjusting that job on purpose; only a bare command is told, and
    # before anything else, so that the note never follows an error.
    if preset is None and not config and model is None and not any(
            override_key(o) in ("model.path", "data.train_files") for o in overrides):
        preset = DEFAULT_PRESET
        if not any(shortcuts.values()):
            typer.echo(f"No model, config or data given: using the built-in preset {preset!r}.", err=True)
    # Commands that check files (train, config validate) also check the run folder before any model loads.
    return load_config(_pm(), preset=preset, config_file=config, shortcuts=shortcuts, overrides=overrides,
                       check_files=check_files, check_run_dir=check_files)


@config_app.command("show", cls=OverridesCommand)
def config_show(config: ConfigOpt = None, preset: PresetOpt = None, backend: BackendOpt = None,
                rollout: RolloutOpt = None, algorithm: AlgorithmOpt = None, reward: RewardOpt = None,
                model: ModelOpt = None, launcher: LauncherOpt = None, nproc: NprocOpt = None,
                overrides: OverridesArg = None) -> None:
    """Print the resolved config (defaults, preset, file, flags and overrides merged) as YAML."""
    import yaml

    resolved = _resolve(config, preset, backend, rollout, algorithm, reward, model, overrides, check_files=False,
                        launcher=launcher, nproc=nproc)
    typer.echo(yaml.safe_dump(resolved.as_dict(), sort_keys=False))


@config_app.command("validate", cls=OverridesCommand)
def config_validate(config: ConfigOpt = None, preset: PresetOpt = None, backend: BackendOpt = None,
                    rollout: RolloutOpt = None, algorithm: AlgorithmOpt = None, reward: RewardOpt = None,
                    model: ModelOpt = None, launcher: LauncherOpt = None, nproc: NprocOpt = None,
                    overrides: OverridesArg = None) -> None:
    """Check a config, that its data files exist and that its run folder can be written, without training."""
    _resolve(config, preset, backend, rollout, algorithm, reward, model, overrides, launcher=launcher, nproc=nproc)
    typer.echo("Config is valid.")


AllowUnmappedOpt = Annotated[bool, typer.Option(
    "--allow-unmapped", metavar="", help="Go on when some verl keys have no rlx counterpart (they are listed).")]


def _from_verl(source: str, allow_unmapped: bool) -> Any:
    from rlx.cli.from_verl import translate

    translation = translate(source, _pm())
    if translation.unmapped and not allow_unmapped:
        raise translation.unmapped_error()
    return translation


def _verl_named(exc: Any, translation: Any, own: set[str] = frozenset()) -> list[str]:  # type: ignore[assignment]
    """The problems of ``exc`` (a ConfigError), each about a value the translation set named by the verl key
    the user wrote (``actor_rollout_ref.rollout.n='two' (rlx's rollout.n): ...``); keys in ``own`` (set on
    rlx's command line) and the others as they are."""
    out = []
    for problem in exc.problems:
        key = problem.split(":", 1)[0].split("=", 1)[0].strip()
        source = translation.sources.get(key)
        if source and source != "verl default" and key not in own and ":" in problem:
            problem = f"{source}={translation.settings.get(key)!r} (rlx's {key}): {problem.split(':', 1)[1].strip()}"
        out.append(problem)
    return out


def _check_verl_values(translation: Any) -> None:
    """A verl value rlx's config refuses (``rollout.n=two``) is named by its verl key; the config's other
    problems (no model yet, say) are left to the command that uses it."""
    from rlx.errors import ConfigError
    from rlx.validate import load_config

    try:
        load_config(_pm(), overrides=translation.overrides(), check_files=False)
    except ConfigError as exc:
        ours = [p for p in _verl_named(exc, translation) if p not in exc.problems]
        if ours:
            raise UserError("--from-verl: rlx cannot take these verl values:\n" + "\n".join(f"  - {p}" for p in ours),
                            "Fix them in the verl command.") from None
    except UserError:
        pass  # not about the verl values: the command reports it when it loads the config


@config_app.command("from-verl")
def config_from_verl(
        source: Annotated[str, typer.Argument(help="A verl command line (quoted) or a YAML file of verl keys.")],
        allow_unmapped: AllowUnmappedOpt = False) -> None:
    """Print the rlx config (YAML) equivalent to a verl run; verl keys rlx cannot follow are named (exit 2
    unless --allow-unmapped). Save it and run it with `rlx train --config FILE`, or use `rlx train --from-verl`."""
    from rlx.cli.from_verl import translate

    translation = translate(source, _pm())
    _check_verl_values(translation)
    typer.echo(translation.to_yaml(), nl=False)
    if translation.unmapped and not allow_unmapped:
        raise translation.unmapped_error()


# -- train --------------------------------------------------------------------------------------
@app.command("train", cls=OverridesCommand)
def train(config: ConfigOpt = None, preset: PresetOpt = None, backend: BackendOpt = None,
          rollout: RolloutOpt = None, algorithm: AlgorithmOpt = None, reward: RewardOpt = None,
          model: ModelOpt = None, launcher: LauncherOpt = None, nproc: NprocOpt = None,
          resume: Annotated[bool, typer.Option("--resume", metavar="", help="Continue from the last complete "
                                               "checkpoint (fail if there is none).")] = False,
          from_verl: Annotated[str | None, typer.Option(
              "--from-verl", metavar="VERL", help="Run a verl command line (quoted) or YAML of verl keys, "
              "translated (see `rlx config from-verl`); flags and overrides given here apply on top.")] = None,
          allow_unmapped: AllowUnmappedOpt = False,
          overrides: OverridesArg = None) -> None:
    """Train. With no model, config or data, runs the small built-in GRPO job (preset tiny) on the CPU.

    The whole config (plugins, options, data files, run folder) is checked before any model is loaded.
    """
    overrides = list(overrides or [])
    if from_verl is not None:
        translation = _from_verl(from_verl, allow_unmapped)
        for note in translation.notes:
            typer.echo(f"from-verl: {note}", err=True)
        for key, why in translation.unmapped:
            typer.echo(f"from-verl: left out {key} ({why})", err=True)
        overrides = translation.overrides() + overrides
    if resume:
        if overrides and overrides[0].lower() in ("true", "false", "yes", "no", "1", "0"):
            raise UserError(f"--resume is a flag and takes no value; got --resume {overrides[0]}.",
                            "Write `rlx train --resume` to continue from the last complete checkpoint.")
        overrides.append("trainer.resume=must")
    if config and preset is None:
        typer.echo(f"Note: --config replaces the built-in preset {DEFAULT_PRESET!r}: the file's keys apply on top of "
                   f"rlx's defaults. Add --preset {DEFAULT_PRESET} to start from the preset instead.", err=True)
    try:
        resolved = _resolve(config, preset, backend, rollout, algorithm, reward, model, overrides, launcher=launcher,
                            nproc=nproc)
    except ConfigError as exc:
        if from_verl is None:
            raise
        own = {o.partition("=")[0].strip() for o in overrides[len(translation.overrides()):]}
        raise ConfigError(_verl_named(exc, translation, own)) from None
    _quiet_libraries()
    from rlx.trainer import Trainer

    trainer = Trainer(resolved, _pm())
    with _sigterm_as_interrupt():
        try:
            trainer.fit()
        except KeyboardInterrupt as stop:
            _report_interrupt(trainer, stop)
            raise typer.Exit(EXIT_SIGTERM if isinstance(stop, Terminated) else EXIT_INTERRUPTED) from None
    typer.echo(f"Run folder: {trainer.run_dir}")


EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
EXIT_SIGTERM = 143  # 128 + SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM during training (a scheduler or `kill`): stopped as Ctrl-C stops it, loggers finished."""


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """While training, SIGTERM raises :class:`Terminated` in the main thread instead of ending the process
    on the spot, so that it ends as Ctrl-C does: loggers finished, workers stopped, the resume command said."""
    def stop(signum: int, frame: Any) -> None:
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread (rlx driven from a thread): the default handling stays
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _report_interrupt(trainer: Any, stop: KeyboardInterrupt) -> None:
    """What an interrupted run did, the checkpoint it would resume from and the command that does."""
    from rlx.run import checkpoint

    how = "by SIGTERM" if isinstance(stop, Terminated) else "(Ctrl-C)"
    typer.echo(f"Training interrupted {how} at step {trainer.steps_done}/{trainer.total_steps}.", err=True)
    last, _ = checkpoint.latest_verified(trainer.ckpt_root)
    if last is None:
        every = trainer.cfg.trainer.save_freq
        when = f"one is saved every {every} steps" if every > 0 else "trainer.save_freq=N saves one every N steps"
        typer.echo(f"No checkpoint yet in {trainer.ckpt_root} ({when}): running the command again starts from "
                   "scratch:", err=True)
        typer.echo(f"  {_command_line(resume=False)}", err=True)
        return
    step = checkpoint.read_state(last)["step"]
    typer.echo(f"Last complete checkpoint: {last} (step {step}).", err=True)
    typer.echo("To resume from it:", err=True)
    typer.echo(f"  {_command_line(resume=True)}", err=True)


def _command_line(resume: bool) -> str:
    """The command this process runs (``sys.argv``), with ``--resume`` added when ``resume`` (and any
    ``trainer.resume=...`` override taken out, which ``--resume`` replaces), or taken out when not."""
    import shlex

    program = os.path.basename(sys.argv[0])
    head = ["rlx"] if program == "rlx" else ["python", "-m", "rlx"] if program == "__main__.py" else [sys.argv[0]]
    args = [a for a in sys.argv[1:] if a != "--resume" and not a.startswith("trainer.resume=")]
    return shlex.join(head + args + (["--resume"] if resume else []))


def run(args: list[str] | None = None) -> None:
    """Console-script entry point: user errors end in one paragraph and exit status 2.

    Typer runs in standalone mode, so it handles its own usage errors (exit 2), ``--help``,
    ``typer.Exit`` and Ctrl-C itself, whichever click (installed or vendored by typer) it uses;
    only a :class:`UserError` raised by a command comes back here.
    """
    _default_threads()
    try:
        try:
            _pm().add_cli_commands(app)
            app(args=args, prog_name="rlx")
        except UserError as exc:
            _fail(exc)
        except KeyboardInterrupt:
            typer.echo("Interrupted.", err=True)
            sys.exit(130)
    except SystemExit as done:
        if _used_torch_distributed():
            _leave_now(done)
        raise


def _used_torch_distributed() -> bool:
    local = sys.modules.get("rlx.plugins.launchers._process")
    if local is not None and getattr(local, "PROCESS_GROUP_USED", False):
        return True
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _leave_now(done: SystemExit) -> None:
    """End the process with ``done``'s status, skipping the interpreter's teardown: after torch.distributed
    was used, its C++ threads can abort that teardown ("terminate called without an active exception"),
    turning a finished run into a crash. Everything is written by now (loggers finished, checkpoints sealed,
    workers stopped)."""
    code = done.code
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if code is None else int(code))


def _default_threads() -> None:
    """Give torch half of the usable cores unless the user chose (OMP_NUM_THREADS here, or
    backend.num_threads, which the backend applies later). torch's own default, every core, makes two
    processes on one machine (a run and an evaluation) spin against each other: on 16 idle cores, small
    matmuls ran 34-280x slower in each of two processes of 16 threads than in one, and 1.2-1.4x slower in
    each of two of 8 (one process of 8 threads: 1.1-1.4x slower than of 16). Runs before torch is
    imported, which reads the variable once."""
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // 2))


def _fail(exc: UserError) -> None:
    # A message can quote a file's text (a key of a run folder's config.yaml): its control characters are
    # printed escaped, so that text never drives the terminal. Line breaks and tabs stay.
    typer.echo(f"Error: {_terminal_safe(exc.message)}", err=True)
    if exc.hint:
        typer.echo(_terminal_safe(exc.hint), err=True)
    sys.exit(EXIT_USER_ERROR)


def _terminal_safe(text: str) -> str:
    from rlx.run.files import printable

    return "\n".join("\t".join(printable(part) for part in line.split("\t")) for line in text.split("\n"))


if __name__ == "__main__":
    run()
