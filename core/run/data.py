"""Prompt data: parquet rows in verl's shape, checked before use, tokenized with the chat template.

A row holds ``prompt`` (a list of ``{"role", "content"}`` chat messages), ``data_source`` (str),
``reward_model`` (``{"style": ..., "ground_truth": ...}``) and optional ``extra_info`` (dict).
"""

from __future__ import annotations

import errno
import math
import os
import random
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlx.errors import UserError, did_you_mean

MAX_REPORTED = 20


def _resource(ref: str) -> Any:
    """The resource component whose scheme ``ref`` starts with (``builtin`` of ``builtin:arith-train``), or None
    for a plain path. Schemes are registered by plugins (``rlx_resources``; the tasks plugin gives ``builtin``)."""
    scheme, sep, _ = ref.partition(":")
    if not sep or not scheme:
        return None
    from rlx.registry import get_plugin_manager

    return get_plugin_manager().components().get(("resource", scheme))


# Where rlx's own schemes come from, for the message when none answers.
SCHEME_HINT = {"builtin": " (rlx's own tasks plugin does: is it turned off by RLX_DISABLE_PLUGINS?)"}


def unknown_scheme(ref: str) -> str | None:
    """The scheme of ``ref`` when it reads as a ``scheme:name`` reference that no plugin resolves (and is not a
    path that exists), else None."""
    scheme, sep, rest = ref.partition(":")
    if not sep or not rest or not scheme.isidentifier() or len(scheme) < 2 or rest.startswith(("/", "\\")):
        return None
    return None if is_resource(ref) or os.path.exists(os.path.expanduser(ref)) else scheme


def is_resource(ref: str) -> bool:
    """Whether ``ref`` is a resource reference (e.g. ``builtin:tiny-qwen2``) rather than a path."""
    return _resource(ref) is not None


def resolve_path(ref: str) -> str:
    """The local path of ``ref``: a resource reference resolved by its plugin (written first if needed), a path
    with ``~`` expanded."""
    comp = _resource(ref)
    return str(comp.load_factory()(ref)) if comp is not None else os.path.expanduser(ref)


# The roles a chat message may have: the ones chat templates render (an unknown role is dropped or
# rendered verbatim, depending on the template, so the model would see a prompt nobody wrote).
CHAT_ROLES = ("system", "user", "assistant", "tool")


def role_problem(messages: list[Any], key: str) -> str | None:
    """Why chat ``messages`` (already ``{'role': str, 'content': str}`` dicts) cannot be used: the first
    message whose role is not one of :data:`CHAT_ROLES`; None when every role is known."""
    for j, m in enumerate(messages):
        if isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"] not in CHAT_ROLES:
            hint = did_you_mean(m["role"], CHAT_ROLES)
            return (f"{key}[{j}] has the role {m['role']!r}; the roles accepted are {', '.join(CHAT_ROLES)}"
                    + (f".{hint}" if hint else ""))
    return None


def os_error_text(exc: OSError) -> str:
    """Plain words for why a file could not be opened (any :class:`OSError`)."""
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied (this user cannot read the file or enter a folder on its path)"
    if exc.errno == errno.ENOENT:
        return "does not exist"
    if exc.errno == errno.ENOTDIR:
        return "a part of its path is a file, not a folder"
    if exc.errno == errno.EISDIR:
        return "is a folder, not a file"
    return exc.strerror or str(exc)


def file_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be read as a data file, in words (it does not exist, is a folder, permission
    denied, ...), or None when it can be opened. Every :class:`OSError` is turned into words here, so
    the callers that check a data file before reading it share one answer."""
    p = Path(os.path.expanduser(path))
    try:
        mode = p.stat().st_mode
        if stat.S_ISDIR(mode):
            return "is a folder, not a file"
        if not stat.S_ISREG(mode):  # a pipe or device would block or never end
            return "is not a regular file"
        with open(p, "rb"):
            pass
    except OSError as exc:
        return os_error_text(exc)
    except ValueError as exc:  # an embedded NUL byte
        return f"is not a usable path ({exc})"
    return None


def columns_present(rows: list[Any], limit: int = 20) -> str:
    """The columns the rows have, in order of first appearance, for a message."""
    seen: dict[str, None] = {}
    for row in rows:
        if isinstance(row, dict):
            seen.update(dict.fromkeys(str(k) for k in row))
    names = list(seen)
    if not names:
        return "none"
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def missing_columns(rows: list[Any], keys: list[str], file: str) -> list[str]:
    """One line for each of ``keys`` that no row of ``file`` has, naming the columns the rows do have
    (a renamed column is one problem, not one per row); empty when every key is in some row."""
    dicts = [r for r in rows if isinstance(r, dict)]
    if not dicts:
        return []
    present = {str(k) for r in dicts for k in r}
    out = []
    for key in dict.fromkeys(keys):
        if key not in present:
            out.append(f"{file}: no row has the column {key!r} (columns present: {columns_present(dicts)})."
                       + did_you_mean(key, sorted(present)))
    return out



def check_files(refs: list[str], key: str) -> list[str]:
    """Config problems for data files that cannot be read (missing, a folder, permission denied, ...) or
    are not parquet."""
    problems = []
    for ref in refs:
        if is_resource(ref):
            continue
        problem = file_problem(ref)
        scheme = unknown_scheme(ref) if problem == "does not exist" else None
        if scheme is not None:
            problems.append(f"{key}: {ref!r} is a {scheme}: reference, but no installed plugin provides the "
                            f"resource scheme {scheme!r}{SCHEME_HINT.get(scheme, '')}.")
        elif problem == "does not exist":
            problems.append(f"{key}: file {ref!r} does not exist. "
                            f"Write one with `rlx data prepare gsm8k --out DIR` or fix the path.")
        elif problem is not None:
            problems.append(f"{key}: cannot read {ref!r}: {problem}.")
        elif Path(os.path.expanduser(ref)).suffix != ".parquet":
            problems.append(f"{key}: {ref!r} is not a .parquet file")
    return problems


def read_rows(refs: list[str]) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    for ref in refs:
        path = resolve_path(ref)
        problem = file_problem(path)
        if problem is not None:
            raise UserError(f"Cannot read {ref} as parquet: {problem}.")
        try:
            rows.extend(pq.read_table(path).to_pylist())
        except OSError as exc:
            if exc.errno is None:  # pyarrow's own I/O errors about the content
                raise UserError(f"Cannot read {ref} as parquet: {exc}",
                                "Check that the file is a parquet file written by `rlx data prepare`.") from None
            raise UserError(f"Cannot read {ref} as parquet: {os_error_text(exc)}.") from None
        except Exception as exc:
            raise UserError(f"Cannot read {ref} as parquet: {exc}",
                            "Check that the file is a parquet file written by `rlx data prepare`.") from None
    return rows


def row_problems(row: Any, prompt_key: str = "prompt") -> list[str]:
    """Why a row cannot be used; empty if it is fine."""
    if not isinstance(row, dict):
        return [f"row is a {type(row).__name__}, not a mapping"]
    problems = []
    prompt = row.get(prompt_key)
    if prompt is None:
        problems.append(f"missing {prompt_key!r}")
    elif isinstance(prompt, str):
        if not prompt.strip():
            problems.append(f"{prompt_key!r} is empty")
    elif not isinstance(prompt, list) or not prompt:
        problems.append(f"{prompt_key!r} must be a non-empty list of chat messages")
    else:
        for j, m in enumerate(prompt):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(
                    m.get("content"), str):
                problems.append(f"{prompt_key}[{j}] must be {{'role': str, 'content': str}}")
                break
        else:
            why = role_problem(prompt, prompt_key)
            if why:
                problems.append(why)
    source = row.get("data_source")
    if source is None or source == "":
        problems.append("missing 'data_source' (a string naming the data set)")
    elif not isinstance(source, str):
        problems.append(f"'data_source' must be a string naming the data set (got {type(source).__name__})")
    rm = row.get("reward_model")
    truth = rm.get("ground_truth") if isinstance(rm, dict) else None
    if rm is not None and not isinstance(rm, dict):
        problems.append(f"'reward_model' must be a mapping with a 'ground_truth' (got {type(rm).__name__})")
    elif truth is None:
        problems.append("missing 'reward_model.ground_truth'")
    elif isinstance(truth, float) and not math.isfinite(truth):
        problems.append(f"'reward_model.ground_truth' is {truth}, which no answer can equal")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        problems.append(f"'extra_info' must be a mapping (got {type(extra).__name__})")
    return problems


PROMPT_COLUMNS = ("data_source", "reward_model")  # with the prompt column: what a prompt row needs


def column_problems(rows: list[Any], file: str, prompt_key: str = "prompt") -> list[str]:
    """One line per column a prompt file lacks in every row (a renamed column), naming the columns it has."""
    return missing_columns(rows, [prompt_key, *PROMPT_COLUMNS], file)


def validate_rows(rows: list[Any], source: str, prompt_key: str = "prompt") -> None:
    """Raise a :class:`UserError` reporting every bad row (the first few by index and reason)."""
    bad = [(i, p) for i, row in enumerate(rows) for p in [row_problems(row, prompt_key)] if p]
    if not rows:
        raise UserError(f"{source} has no rows.")
    if bad:
        lines = [f"  row {i}: {'; '.join(p)}" for i, p in bad[:MAX_REPORTED]]
        more = f"\n  ... and {len(bad) - MAX_REPORTED} more" if len(bad) > MAX_REPORTED else ""
        raise UserError(
            f"{source}: {len(bad)} of {len(rows)} rows are not usable:\n" + "\n".join(lines) + more,
            "Each row needs prompt (chat messages), data_source and reward_model.ground_truth; "
            "`rlx data prepare` writes files in this shape.",
        )


@dataclass
class PromptExample:
    input_ids: list[int]
    text: str
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any]
    # The row's images as stored (data.image_key; rlx.run.vision), None for a text-only prompt.
    images: Any = None


@dataclass
class PromptDataset:
    examples: list[PromptExample]
    dropped_overlong: int = 0
    stats: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.examples)


def load_prompts(refs: list[str], tokenizer: Any, *, prompt_key: str, max_prompt_length: int,
                 filter_overlong: bool, source_key: str, tools: list[dict[str, Any]] | None = None,
                 image_key: str = "images", vision: Any = None,
                 template_kwargs: dict[str, Any] | None = None) -> PromptDataset:
    """Read, validate, apply the chat template, tokenize, and drop (and count) over-long prompts. ``tools``:
    the schemas of the tools an agent may call, given to the chat template (which lists them to the model).
    ``vision`` (an :class:`rlx.run.vision.VisionPrompts`, for a vision-language model): rows with images in
    ``image_key`` get them in their prompt (a text-only model refuses such rows). ``template_kwargs``
    (``data.apply_chat_template_kwargs``): further keyword arguments of the chat template."""
    from rlx.run.vision import image_count

    rows: list[dict[str, Any]] = []
    for ref in refs:
        file_rows = read_rows([ref])
        missing = column_problems(file_rows, ref, prompt_key)
        if missing:
            raise UserError(f"{source_key}: " + "\n".join(missing),
                            f"A prompt file needs the columns {prompt_key} (chat messages; data.prompt_key names "
                            "another), data_source and reward_model (with ground_truth); `rlx data prepare` "
                            "writes them.")
        rows.extend(file_rows)
    validate_rows(rows, f"{source_key} ({', '.join(refs)})", prompt_key)
    examples, dropped, longest = [], [], 0
    for i, row in enumerate(rows):
        prompt = row[prompt_key]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        images = row.get(image_key) if image_count(row.get(image_key)) else None
        if images is not None and vision is None:
            raise UserError(f"{source_key} ({', '.join(refs)}): row {i} holds images (its {image_key!r} column) and "
                            "the model is not a vision-language model.",
                            "Use a vision-language model (e.g. Qwen2.5-VL) with this data, or point data.image_key "
                            "at a column that does not exist to leave the images out.")
        try:
            extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
            if images is not None:
                text, ids = vision.encode(messages, images, f"{source_key} ({', '.join(refs)}): row {i}", extra)
            else:
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
        except UserError:
            raise
        except Exception as exc:  # a template may reject a conversation (roles must alternate, ...)
            raise UserError(f"{source_key} ({', '.join(refs)}): row {i}: the chat template rejects its "
                            f"{prompt_key!r}: {type(exc).__name__}: {exc}",
                            "Fix the row's messages (the roles this model's template accepts, in its order), "
                            "or drop the row.") from None
        if images is None:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        longest = max(longest, len(ids))
        if len(ids) > max_prompt_length:
            dropped.append(i)
            continue
        examples.append(PromptExample(ids, text, row["data_source"], row["reward_model"]["ground_truth"],
                                      dict(row.get("extra_info") or {}), images))
    if dropped and not filter_overlong:
        raise UserError(f"{source_key}: {len(dropped)} prompts are longer than data.max_prompt_length="
                        f"{max_prompt_length} tokens (rows {dropped[:10]}...; longest {longest}).",
                        "Raise data.max_prompt_length or set data.filter_overlong_prompts=true.")
    if not examples:
        raise UserError(f"{source_key}: every prompt is longer than data.max_prompt_length="
                        f"{max_prompt_length} tokens (longest {longest}).",
                        "Raise data.max_prompt_length.")
    return PromptDataset(examples, len(dropped), {"longest_prompt": float(longest)})


class PromptLoader:
    """Batches of prompts, epoch after epoch, with a position that checkpoints save and restore.

    The order of epoch ``e`` is a permutation seeded by ``seed + e``, so resuming at (epoch, index)
    replays exactly the batches a run without interruption would have seen.
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, *, shuffle: bool, seed: int,
                 drop_last: bool = True) -> None:
        if len(dataset) < batch_size and drop_last:
            raise UserError(f"The training set has {len(dataset)} usable prompts, fewer than "
                            f"data.train_batch_size={batch_size}.",
                            "Lower data.train_batch_size or add data.")
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self.drop_last = drop_last
        self.epoch = 0
        self.index = 0  # batches already taken in this epoch
        self._cached_order: tuple[int, list[int]] = (-1, [])

    def batches_per_epoch(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _order(self, epoch: int) -> list[int]:
        """The permutation of epoch ``epoch``, computed once per epoch."""
        if self._cached_order[0] != epoch:
            order = list(range(len(self.dataset)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            self._cached_order = (epoch, order)
        return self._cached_order[1]

    def __iter__(self) -> Iterator[list[PromptExample]]:
        while True:
            if self.index >= self.batches_per_epoch():
                return
            order = self._order(self.epoch)
            start = self.index * self.batch_size
            self.index += 1
            yield [self.dataset.examples[i] for i in order[start:start + self.batch_size]]

    def next_epoch(self) -> None:
        self.epoch += 1
        self.index = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def collate(examples: list[PromptExample], pad_token_id: int, vision: Any = None) -> Any:
    """A :class:`Batch` of left-padded prompts with their per-row reward inputs; with images (``vision``, an
    :class:`rlx.run.vision.VisionPrompts`) their ``multi_modal_inputs`` and ``multi_modal_data`` columns."""
    import torch

    from rlx.batch import Batch

    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, width - len(e.input_ids):] = torch.tensor(e.input_ids)
        mask[i, width - len(e.input_ids):] = 1
    columns = {"prompt_text": [e.text for e in examples], "data_source": [e.data_source for e in examples],
               "ground_truth": [e.ground_truth for e in examples], "extra_info": [e.extra_info for e in examples]}
    if vision is not None:  # every batch of such a run has the columns (None for a text row): batches concatenate
        columns.update(vision.batch_columns([e.images for e in examples], "a batch of prompts"))
    return Batch({"input_ids": ids, "attention_mask": mask}, columns)
