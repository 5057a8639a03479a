"""``rlx export``: a Hugging Face model folder from any checkpoint of any backend.

The backend that wrote the checkpoint (recorded in the run's ``config.yaml``) loads it in this one process
and writes the folder, so every backend's own format works, sharded ones included (a checkpoint written by
N ranks loads into one). A backend whose checkpoints load only where it trains (megatron: GPUs) gives its own
exporter (``Component.extra["export_checkpoint"]``), which reads the checkpoint without building the backend.
The checkpoint is verified first, like a resume, and the folder is written atomically (a temporary folder
renamed into place).

The run folder is data: a config with ``model.trust_remote_code`` is refused unless ``--trust-code`` is given;
``--out`` may not be, hold or lie inside the run folder or the checkpoint; every export carries a marker file
(``.rlx-export``) and ``--force`` replaces only a folder that has it. See docs/security.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from rlx.errors import UserError

ROLES = ("actor", "critic")


def find_checkpoint(source: Path) -> Path:
    """The checkpoint folder ``source`` names: itself, or the newest trustworthy one of a run folder."""
    from rlx.run import checkpoint

    if not source.exists():
        raise UserError(f"{source} does not exist.", "Give a run folder or one of its checkpoints/global_step_N.")
    if (source / checkpoint.MARKER).is_file():
        problem = checkpoint.verify(source)
        if problem is not None:
            raise UserError(f"Checkpoint {source} cannot be trusted: {problem}.",
                            "Export another checkpoint of the run (or the run folder, for its newest good one).")
        return source
    root = source / "checkpoints"
    found, rejected = checkpoint.latest_verified(root)
    for path, why in rejected:
        typer.echo(f"Warning: checkpoint {path.name} cannot be trusted ({why}); skipping it.", err=True)
    if found is None:
        what = f"{source} holds no complete checkpoint" + (" that can be trusted" if rejected else "") + "."
        if (source / "config.json").is_file():  # `rlx export RUN/hf_model`: that is an export already
            raise UserError(f"{what} It is a Hugging Face model folder already (config.json): from_pretrained, "
                            "`rlx eval --model` and `rlx train --model` take it as it is.",
                            "rlx export reads the checkpoints of a run: give the run folder or a checkpoint "
                            "global_step_N.")
        if (source / "hf_model" / "config.json").is_file() and not rejected:
            raise UserError(f"{what} Its final model is a Hugging Face folder already: {source / 'hf_model'}.",
                            "Copy that folder, or give a run folder with checkpoints.")
        raise UserError(what, "Give a run folder written by `rlx train` with checkpoints (trainer.save_freq != 0), "
                        "or a checkpoint folder global_step_N.")
    return found


def run_config_of(ckpt: Path) -> Path:
    config = ckpt.parent.parent / "config.yaml"  # <run>/checkpoints/global_step_N
    if not config.is_file():
        raise UserError(f"{config} is missing: the run's config says which model and backend wrote {ckpt}.",
                        "Export from a run folder written by `rlx train`.")
    return config


MARKER = ".rlx-export"  # in every folder rlx export writes: what --force may replace


def _check_out_path(out: Path) -> None:
    """Refuse an --out that cannot be an export folder: a link, a file, or an occupied folder that is not
    an earlier export (``--force`` replaces only those, checked by the caller)."""
    from rlx.run.files import printable

    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UserError(f"--out {printable(out)} exists and is not a folder.", "Choose another --out.")


def _check_not_source(out: Path, run_dir: Path, ckpt: Path) -> None:
    """Refuse an --out that is, lies inside or holds the run folder or the checkpoint: replacing it would
    destroy what is being exported."""
    from rlx.run.files import printable

    there = out.resolve()
    for what, folder in (("the run folder", run_dir), ("the checkpoint", ckpt)):
        here = folder.resolve()
        relation = ("is" if there == here else "lies inside" if there.is_relative_to(here)
                    else "holds" if here.is_relative_to(there) else None)
        if relation is not None:
            raise UserError(f"--out {printable(out)} {relation} {what} {printable(folder)} that the export reads "
                            "from: writing the export there would damage or replace it (--force or not).",
                            "Give an --out outside the run folder, e.g. --out ~/models/NAME.")


def _check_model_folders(cfg: Any, role: str, ckpt: Path) -> None:
    """A local model folder the run's config names must still be there: the export builds the model from it
    before loading the checkpoint's weights into it."""
    from rlx.run.data import resolve_path
    from rlx.run.files import printable
    from rlx.run.models import is_local

    refs = [("model.path", cfg.model.path), ("model.tokenizer_path", cfg.model.tokenizer_path)]
    if role == "critic":
        refs.append(("critic.model_path", cfg.critic.model_path))
    for key, ref in refs:
        if not ref:
            continue
        path = resolve_path(ref)
        if is_local(path) and not Path(path).exists():
            raise UserError(f"The model folder {printable(path)} ({key} in the config.yaml of the run of "
                            f"{printable(ckpt)}) is gone: the export builds the model from it, then loads the "
                            "checkpoint's weights into it.",
                            f"Put that model folder (or a copy of it) back at {printable(path)} and export again.")


def _prepare_out(out: Path) -> Path:
    """Create --out's missing parent folders and the temporary folder the export is written into; a
    :class:`UserError` saying why when --out cannot be written (no permission, a read-only place, /proc)."""
    from rlx.run import checkpoint
    from rlx.run.files import printable

    tmp = out.with_name(f".tmp-{out.name}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        checkpoint.remove_tree(tmp)
        checkpoint.make_dir(tmp)
        probe = tmp / MARKER
        probe.write_text("rlx export\n", encoding="utf-8")
    except OSError as exc:
        checkpoint.remove_tree(tmp)
        raise UserError(f"--out {printable(out)}: cannot write there ({printable(exc.strerror or exc)}).",
                        "Choose an --out in a folder you can write to.") from None
    return tmp


def export_command(
    source: Annotated[Path, typer.Argument(help="A run folder (its newest good checkpoint) or a checkpoint "
                                                "folder (checkpoints/global_step_N).")],
    out_arg: Annotated[str, typer.Option("--out", "-o", metavar="PATH", help="The Hugging Face model folder to "
                                         "write (missing parent folders are created).")],
    role: Annotated[str, typer.Option("--role", help="actor (the policy) or critic (the value model).")] = "actor",
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it is an earlier export (it holds "
                                                        f"{MARKER}); any other folder is left alone.")] = False,
    adapter_only: Annotated[bool, typer.Option(
        "--adapter-only", help="A LoRA run (model.lora_rank > 0): write the peft adapter folder "
        "(PeftModel.from_pretrained(base, OUT) loads it) instead of the merged model.")] = False,
    trust_code: Annotated[bool, typer.Option(
        "--trust-code", help="Run the model folder's own code when the run's config sets "
        "model.trust_remote_code=true. Without it such a run is refused.")] = False,
) -> None:
    """Write a checkpoint's model as a Hugging Face folder (safetensors, config, generation config, tokenizer)
    that from_pretrained loads. A LoRA run's model is written merged (base + adapter), or with
    --adapter-only as the adapter alone."""
    from rlx.run import checkpoint
    from rlx.run.files import check_run_folder_links, printable, refuse_code

    if role not in ROLES:
        raise UserError(f"--role {printable(role)!r}: must be one of {', '.join(ROLES)}.")
    if not out_arg.strip():
        raise UserError("--out is empty.", "Give the folder to write the model to, e.g. --out ~/models/NAME.")
    out = Path(out_arg).expanduser()
    _check_out_path(out)
    ckpt = find_checkpoint(source.expanduser())
    run_dir = ckpt.parent.parent  # <run>/checkpoints/global_step_N
    _check_not_source(out, run_dir, ckpt)
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise UserError(f"--out {printable(out)} already holds files.",
                            "Choose an empty or new folder, or add --force to replace an earlier export.")
        if not (out / MARKER).is_file():
            raise UserError(f"--out {printable(out)} already holds files and is not an earlier export (it has no "
                            f"{MARKER}): --force replaces only a folder that rlx export wrote.",
                            "Choose an empty or new folder, or move the files away yourself.")
    if not (ckpt / role).is_dir():
        raise UserError(f"{printable(ckpt)} has no {role} (the run's algorithm did not train one).",
                        "Export --role actor.")
    check_run_folder_links(run_dir)

    from rlx.registry import get_plugin_manager as _pm
    from rlx.run.terminal import quiet_libraries as _quiet_libraries
    from rlx.validate import load_config

    _quiet_libraries()
    # The run's own config, on the CPU in this one process: the backend rebuilds the role as it trained it.
    config_path = run_config_of(ckpt)
    overrides = ["trainer.device=cpu", "launcher.name=local", "launcher.nproc=1",
                 "actor.ulysses_sequence_parallel_size=1", "critic.ulysses_sequence_parallel_size=1"]
    if _trained_with_flash_attention(config_path):  # a GPU kernel; the weights are the same with sdpa
        overrides.append("backend.attn_implementation=sdpa")
    try:
        resolved = load_config(_pm(), config_file=[str(config_path)], overrides=overrides, check_files=False)
    except UserError as exc:
        raise UserError(f"{printable(config_path)} is not a config this rlx accepts. {exc.message}", exc.hint) from None
    # The export builds the model and its tokenizer, nothing else: only the model's own code matters here.
    if not trust_code:
        refuse_code({k: v for k, v in resolved.as_dict().items() if k != "reward"}, str(config_path), "export")
    cfg = resolved.config
    if adapter_only and cfg.model.lora_rank == 0:
        raise UserError(f"--adapter-only: the run of {ckpt} has no LoRA adapter (model.lora_rank=0: it trained "
                        "every weight).", "Export the whole model: leave out --adapter-only.")
    _check_model_folders(cfg, role, ckpt)

    from rlx.components import resolve
    from rlx.context import BuildContext
    from rlx.protocols import RoleSpec, RunInfo
    from rlx.run.data import resolve_path
    from rlx.run.models import load_tokenizer

    model_path = resolve_path(cfg.critic.model_path if role == "critic" and cfg.critic.model_path else cfg.model.path)
    spec = RoleSpec(role=role, model_path=model_path, trainable=False, dtype="float32",
                    value_head=role == "critic", seed=cfg.trainer.seed, trust_remote_code=cfg.model.trust_remote_code,
                    config_overrides=dict(cfg.model.override_config))
    tmp = _prepare_out(out)
    try:
        # A backend whose checkpoints load only where it trains (megatron: on GPUs) reads them with its own
        # exporter; the others rebuild the role on the CPU and load the checkpoint into it.
        exporter = _pm().get("backend", cfg.backend.name).extra.get("export_checkpoint")
        worker = None
        if exporter is None:
            ctx = BuildContext(cfg, RunInfo(str(run_dir), cfg.trainer.project, cfg.trainer.experiment,
                                            resolved.as_dict()), _pm())
            backend = _pm().build("backend", cfg.backend.name, resolved.options.get("backend"), ctx)
            worker = backend.worker(spec, 0, 1)
            worker.load_checkpoint(str(ckpt / role))
        if adapter_only and (worker is None or not hasattr(worker, "save_adapter")):
            raise UserError(f"--adapter-only: the {cfg.backend.name} backend cannot write a LoRA adapter folder.",
                            "Export the merged model: leave out --adapter-only.")
        tokenizer = load_tokenizer(resolve_path(cfg.model.tokenizer_path or cfg.model.path),
                                   cfg.model.trust_remote_code, require_chat_template=False)
        if exporter is not None:
            resolve(exporter)(str(ckpt / role), spec, str(tmp), tokenizer)
        elif adapter_only:
            worker.save_adapter(str(tmp), tokenizer)
        else:
            worker.save_pretrained(str(tmp), tokenizer)
        if not adapter_only:  # a vision-language model's image processor settings go with it
            from rlx.run.vision import copy_processor_files

            copy_processor_files(resolve_path(cfg.model.path), str(tmp))
        (tmp / MARKER).write_text(f"rlx export of {ckpt.resolve() / role}\n", encoding="utf-8")
        checkpoint.replace_dir(tmp, out)
    except BaseException:
        checkpoint.remove_tree(tmp)
        raise
    typer.echo(f"Exported the {role} of {ckpt} to {out}" + (" (the LoRA adapter)" if adapter_only else ""))


def _trained_with_flash_attention(config_path: Path) -> bool:
    import yaml

    try:
        backend = (yaml.safe_load(config_path.read_text(encoding="utf-8")) or {}).get("backend")
    except (OSError, ValueError, yaml.YAMLError, AttributeError):
        return False  # load_config names what is wrong with the file
    return isinstance(backend, dict) and backend.get("attn_implementation") == "flash_attention_2"
