"""Preparing training data: public math sets turned into parquet files in verl's row shape.

``rlx data prepare gsm8k --out DIR`` reads ``openai/gsm8k`` (config ``main``) through the ``datasets``
library, or a local copy in the original layout with ``--source`` (JSONL, JSON or parquet files with
``question`` and ``answer``, the answer ending in ``#### N``), and writes ``DIR/train.parquet`` and
``DIR/test.parquet``. Each row::

    {"prompt": [{"role": "user", "content": QUESTION + " " + INSTRUCTION}],
     "data_source": "openai/gsm8k", "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, "question": QUESTION, "answer": FULL_SOLUTION}}

``rlx data prepare math`` does the same for boxed-answer sets (default
``DigitalLearningGmbH/MATH-lighteval``; ``--dataset HuggingFaceH4/MATH-500`` and similar work too):
the question is ``problem`` (or ``question``), the ground truth the ``answer`` column when there is
one, else the last ``\\boxed{}`` of ``solution``. Rows without a usable answer are skipped and counted.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlx import _compat
from rlx.errors import UserError, require
from rlx.run.data import file_problem, missing_columns, os_error_text, role_problem

GSM8K_INSTRUCTION = ('Think it through step by step, then write "####" followed by the final answer '
                     '(a number) on the last line.')
MATH_INSTRUCTION = "Think it through step by step, and put the final answer in \\boxed{}."
GEO3K_INSTRUCTION = ("Reason about the figure first, inside <think> </think>, then give the final answer in "
                     "\\boxed{}.")
SOURCE_SUFFIXES = (".jsonl", ".json", ".parquet")
SPLIT_WORDS = {"train": "train", "test": "test", "validation": "validation", "valid": "validation",
               "val": "validation", "dev": "validation"}


@dataclass(frozen=True)
class Recipe:
    """How one public data set becomes rlx rows."""

    name: str
    hub_path: str
    hub_config: str | None
    data_source: str
    instruction: str
    convert: Callable[[dict[str, Any]], tuple[str, str, dict[str, Any]] | None]  # -> question, truth, extra
    images: str | None = None  # the record's column of images, written as the rows' ``images`` (vision data)


def gsm8k_answer(solution: str) -> str | None:
    """The number after the last ``####`` of a GSM8K solution, without thousands separators."""
    if not isinstance(solution, str) or "####" not in solution:
        return None
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "").replace("$", "")
    return answer or None


def _gsm8k(raw: dict[str, Any]) -> tuple[str, str, dict[str, Any]] | None:
    question, solution = raw.get("question"), raw.get("answer")
    truth = gsm8k_answer(solution) if isinstance(solution, str) else None
    if not isinstance(question, str) or not question.strip() or truth is None:
        return None
    return question.strip(), truth, {"question": question, "answer": solution}


def _math(raw: dict[str, Any]) -> tuple[str, str, dict[str, Any]] | None:
    from rlx.run.answers import last_boxed

    question = raw.get("problem", raw.get("question"))
    truth = raw.get("answer")
    if truth is None or (isinstance(truth, str) and not truth.strip()):
        solution = raw.get("solution")
        truth = last_boxed(solution) if isinstance(solution, str) else None
    if not isinstance(question, str) or not question.strip() or truth is None or not str(truth).strip():
        return None
    solution = raw.get("solution")
    extra = {"question": question, "answer": solution if isinstance(solution, str) else str(truth)}
    for key in ("level", "type", "subject", "unique_id"):
        if raw.get(key) is not None:
            extra[key] = str(raw[key])  # one type per column, whatever the source mixes
    return question.strip(), str(truth).strip(), extra


def _geo3k(raw: dict[str, Any]) -> tuple[str, str, dict[str, Any]] | None:
    """Geometry3K (hiyouga/geometry3k): its problem text holds an ``<image>`` marker per figure."""
    question, truth, images = raw.get("problem"), raw.get("answer"), raw.get("images")
    if not isinstance(question, str) or not question.strip() or truth is None or not str(truth).strip():
        return None
    if not isinstance(images, (list, tuple)) or question.count("<image>") != len(images):
        return None
    return question.strip(), str(truth).strip(), {"question": question, "answer": str(truth)}


def image_entry(image: Any) -> dict[str, Any]:
    """A data set's image as the rows store it: ``{"bytes": <PNG or the original file>, "path": None}``."""
    import io

    if isinstance(image, dict) and isinstance(image.get("bytes"), (bytes, bytearray)):
        return {"bytes": bytes(image["bytes"]), "path": None}
    if isinstance(image, (bytes, bytearray)):
        return {"bytes": bytes(image), "path": None}
    out = io.BytesIO()
    image.save(out, format="PNG")  # a PIL image, as the datasets library decodes an Image column
    return {"bytes": out.getvalue(), "path": None}


RECIPES = {
    "gsm8k": Recipe("gsm8k", "openai/gsm8k", "main", "openai/gsm8k", GSM8K_INSTRUCTION, _gsm8k),
    "math": Recipe("math", "DigitalLearningGmbH/MATH-lighteval", None, "DigitalLearningGmbH/MATH-lighteval",
                   MATH_INSTRUCTION, _math),
    "geo3k": Recipe("geo3k", "hiyouga/geometry3k", None, "hiyouga/geometry3k", GEO3K_INSTRUCTION, _geo3k,
                    images="images"),
}


# -- reading ------------------------------------------------------------------------------------
# The generic checks of a data file (file_problem, os_error_text, missing_columns, role_problem) are the
# run's data service's (rlx.run.data); the recipes below use them.
def read_records(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL, JSON (a list, or ``{"data": [...]}``) or parquet file."""
    problem = file_problem(path)
    if problem is not None:
        raise UserError(f"Cannot read {path}: {problem}.")
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".jsonl":
            rows = []
            for lineno, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise UserError(f"{path}: line {lineno} is not valid JSON: {exc.msg}") from None
            return rows
        data = json.loads(text)
    except UserError:
        raise
    except OSError as exc:
        raise UserError(f"Cannot read {path}: {os_error_text(exc)}.") from None
    except Exception as exc:
        raise UserError(f"Cannot read {path}: {type(exc).__name__}: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a list of records, got {type(data).__name__}")
    return data


def split_of(path: Path) -> str | None:
    """``train``/``test``/``validation`` from a file name such as ``train-00000-of-00001.parquet``."""
    for word in re.split(r"[^a-z]+", path.name.lower()):
        if word in SPLIT_WORDS:
            return SPLIT_WORDS[word]
    return None


def read_sources(sources: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Records per split from ``--source`` arguments: ``FILE``, ``SPLIT=FILE`` or a folder of files."""
    out: dict[str, list[dict[str, Any]]] = {}
    for spec in sources:
        split, eq, ref = spec.partition("=")
        if not eq or os.sep in split or not split:
            split, ref = "", spec
        if not ref.strip():
            raise UserError(f"--source {spec}: give a file or folder after '='.")
        path = Path(os.path.expanduser(ref))
        try:
            path.stat()
            files = sorted(p for p in path.rglob("*") if p.suffix in SOURCE_SUFFIXES) if path.is_dir() else [path]
        except FileNotFoundError:
            raise UserError(f"--source {spec}: no such file or folder.") from None
        except OSError as exc:
            raise UserError(f"--source {spec}: {os_error_text(exc)}.") from None
        if not files:
            raise UserError(f"--source {spec}: no {', '.join(SOURCE_SUFFIXES)} files in the folder.")
        for f in files:
            if f.suffix not in SOURCE_SUFFIXES:
                raise UserError(f"--source {spec}: {f.name} is not a {', '.join(SOURCE_SUFFIXES)} file.")
            name = split or split_of(f)
            if name is None:
                raise UserError(f"--source {spec}: cannot tell the split of {f.name} from its name.",
                                f"Name the split: --source train={ref} (or test=...).")
            out.setdefault(name, []).extend(read_records(f))
    return out


def read_hub(recipe: Recipe, hub_path: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every split of the data set on the Hugging Face hub (through the ``datasets`` library)."""
    datasets = require("datasets", "data", f"rlx data prepare {recipe.name} (downloading from the hub)")
    path = hub_path or recipe.hub_path
    config = recipe.hub_config if path == recipe.hub_path else None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        loaded = datasets.load_dataset(path, config) if config else datasets.load_dataset(path)
    except Exception as exc:
        raise UserError(f"Cannot load {path!r} from the Hugging Face hub: {type(exc).__name__}: {exc}",
                        "Without network access, copy the data set's files (JSONL or parquet) here and pass "
                        "--source FILE_OR_FOLDER.") from None
    return {str(split): [dict(r) for r in ds] for split, ds in loaded.items()}


# -- writing ------------------------------------------------------------------------------------
def make_row(question: str, truth: str, extra: dict[str, Any], *, split: str, index: int, data_source: str,
             instruction: str) -> dict[str, Any]:
    content = f"{question} {instruction}".strip() if instruction else question
    return {
        "prompt": [{"role": "user", "content": content}],
        "data_source": data_source,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, **extra},
    }


def write_parquet(rows: list[dict[str, Any]], target: Path) -> None:
    """Write atomically: a temporary file in the same folder, then a rename."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"Cannot create the folder {str(target.parent)!r}: {exc.strerror or exc}.") from None
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        table = pa.Table.from_pylist(rows)
        pq.write_table(table, tmp)
        os.replace(tmp, target)
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"Cannot write {target}: {type(exc).__name__}: {exc}") from None
    finally:
        tmp.unlink(missing_ok=True)


def check_out_dir(out_dir: str) -> None:
    """Fail before reading anything when ``out_dir`` cannot become a folder of ours: a file, or read-only."""
    path = Path(os.path.expanduser(out_dir))
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        what = "is a file" if existing == path else f"is under {str(existing)!r}, which is a file"
        raise UserError(f"--out {out_dir}: {what}, not a folder.", "Give a folder for the parquet files.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"--out {out_dir}: cannot write into {str(existing)!r} (permission denied).")


@dataclass
class SplitReport:
    split: str
    path: Path
    written: int
    skipped: int


def prepare(name: str, out_dir: str, *, sources: list[str] | None = None, hub_path: str | None = None,
            instruction: str | None = None, data_source: str | None = None,
            limit: int | None = None) -> list[SplitReport]:
    """Write ``out_dir/<split>.parquet`` for every split of data set ``name``; see the module docstring."""
    if name not in RECIPES:
        from rlx.errors import did_you_mean

        raise UserError(f"No data set recipe named {name!r}.{did_you_mean(name, list(RECIPES))} "
                        f"Recipes: {', '.join(RECIPES)}.")
    recipe = RECIPES[name]
    check_out_dir(out_dir)
    raw = read_sources(sources) if sources else read_hub(recipe, hub_path)
    # A hub id names the rows' source; a local folder given as --dataset is a copy of the recipe's set.
    is_hub_id = hub_path is not None and not Path(os.path.expanduser(hub_path)).exists()
    source = data_source or (hub_path if is_hub_id else recipe.data_source)
    text = recipe.instruction if instruction is None else instruction
    reports = []
    for split, records in sorted(raw.items()):
        rows, skipped = [], 0
        for record in records:
            converted = recipe.convert(record) if isinstance(record, dict) else None
            if converted is None:
                skipped += 1
                continue
            question, truth, extra = converted
            row = make_row(question, truth, extra, split=split, index=len(rows), data_source=source,
                           instruction=text)
            if recipe.images is not None:
                row["images"] = [image_entry(im) for im in record[recipe.images]]
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
        if not rows:
            raise UserError(f"{name} {split}: none of the {len(records)} records has a usable question and answer.",
                            "gsm8k needs 'question' and 'answer' ending in '#### N'; math needs 'problem' and "
                            "'answer' or a 'solution' with \\boxed{}; geo3k needs 'problem' (an <image> per "
                            "figure), 'answer' and 'images'.")
        target = Path(os.path.expanduser(out_dir)) / f"{split}.parquet"
        write_parquet(rows, target)
        reports.append(SplitReport(split, target, len(rows), skipped))
    return reports


# -- preference pairs ---------------------------------------------------------------------------
# A preference row holds a prompt and two replies to it, ``chosen`` (preferred) and ``rejected``, in either
# form that common sets use: plain text (the prompt a user message, each reply one assistant message), or
# chat messages (``prompt`` the conversation so far, each reply the messages that follow it; a reply that
# repeats the whole conversation, as UltraFeedback-binarized does, has the prompt's messages removed). With
# no prompt column, two conversations share their first messages as the prompt (the implicit-prompt form).
Messages = list[dict[str, str]]


@dataclass
class PreferencePair:
    prompt: Messages
    chosen: Messages
    rejected: Messages
    margin: float = 0.0


def render(tokenizer: Any, prompt: Messages, reply: Messages) -> str:
    """The conversation text the reward model reads: the chat template over prompt + reply (no generation
    prompt), or the messages' contents one per line when the tokenizer has none, as the ``reward_model``
    reward renders a rollout."""
    messages = prompt + reply
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "\n".join(m["content"] for m in messages)


def conversation_ids(tokenizer: Any, prompt: Messages, reply: Messages) -> list[int]:
    return tokenizer(render(tokenizer, prompt, reply), add_special_tokens=False)["input_ids"]


def _messages(value: Any, key: str, role: str) -> tuple[Messages | None, str | None]:
    """``value`` as chat messages (text becomes one message of ``role``), or why it cannot be."""
    if isinstance(value, str):
        return [{"role": role, "content": value}], None
    if isinstance(value, dict):  # one message given on its own
        value = [value]
    if not isinstance(value, (list, tuple)):
        return None, f"{key!r} must be text or a list of chat messages (got {type(value).__name__})"
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return None, f"{key}[{j}] must be {{'role': str, 'content': str}}"
        out.append({"role": m["role"], "content": m["content"]})
    why = role_problem(out, key)
    return (None, why) if why else (out, None)


def _strip_prefix(reply: Messages, prompt: Messages) -> Messages:
    return reply[len(prompt):] if len(reply) > len(prompt) and reply[:len(prompt)] == prompt else reply


def _shared_prefix(a: Messages, b: Messages) -> int:
    n = 0
    while n < min(len(a), len(b)) - 1 and a[n] == b[n]:  # each keeps at least its last message
        n += 1
    return n


def preference_pair(row: Any, *, prompt_key: str = "prompt", chosen_key: str = "chosen",
                    rejected_key: str = "rejected", margin_key: str | None = None
                    ) -> tuple[PreferencePair | None, list[str]]:
    """The pair a preference row holds, or ``None`` and every reason it cannot be used (a missing or empty
    side, identical replies, a malformed prompt or margin)."""
    if not isinstance(row, dict):
        return None, [f"row is a {type(row).__name__}, not a mapping"]
    problems: list[str] = []
    sides: dict[str, Messages] = {}
    for key in (chosen_key, rejected_key):
        value = row.get(key)
        if value is None:
            problems.append(f"missing {key!r}")
            continue
        msgs, why = _messages(value, key, "assistant")
        if why:
            problems.append(why)
        elif msgs is not None:
            sides[key] = msgs
    raw_prompt = row.get(prompt_key)
    prompt: Messages | None = None
    if raw_prompt is not None:
        prompt, why = _messages(raw_prompt, prompt_key, "user")
        if why:
            problems.append(why)
        elif prompt is not None and not any(m["content"].strip() for m in prompt):
            problems.append(f"{prompt_key!r} is empty")
    elif len(sides) == 2 and all(isinstance(row.get(k), (list, tuple)) for k in sides):
        c, r = sides[chosen_key], sides[rejected_key]
        n = _shared_prefix(c, r)
        prompt = c[:n]
    else:
        problems.append(f"missing {prompt_key!r} (needed unless {chosen_key!r} and {rejected_key!r} are whole "
                        "conversations)")
    if prompt is not None:
        sides = {k: _strip_prefix(v, prompt) for k, v in sides.items()}
    for key, msgs in sides.items():
        if not any(m["content"].strip() for m in msgs):
            problems.append(f"{key!r} is empty")
    if len(sides) == 2 and sides[chosen_key] == sides[rejected_key]:
        problems.append(f"{chosen_key!r} and {rejected_key!r} are identical (nothing to prefer)")
    margin = 0.0
    if margin_key is not None:
        value = row.get(margin_key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            problems.append(f"{margin_key!r} (the margin) must be a finite number (got {value!r})")
        else:
            margin = float(value)
    if problems or prompt is None:
        return None, problems
    return PreferencePair(prompt, sides[chosen_key], sides[rejected_key], margin), []


def preference_column_problems(rows: list[Any], file: str, *, prompt_key: str = "prompt",
                               chosen_key: str = "chosen", rejected_key: str = "rejected",
                               margin_key: str | None = None) -> list[str]:
    """One line per column a preference file lacks in every row (a renamed column, or the margin column
    the config names), with the columns it has. The prompt column counts only where some row's replies are
    text, since whole conversations carry their prompt."""
    keys = [chosen_key, rejected_key]
    if any(isinstance(r, dict) and not (isinstance(r.get(chosen_key), (list, tuple))
                                        and isinstance(r.get(rejected_key), (list, tuple))) for r in rows):
        keys.insert(0, prompt_key)
    if margin_key is not None:
        keys.append(margin_key)
    return missing_columns(rows, keys, file)


def is_preference_file(rows: list[Any], chosen_key: str = "chosen", rejected_key: str = "rejected") -> bool:
    """Whether rows are preference pairs (they have a chosen or rejected column) rather than prompts."""
    return any(isinstance(r, dict) and (chosen_key in r or rejected_key in r) for r in rows)


@dataclass
class PreferenceReport:
    split: str
    path: Path
    written: int
    dropped: dict[str, int]


def _drop_reason(problems: list[str], sides: tuple[str, str]) -> str:
    """The one reason a dropped row is counted under."""
    for key in sides:
        if f"missing {key!r}" in problems:
            return "missing side"
    for key in sides:
        if f"{key!r} is empty" in problems:
            return "empty side"
    return "identical" if any("identical" in p for p in problems) else "malformed"


def prepare_preference(out_dir: str, *, sources: list[str] | None = None, hub_path: str | None = None,
                       data_source: str | None = None, prompt_key: str = "prompt", chosen_key: str = "chosen",
                       rejected_key: str = "rejected", margin_key: str | None = None,
                       tokenizer: Any = None, max_length: int | None = None,
                       limit: int | None = None) -> list[PreferenceReport]:
    """Write ``out_dir/<split>.parquet`` of preference rows in rlx's form (``prompt`` chat messages, ``chosen``
    and ``rejected`` the messages of each reply, ``margin`` when ``margin_key`` names one, ``data_source``)
    from local files or a hub data set. Rows with a missing or empty side, identical replies or a bad shape
    are dropped and counted per reason; with ``tokenizer`` and ``max_length``, so are pairs whose longer side
    (chat template applied) is over ``max_length`` tokens."""
    if not sources and not hub_path:
        raise UserError("rlx data prepare preference needs the data: --source FILE_OR_FOLDER (parquet, JSONL or "
                        "JSON with prompt/chosen/rejected) or --dataset HUB_ID.")
    check_out_dir(out_dir)
    if sources:
        raw = read_sources(sources)
    else:
        recipe = Recipe("preference", str(hub_path), None, str(hub_path), "", lambda r: None)
        raw = read_hub(recipe, hub_path)
    # A hub id names the rows' source; a local folder given as --dataset does not.
    is_hub_id = hub_path is not None and not Path(os.path.expanduser(hub_path)).exists()
    source = data_source or (hub_path if is_hub_id else "preference")
    reports = []
    for split, records in sorted(raw.items()):
        rows: list[dict[str, Any]] = []
        dropped: dict[str, int] = {}
        for record in records:
            pair, problems = preference_pair(record, prompt_key=prompt_key, chosen_key=chosen_key,
                                             rejected_key=rejected_key, margin_key=margin_key)
            reason = _drop_reason(problems, (chosen_key, rejected_key)) if pair is None else None
            if pair is not None and tokenizer is not None and max_length is not None:

                longest = max(len(conversation_ids(tokenizer, pair.prompt, side))
                              for side in (pair.chosen, pair.rejected))
                reason = "over-long" if longest > max_length else None
            if reason is not None or pair is None:
                dropped[reason or "malformed"] = dropped.get(reason or "malformed", 0) + 1
                continue
            row: dict[str, Any] = {"prompt": pair.prompt, "chosen": pair.chosen, "rejected": pair.rejected,
                                   "data_source": source}
            if margin_key is not None:
                row["margin"] = pair.margin
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
        if not rows:
            why = ", ".join(f"{n} {r}" for r, n in dropped.items()) or "no records"
            raise UserError(f"preference {split}: none of the {len(records)} records is a usable pair ({why}).",
                            f"Each record needs {chosen_key!r} and {rejected_key!r} replies that differ, and a "
                            f"{prompt_key!r} (text or chat messages); name other columns with --prompt-key, "
                            "--chosen-key, --rejected-key.")
        target = Path(os.path.expanduser(out_dir)) / f"{split}.parquet"
        write_parquet(rows, target)
        reports.append(PreferenceReport(split, target, len(rows), dropped))
    return reports


# Names that lived here in rlx 0.1 (issue 26 moved them); kept for one release, with a DeprecationWarning.
__getattr__ = _compat.moved_attributes(__name__, {
    "CHAT_ROLES": "rlx.run.data",
    "columns_present": "rlx.run.data",
})
