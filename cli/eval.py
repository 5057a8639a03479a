"""``rlx eval``: accuracy, mean@n, pass@k and majority@n of a model on prompt files, per data source."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from rlx.errors import UserError


def eval_command(
    data: Annotated[list[str], typer.Option("--data", help="Parquet file of prompts (verl's row shape), or of "
                                                            "preference pairs with --reward-model. Repeatable.")],
    model: Annotated[str | None, typer.Option("--model", help="Model folder or hub id (or builtin:tiny-qwen2).")]
    = None,
    reward_model: Annotated[str | None, typer.Option(
        "--reward-model", help="Instead of --model: the pairwise accuracy of this reward model (a folder written "
                               "by `rlx rm train`, or any one-output sequence classifier) on the preference "
                               "pairs of --data (prompt/chosen/rejected).")] = None,
    reward: Annotated[str | None, typer.Option(
        "--reward", help="Reward plugin (default: router, which picks one per data_source).")] = None,
    n: Annotated[int, typer.Option("--n", min=1, help="Responses sampled per prompt.")] = 1,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="Sampling temperature "
                                                                              "(0: greedy).")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling mass.")] = 1.0,
    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", min=1, help="Most tokens per response (default: data.max_response_length).")] = None,
    batch_size: Annotated[int | None, typer.Option(
        "--batch-size", min=1, help="Prompts per generate call (default: data.val_batch_size).")] = None,
    k: Annotated[list[int] | None, typer.Option("--k", min=1, help="pass@k for these k (default: 1, 2, 4, ... "
                                                                     "up to n). Repeatable.")] = None,
    threshold: Annotated[float, typer.Option(
        "--threshold", help="Score that counts as correct, for rewards that do not report */correct.")] = 1.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON instead of a table.")] = False,
    output: Annotated[str | None, typer.Option("--output", "-o", help="Also write the results as JSON here.")]
    = None,
    samples: Annotated[str | None, typer.Option("--samples", help="Write every response with its score and "
                                                                   "answer here (JSONL).")] = None,
    config: Annotated[str | None, typer.Option("--config", "-c", help="YAML config (model, data, rollout, "
                                                                      "reward sections).")] = None,
    preset: Annotated[str | None, typer.Option("--preset", help="Built-in preset (e.g. tiny).")] = None,
    overrides: Annotated[list[str] | None, typer.Argument(
        help="Dotted overrides, e.g. reward.on_error=zero data.max_prompt_length=1024", show_default=False)] = None,
) -> None:
    """Evaluate a model: accuracy, mean@n, pass@k and majority@n per data source, as a table and as JSON.
    With --reward-model: a reward model's pairwise accuracy on held-out preference pairs."""
    from rlx.config import build_raw, set_dotted
    from rlx.registry import get_plugin_manager as _pm
    from rlx.run.data import is_resource
    from rlx.run.terminal import quiet_libraries as _quiet_libraries
    from rlx.validate import resolve

    for ref in data:
        if not is_resource(ref) and not Path(os.path.expanduser(ref)).is_file():
            raise UserError(f"--data {ref}: no such file.")
    for flag, target in (("--output", output), ("--samples", samples)):
        if target:
            check_output_file(target, flag)
    if reward_model is not None:
        if model is not None:
            raise UserError("--model and --reward-model: give one (a policy to generate with, or a reward model "
                            "to score preference pairs with).")
        eval_reward_model(reward_model, data, as_json=as_json, output=output, batch_size=batch_size or 8,
                          overrides=list(overrides or []))
        return
    if model is None:
        raise UserError("--model is missing: the model to evaluate (or --reward-model PATH for a reward model's "
                        "pairwise accuracy on preference pairs).")
    raw = build_raw(preset=preset, config_file=config, shortcuts={"model": model, "reward": reward},
                    overrides=list(overrides or []))
    set_dotted(raw, "data.train_files", list(data))  # unused, but a run config needs training data
    set_dotted(raw, "data.val_files", list(data))
    set_dotted(raw, "rollout.val_n", n)
    set_dotted(raw, "rollout.val_temperature", temperature)
    set_dotted(raw, "rollout.top_p", top_p)
    if reward is None and "name" not in (raw.get("reward") or {}):
        set_dotted(raw, "reward.name", "router")
    if max_tokens is not None:
        set_dotted(raw, "data.max_response_length", max_tokens)
    if batch_size is not None:
        set_dotted(raw, "data.val_batch_size", batch_size)
    pm = _pm()
    resolved = resolve(raw, pm)
    if n > 1 and temperature == 0:
        typer.echo("Note: --temperature 0 is greedy decoding; all n responses of a prompt will be the same.",
                   err=True)
    _quiet_libraries()
    result, records = run_eval(resolved, pm, ks=k, threshold=threshold)
    if output:
        Path(os.path.expanduser(output)).write_text(json.dumps(result, indent=2) + "\n")
    if samples:
        with open(os.path.expanduser(samples), "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r.as_dict(), ensure_ascii=False, default=str) + "\n")
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        print_table(result)


def check_output_file(target: str, flag: str) -> None:
    """Fail before any work when ``target`` cannot be written: a missing or read-only folder, or a folder."""
    path = Path(os.path.expanduser(target))
    parent = path.parent
    if path.is_dir():
        raise UserError(f"{flag} {target}: that is a folder; give a file name (e.g. {target.rstrip('/')}/result"
                        f"{'.json' if flag == '--output' else '.jsonl'}).")
    if not parent.is_dir():
        what = "is a file, not a folder" if parent.exists() else "does not exist"
        raise UserError(f"{flag} {target}: the folder {str(parent)!r} {what}.",
                        f"Create it first (mkdir -p {parent}) or write somewhere else.")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UserError(f"{flag} {target}: cannot write there (permission denied).",
                        "Write into a folder you own.")


def run_eval(resolved: Any, pm: Any, *, ks: list[int] | None, threshold: float) -> tuple[dict[str, Any], list[Any]]:
    """Generate and score the validation files of a resolved config; the results and every record."""
    from rlx.context import BuildContext
    from rlx.protocols import RunInfo, SamplingParams
    from rlx.run.data import load_prompts, resolve_path
    from rlx.run.evaluation import default_ks, evaluate, summarize
    from rlx.run.models import check_model_folder, load_tokenizer
    from rlx.run.reward_worker import RewardWorker

    cfg = resolved.config
    m = cfg.model
    check_model_folder(resolve_path(m.path), m.trust_remote_code, tokenizer=m.tokenizer_path is None)
    tok = load_tokenizer(resolve_path(m.tokenizer_path or m.path), m.trust_remote_code,
                         key="model.tokenizer_path" if m.tokenizer_path else "model.path")
    d = cfg.data
    from rlx.run.vision import vision_prompts

    vision = vision_prompts(resolve_path(m.path), tok, m.trust_remote_code)  # a vision-language model's images
    dataset = load_prompts(d.val_files, tok, prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length,
                           filter_overlong=d.filter_overlong_prompts, source_key="--data",
                           template_kwargs=d.apply_chat_template_kwargs, image_key=d.image_key, vision=vision)
    ctx = BuildContext(cfg, RunInfo("", cfg.trainer.project, "eval", resolved.as_dict()), pm, tok)
    rollout = pm.get("rollout", cfg.rollout.name).load_factory()(resolved.options.get("rollout"), ctx)
    reward_fn = pm.get("reward", cfg.reward.name).load_factory()(resolved.options.get("reward"), ctx)
    worker = RewardWorker(reward_fn, tok, cfg.reward.name, cfg.reward)
    r = cfg.rollout
    params = SamplingParams(n=r.val_n, temperature=r.val_temperature, top_p=r.top_p, top_k=r.top_k,
                            max_tokens=d.max_response_length, greedy=r.val_temperature == 0)

    def progress(done: int, total: int) -> None:
        print(f"evaluated {done}/{total} prompts", file=sys.stderr, flush=True)

    try:
        records = evaluate(dataset.examples, generate=rollout.generate, score=worker.score, params=params,
                           batch_size=d.val_batch_size, pad_token_id=tok.pad_token_id, threshold=threshold,
                           progress=progress, vision=vision)
    finally:
        close = getattr(rollout, "close", None)
        if close is not None:
            close()
    ks = [x for x in (ks or default_ks(r.val_n)) if x <= r.val_n]
    return {
        "model": cfg.model.path, "data": list(d.val_files), "reward": cfg.reward.name, "n": r.val_n,
        "temperature": r.val_temperature, "max_tokens": d.max_response_length,
        "dropped_overlong_prompts": dataset.dropped_overlong, "k": ks,
        "metrics": summarize(records, ks),
    }, records


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    n = result["n"]
    metrics: dict[str, dict[str, float]] = result["metrics"]
    columns = ["acc", f"mean@{n}", *[f"pass@{k}" for k in result["k"]], f"maj@{n}"]
    table = Table(title=f"{result['model']}  (n={n}, temperature={result['temperature']:g}, "
                        f"reward={result['reward']})")
    table.add_column("data_source")
    table.add_column("prompts", justify="right")
    for c in columns:
        table.add_column(c, justify="right")
    for src, m in metrics.items():
        table.add_row(src, str(int(m["prompts"])), *[f"{m[c]:.4f}" if c in m else "-" for c in columns])
    Console().print(table)
    if result["dropped_overlong_prompts"]:
        typer.echo(f"{result['dropped_overlong_prompts']} prompts longer than data.max_prompt_length were left out.")


def eval_reward_model(path: str, data: list[str], *, as_json: bool, output: str | None, batch_size: int,
                      overrides: list[str]) -> None:
    """Pairwise accuracy, loss, margin and mean rewards of a reward model on preference files. Overrides name
    the pair columns (data.chosen_key=..., data.margin_key=...), as for `rlx rm train`."""
    from pydantic import ValidationError

    from rlx.config import format_validation_error, parse_override
    from rlx.errors import ConfigError
    from rlx.plugins.reward_modeling.config import RMDataConfig
    from rlx.run.terminal import quiet_libraries as _quiet_libraries

    given: dict[str, Any] = {}
    for text in overrides:
        key, value = parse_override(text)
        if not key.startswith("data.") or key.count(".") != 1:
            raise UserError(f"{text}: with --reward-model only the data.* keys of the pair columns apply "
                            "(data.prompt_key, data.chosen_key, data.rejected_key, data.margin_key).")
        given[key.split(".", 1)[1]] = value
    try:
        data_cfg = RMDataConfig.model_validate(given)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, RMDataConfig, prefix="data")) from None
    _quiet_libraries()
    from rlx.plugins.reward_modeling.trainer import evaluate_reward_model

    result = evaluate_reward_model(path, list(data), data_cfg, batch_size=batch_size)
    if output:
        Path(os.path.expanduser(output)).write_text(json.dumps(result, indent=2) + "\n")
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    typer.echo(f"{path} on {', '.join(data)}: {result['pairs']} pairs")
    typer.echo(f"  pairwise accuracy {result['accuracy']:.4f}  loss {result['loss']:.4f}  "
               f"margin {result['margin']:.4f}  chosen {result['chosen']:.4f}  rejected {result['rejected']:.4f}")
