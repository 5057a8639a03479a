"""``rlx export``: a Hugging Face model folder from any checkpoint of any backend.

The backend that wrote the checkpoint (recorded in the run's ``config.yaml``) loads it in this one process
and writes the folder, so every backend's own format works, sharded ones included (a checkpoint written by
N ranks loads into one). A backend whose checkpoints load only where it trains (megatron: GPUs) gives its own
exporter (``Component.extra["export_checkpoint"]``), which reads the checkpoint without building the backend.
The checkpoint is verified first, like a resume, and the folder is written atomically (a temporary folder
renamed into place).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlx.errors import UserError

ROLES = ("actor", "critic")


def find_checkpoint(source: Path) -> Path:
    """The checkpoint folder ``source`` names: itself, or the newest trustworthy one of a run folder."""
    from rlx import checkpoint

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
        raise UserError(f"{source} holds no complete checkpoint" + (" that can be trusted" if rejected else "") + ".",
                        "Give a run folder written by `rlx train` with checkpoints (trainer.save_freq != 0), or "
                        "a checkpoint folder global_step_N.")
    return found


def run_config_of(ckpt: Path) -> Path:
    config = ckpt.parent.parent / "config.yaml"  # <run>/checkpoints/global_step_N
    if not config.is_file():
        raise UserError(f"{config} is missing: the run's config says which model and backend wrote {ckpt}.",
                        "Export from a run folder written by `rlx train`.")
    return config


def export_command(
    source: Annotated[Path, typer.Argument(help="A run folder (its newest good checkpoint) or a checkpoint "
                                                "folder (checkpoints/global_step_N).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="The Hugging Face model folder to write.")],
    role: Annotated[str, typer.Option("--role", help="actor (the policy) or critic (the value model).")] = "actor",
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it already holds files.")] = False,
    adapter_only: Annotated[bool, typer.Option(
        "--adapter-only", help="A LoRA run (model.lora_rank > 0): write the peft adapter folder "
        "(PeftModel.from_pretrained(base, OUT) loads it) instead of the merged model.")] = False,
) -> None:
    """Write a checkpoint's model as a Hugging Face folder (safetensors, config, generation config, tokenizer)
    that from_pretrained loads. A LoRA run's model is written merged (base + adapter), or with
    --adapter-only as the adapter alone."""
    from rlx import checkpoint

    if role not in ROLES:
        raise UserError(f"--role {role!r}: must be one of {', '.join(ROLES)}.")
    out = out.expanduser()
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UserError(f"--out {out} exists and is not a folder.", "Choose another --out.")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"--out {out} already holds files.", "Choose an empty or new folder, or add --force.")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: the folder {out.parent} does not exist.", "Create it first.")
    ckpt = find_checkpoint(source.expanduser())
    if not (ckpt / role).is_dir():
        raise UserError(f"{ckpt} has no {role} (the run's algorithm did not train one).",
                        "Export --role actor.")

    from rlx.cli.main import _pm, _quiet_libraries
    from rlx.validate import load_config

    _quiet_libraries()
    # The run's own config, on the CPU in this one process: the backend rebuilds the role as it trained it.
    resolved = load_config(_pm(), config_file=[str(run_config_of(ckpt))],
                           overrides=["trainer.device=cpu", "launcher.name=local", "launcher.nproc=1",
                                      "actor.ulysses_sequence_parallel_size=1",
                                      "critic.ulysses_sequence_parallel_size=1"],
                           check_files=False)
    cfg = resolved.config
    if adapter_only and cfg.model.lora_rank == 0:
        raise UserError(f"--adapter-only: the run of {ckpt} has no LoRA adapter (model.lora_rank=0: it trained "
                        "every weight).", "Export the whole model: leave out --adapter-only.")

    from rlx.components import resolve
    from rlx.context import BuildContext
    from rlx.data import resolve_path
    from rlx.models import load_tokenizer
    from rlx.protocols import RoleSpec, RunInfo

    model_path = resolve_path(cfg.critic.model_path if role == "critic" and cfg.critic.model_path else cfg.model.path)
    spec = RoleSpec(role=role, model_path=model_path, trainable=False, dtype="float32",
                    value_head=role == "critic", seed=cfg.trainer.seed, trust_remote_code=cfg.model.trust_remote_code)
    # A backend whose checkpoints load only where it trains (megatron: on GPUs) reads them with its own
    # exporter; the others rebuild the role on the CPU and load the checkpoint into it.
    exporter = _pm().get("backend", cfg.backend.name).extra.get("export_checkpoint")
    worker = None
    if exporter is None:
        ctx = BuildContext(cfg, RunInfo(str(ckpt.parent.parent), cfg.trainer.project, cfg.trainer.experiment,
                                        resolved.as_dict()), _pm())
        backend = _pm().build("backend", cfg.backend.name, resolved.options.get("backend"), ctx)
        worker = backend.worker(spec, 0, 1)
        worker.load_checkpoint(str(ckpt / role))
    if adapter_only and (worker is None or not hasattr(worker, "save_adapter")):
        raise UserError(f"--adapter-only: the {cfg.backend.name} backend cannot write a LoRA adapter folder.",
                        "Export the merged model: leave out --adapter-only.")
    tokenizer = load_tokenizer(resolve_path(cfg.model.tokenizer_path or cfg.model.path), cfg.model.trust_remote_code,
                               require_chat_template=False)
    tmp = out.with_name(f".tmp-{out.name}")
    checkpoint.remove_tree(tmp)
    checkpoint.make_dir(tmp)
    if exporter is not None:
        resolve(exporter)(str(ckpt / role), spec, str(tmp), tokenizer)
    elif adapter_only:
        worker.save_adapter(str(tmp), tokenizer)
    else:
        worker.save_pretrained(str(tmp), tokenizer)
    checkpoint.replace_dir(tmp, out)
    typer.echo(f"Exported the {role} of {ckpt} to {out}" + (" (the LoRA adapter)" if adapter_only else ""))
