"""``rlx data``: prepare, validate and inspect prompt files. Heavy libraries load inside the commands."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from rlx.errors import UserError

app = typer.Typer(help="Prepare, validate and inspect training data (parquet in verl's row shape).",
                  no_args_is_help=True)


@app.command("prepare")
def prepare(
    name: Annotated[str, typer.Argument(help="Data set: gsm8k, math, geo3k (images) or preference.")],
    out: Annotated[str, typer.Option("--out", "-o", help="Folder for <split>.parquet.")],
    source: Annotated[list[str] | None, typer.Option(
        "--source", help="Local copy in the original layout instead of the hub: FILE, SPLIT=FILE or a folder "
                         "(JSONL, JSON or parquet; the split comes from the file name). Repeatable.")] = None,
    dataset: Annotated[str | None, typer.Option(
        "--dataset", help="Hub id to read instead of the default (e.g. HuggingFaceH4/MATH-500).")] = None,
    instruction: Annotated[str | None, typer.Option(
        "--instruction", help="Text appended to every question (default: how to give the final answer).")] = None,
    data_source: Annotated[str | None, typer.Option(
        "--data-source", help="The rows' data_source (default: the data set's hub id).")] = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="At most this many rows per split.")] = None,
    prompt_key: Annotated[str, typer.Option("--prompt-key", help="preference: column of the prompt.")] = "prompt",
    chosen_key: Annotated[str, typer.Option("--chosen-key", help="preference: column of the preferred reply.")]
    = "chosen",
    rejected_key: Annotated[str, typer.Option("--rejected-key", help="preference: column of the other reply.")]
    = "rejected",
    margin_key: Annotated[str | None, typer.Option(
        "--margin-key", help="preference: column of a per-pair margin, written as 'margin'.")] = None,
    tokenizer: Annotated[str | None, typer.Option(
        "--tokenizer", help="preference: tokenizer (with its chat template) to measure pairs with --max-length.")]
    = None,
    max_length: Annotated[int | None, typer.Option(
        "--max-length", min=1, help="preference: drop (and count) pairs with a side longer than this many tokens "
                                    "(needs --tokenizer).")] = None,
) -> None:
    """Write train/test parquet files for GSM8K (answer after ####), a boxed-answer math set, or preference
    pairs (`preference`: prompt/chosen/rejected from --source files or a --dataset hub id)."""
    if name == "preference":
        _prepare_preference(out, source, dataset, data_source, limit, prompt_key, chosen_key, rejected_key,
                            margin_key, tokenizer, max_length)
        return
    given = [flag for flag, value, default in (
        ("--prompt-key", prompt_key, "prompt"), ("--chosen-key", chosen_key, "chosen"),
        ("--rejected-key", rejected_key, "rejected"), ("--margin-key", margin_key, None),
        ("--tokenizer", tokenizer, None), ("--max-length", max_length, None)) if value != default]
    if given:
        raise UserError(f"{', '.join(given)}: only for `rlx data prepare preference`.")
    from rlx.plugins.tasks.datasets import prepare as run

    reports = run(name, out, sources=source, hub_path=dataset, instruction=instruction, data_source=data_source,
                  limit=limit)
    for r in reports:
        skipped = f" ({r.skipped} skipped: no usable answer)" if r.skipped else ""
        typer.echo(f"{r.split}: {r.written} rows -> {r.path}{skipped}")
    files = {r.split: r.path for r in reports}
    train, val = files.get("train"), files.get("test") or files.get("validation")
    if train is not None:
        hint = f"data.train_files={train}" + (f" data.val_files={val}" if val else "")
        # A runnable command: without a model (or the tiny preset, whose model cannot read these) train stops.
        reward = {"gsm8k": "gsm8k", "geo3k": "geo3k --model Qwen/Qwen2.5-VL-3B-Instruct"}.get(
            name, "math") + ("" if name == "geo3k" else " --model Qwen/Qwen2.5-0.5B-Instruct")
        typer.echo(f"Train with (any chat model for --model): rlx train --reward {reward} {hint}")


def _prepare_preference(out: str, source: list[str] | None, dataset: str | None, data_source: str | None,
                        limit: int | None, prompt_key: str, chosen_key: str, rejected_key: str,
                        margin_key: str | None, tokenizer: str | None, max_length: int | None) -> None:
    from rlx.plugins.tasks.datasets import prepare_preference

    if (tokenizer is None) != (max_length is None):
        raise UserError("--tokenizer and --max-length go together: the tokenizer measures each pair's length.")
    tok = _load_tokenizer(tokenizer) if tokenizer is not None else None
    reports = prepare_preference(out, sources=source, hub_path=dataset, data_source=data_source,
                                 prompt_key=prompt_key, chosen_key=chosen_key, rejected_key=rejected_key,
                                 margin_key=margin_key, tokenizer=tok, max_length=max_length, limit=limit)
    for r in reports:
        dropped = f" (dropped: {', '.join(f'{n} {why}' for why, n in sorted(r.dropped.items()))})" if r.dropped \
            else ""
        typer.echo(f"{r.split}: {r.written} pairs -> {r.path}{dropped}")
    files = {r.split: r.path for r in reports}
    train, val = files.get("train"), files.get("test") or files.get("validation")
    if train is not None:
        margin = " data.margin_key=margin" if margin_key else ""
        typer.echo(f"Train a reward model with: rlx rm train --model MODEL data.train_files={train}"
                   + (f" data.val_files={val}" if val else "") + margin)


def _load_tokenizer(ref: str) -> Any:
    from rlx.run.data import resolve_path
    from rlx.run.models import load_tokenizer
    from rlx.run.terminal import quiet_libraries as _quiet_libraries

    _quiet_libraries()
    return load_tokenizer(resolve_path(ref), False, key="--tokenizer", require_chat_template=False)


def _read(file: str) -> list[Any]:
    from rlx.run.data import file_problem, read_rows

    path = Path(os.path.expanduser(file))
    problem = file_problem(path)
    if problem == "is a folder, not a file":
        raise UserError(f"{file}: that is a folder; give a parquet file.")
    if problem == "does not exist":
        raise UserError(f"{file}: no such file.")
    if problem is not None:
        raise UserError(f"{file}: cannot read it: {problem}.")
    if path.suffix in (".jsonl", ".json"):  # preference pairs may come as JSON lines
        from rlx.plugins.tasks.datasets import is_preference_file, read_records

        rows = read_records(path)
        if rows and not is_preference_file(rows):
            raise UserError(f"{file}: prompt files must be parquet (JSON and JSONL are read for preference pairs "
                            "only).", "`rlx data prepare` writes parquet files.")
        return rows
    return read_rows([str(path)])


def _preference_problems(rows: list[Any], prompt_key: str, chosen_key: str, rejected_key: str,
                         margin_key: str | None, tok: Any, max_length: int | None
                         ) -> tuple[list[tuple[int, list[str]]], int]:
    """Bad preference rows (index, reasons) and the count of usable pairs with a side over ``max_length``."""
    from rlx.plugins.tasks.datasets import preference_pair

    bad, overlong = [], 0
    for i, row in enumerate(rows):
        pair, problems = preference_pair(row, prompt_key=prompt_key, chosen_key=chosen_key,
                                         rejected_key=rejected_key, margin_key=margin_key)
        if pair is None:
            bad.append((i, problems))
        elif tok is not None and max_length is not None:
            from rlx.plugins.tasks.datasets import conversation_ids

            if max(len(conversation_ids(tok, pair.prompt, side)) for side in (pair.chosen, pair.rejected)) \
                    > max_length:
                overlong += 1
    return bad, overlong


@app.command("validate")
def validate(
    files: Annotated[list[str], typer.Argument(help="Parquet files to check (preference pairs also JSONL/JSON).")],
    prompt_key: Annotated[str, typer.Option("--prompt-key", help="Column of the chat messages.")] = "prompt",
    image_key: Annotated[str, typer.Option("--image-key", help="Column of each prompt's images (vision-language "
                                                               "models): <image> markers and images must agree, "
                                                               "every image must decode.")] = "images",
    chosen_key: Annotated[str, typer.Option("--chosen-key", help="Preference pairs: the preferred reply.")]
    = "chosen",
    rejected_key: Annotated[str, typer.Option("--rejected-key", help="Preference pairs: the other reply.")]
    = "rejected",
    margin_key: Annotated[str | None, typer.Option("--margin-key", help="Preference pairs: a margin column to "
                                                                        "check (finite numbers).")] = None,
    tokenizer: Annotated[str | None, typer.Option(
        "--tokenizer", help="Preference pairs: tokenizer (with its chat template) to count pairs over --max-length.")]
    = None,
    max_length: Annotated[int | None, typer.Option(
        "--max-length", min=1, help="Preference pairs: count those with a side longer than this many tokens "
                                    "(rlx rm train drops them; needs --tokenizer).")] = None,
) -> None:
    """Report every row that training could not use (index and reason); exit status 2 if there is one.

    Files whose rows have chosen/rejected are checked as preference pairs (a missing or empty side,
    identical replies, a bad prompt or margin); with --tokenizer and --max-length the over-long pairs are
    counted too (not an error: rlx rm train drops them and says how many)."""
    from rlx.plugins.tasks.datasets import is_preference_file, preference_column_problems
    from rlx.run.data import column_problems, row_problems
    from rlx.run.vision import image_problems

    if (tokenizer is None) != (max_length is None):
        raise UserError("--tokenizer and --max-length go together: the tokenizer measures each pair's length.")
    tok = _load_tokenizer(tokenizer) if tokenizer is not None else None
    bad_total = rows_total = 0
    empty: list[str] = []
    lacking: list[str] = []  # files without a column every row needs: said once, not once per row
    preference = False
    for file in files:
        rows = _read(file)
        bad: list[tuple[int, list[str]]] = []
        if is_preference_file(rows, chosen_key, rejected_key):
            preference = True
            missing = preference_column_problems(rows, file, prompt_key=prompt_key, chosen_key=chosen_key,
                                                 rejected_key=rejected_key, margin_key=margin_key)
            if not missing:
                bad, overlong = _preference_problems(rows, prompt_key, chosen_key, rejected_key, margin_key, tok,
                                                     max_length)
                if overlong:
                    typer.echo(f"{file}: {overlong} pairs have a side longer than {max_length} tokens "
                               "(rlx rm train drops them)")
        else:
            missing = column_problems(rows, file, prompt_key)
            if not missing:
                bad = [(i, p) for i, row in enumerate(rows)
                       for p in [row_problems(row, prompt_key) + image_problems(row, prompt_key, image_key)] if p]
        rows_total += len(rows)
        bad_total += len(bad)
        for line in missing:
            typer.echo(line)
        for i, problems in bad:
            typer.echo(f"{file}: row {i}: {'; '.join(problems)}")
        if missing:
            lacking.append(file)
        elif not rows:
            typer.echo(f"{file}: no rows")
            empty.append(file)
        elif not bad:
            typer.echo(f"{file}: {len(rows)} rows, all usable")
    if bad_total or empty or lacking:
        found = [f"{bad_total} of {rows_total} rows are not usable (listed above)"] if bad_total else []
        if lacking:
            found.append(f"{len(lacking)} file{'s lack' if len(lacking) != 1 else ' lacks'} a column every row "
                         f"needs ({', '.join(lacking)}; listed above)")
        if empty:
            found.append(f"{len(empty)} file{'s have' if len(empty) != 1 else ' has'} no rows ({', '.join(empty)})")
        shape = (f"Each preference row needs {prompt_key!r} (text or chat messages) and {chosen_key!r} / "
                 f"{rejected_key!r} replies that differ; `rlx data prepare preference` drops the rows that do not."
                 if preference else "Each row needs prompt (chat messages), data_source and reward_model.ground_truth; "
                 "`rlx data prepare` writes files in this shape.")
        if lacking:
            shape += (" Columns named otherwise: --prompt-key, --chosen-key, --rejected-key, --margin-key."
                      if preference else " A prompt column named otherwise: --prompt-key.")
        raise UserError("; ".join(found) + ".", shape)


def _percentile(sorted_values: list[int], q: float) -> int:
    if not sorted_values:
        return 0
    k = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def _histogram(values: list[int], bins: int = 10, width: int = 40) -> list[str]:
    lo, hi = min(values), max(values)
    step = max(1, -(-(hi - lo + 1) // bins))
    counts: dict[int, int] = {}
    for v in values:
        counts[(v - lo) // step] = counts.get((v - lo) // step, 0) + 1
    top = max(counts.values())
    lines = []
    for b in range((hi - lo) // step + 1):
        c = counts.get(b, 0)
        lines.append(f"  {lo + b * step:>7}-{lo + (b + 1) * step - 1:<7} {c:>7}  {'#' * round(width * c / top)}")
    return lines


@app.command("inspect")
def inspect(
    file: Annotated[str, typer.Argument(help="Parquet file.")],
    tokenizer: Annotated[str | None, typer.Option(
        "--tokenizer", help="Tokenizer (model folder or hub id) for lengths in tokens, with its chat template.")]
    = None,
    rows: Annotated[int, typer.Option("--rows", "-n", min=0, help="Rows to show.")] = 3,
    max_prompt_length: Annotated[int | None, typer.Option(
        "--max-prompt-length", help="Also count the prompts longer than this (data.max_prompt_length).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the statistics as JSON.")] = False,
) -> None:
    """Show a few rows, the data sources, and the distribution of prompt lengths (tokens with --tokenizer)."""
    from rlx.run.data import resolve_path, row_problems

    data = _read(file)
    tok = None
    if tokenizer is not None:
        from rlx.run.terminal import quiet_libraries as _quiet_libraries

        _quiet_libraries()
        from rlx.run.models import load_tokenizer

        tok = load_tokenizer(resolve_path(tokenizer), False, key="--tokenizer", require_chat_template=False)
    lengths: list[int] = []
    sources: dict[str, int] = {}
    unusable = 0
    for row in data:
        if row_problems(row):
            unusable += 1
            continue
        sources[row["data_source"]] = sources.get(row["data_source"], 0) + 1
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if tok is not None:
            if tok.chat_template is not None:
                text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            else:  # no template: the messages' text alone
                text = "\n".join(m["content"] for m in messages)
            lengths.append(len(tok(text, add_special_tokens=False)["input_ids"]))
        else:
            lengths.append(sum(len(m["content"]) for m in messages))
    unit = "tokens" if tok is not None else "characters"
    ordered = sorted(lengths)
    stats: dict[str, Any] = {"file": file, "rows": len(data), "unusable_rows": unusable, "data_sources": sources,
                             "length_unit": unit}
    if ordered:
        stats["prompt_length"] = {"min": ordered[0], "mean": round(sum(ordered) / len(ordered), 1),
                                  "p50": _percentile(ordered, 50), "p90": _percentile(ordered, 90),
                                  "p99": _percentile(ordered, 99), "max": ordered[-1]}
    if max_prompt_length is not None:
        stats["over_max_prompt_length"] = sum(n > max_prompt_length for n in lengths)
    if as_json:
        typer.echo(json.dumps(stats, indent=2))
        return
    typer.echo(f"{file}: {len(data)} rows" + (f" ({unusable} not usable; see `rlx data validate`)" if unusable else ""))
    for src, count in sorted(sources.items(), key=lambda kv: -kv[1]):
        typer.echo(f"  data_source {src}: {count}")
    for i, row in enumerate(data[:rows]):
        typer.echo(f"\n--- row {i}")
        for key, value in row.items():
            text = json.dumps(value, ensure_ascii=False, default=str)
            typer.echo(f"  {key}: {text if len(text) <= 300 else text[:297] + '...'}")
    if ordered:
        s = stats["prompt_length"]
        if tok is None:
            typer.echo("\nPrompt length in characters (pass --tokenizer PATH for tokens)")
        else:
            how = "chat template applied" if tok.chat_template is not None else "the tokenizer has no chat template"
            typer.echo(f"\nPrompt length in tokens ({how})")
        typer.echo(f"  min {s['min']}  mean {s['mean']}  p50 {s['p50']}  p90 {s['p90']}  p99 {s['p99']}  "
                   f"max {s['max']}")
        typer.echo("\n".join(_histogram(ordered)))
    if max_prompt_length is not None:
        typer.echo(f"  {stats['over_max_prompt_length']} prompts are longer than {max_prompt_length} {unit} "
                   "(dropped by data.max_prompt_length when filter_overlong_prompts is on)")
