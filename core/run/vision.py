"""Prompts with images, for vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4.1V).

A prompt row in verl's shape holds its images in ``data.image_key`` (``images`` by default): a list whose entries
are encoded image files (``{"bytes": ..., "path": ...}`` as Hugging Face ``datasets`` stores an ``Image`` column,
or bare bytes) or local paths. The prompt's messages mark where each image goes with ``<image>``, in order (verl's
convention, as its geo3k data writes it). rlx splits each message at the markers into content parts
(``{"type": "image"}``, ``{"type": "text", ...}``), renders them with the model's chat template (one image token
per image), sizes each image with the model's image processor and repeats its image token once per merged patch,
as the model's own processor would. The images stay in the row as their encoded bytes; the image processor runs
again on the rows of each batch (:meth:`VisionPrompts.batch_columns`), so a data set's pixels are never all in
memory.

The batch then carries two per-row columns: ``multi_modal_inputs`` (``pixel_values`` and ``image_grid_thw``, what
the model's forward takes; ``rlx.plugins.modeling.vision``) and ``multi_modal_data`` (``{"image": [PIL images]}``,
what vLLM and SGLang take, decoded, with the prompt's tokens before the image tokens are repeated; the entries as
stored, so that rollouts saved with a checkpoint stay plain data).
"""

from __future__ import annotations

import functools
import io
import os
from typing import Any

from rlx.errors import UserError

IMAGE_PLACEHOLDER = "<image>"
# The model families whose processors repeat one image token per merged patch (what rlx reproduces).
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm4v_moe")


def image_count(entries: Any) -> int:
    """How many images a row's ``data.image_key`` value holds (None or an empty list: 0)."""
    if entries is None:
        return 0
    if isinstance(entries, (list, tuple)):
        return len(entries)
    return 1


def content_parts(messages: list[dict[str, Any]], images: int, where: str) -> list[dict[str, Any]]:
    """``messages`` with each ``<image>`` marker of their contents turned into an image part, checked against the
    row's ``images`` count."""
    out, found = [], 0
    for m in messages:
        text = m["content"]
        if IMAGE_PLACEHOLDER not in text:
            out.append(m)
            continue
        parts: list[dict[str, Any]] = []
        for k, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
            if k:
                parts.append({"type": "image"})
                found += 1
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({**m, "content": parts})
    if found != images:
        raise UserError(f"{where}: the prompt marks {found} image(s) with {IMAGE_PLACEHOLDER!r} and the row holds "
                        f"{images}.",
                        f"Put one {IMAGE_PLACEHOLDER} in the prompt's messages where each image goes, in the order "
                        "of the row's images (verl's geo3k preparation writes it so).")
    return out


def open_image(entry: Any, where: str, index: int = 0) -> Any:
    """A PIL image in RGB from one entry of a row's images (the ``index``-th): ``{"bytes": ...}`` /
    ``{"path": ...}``, bytes, or a path. A file that is not an image is a user error naming the row and image."""
    from rlx.errors import require

    require("PIL", "vision", "Prompts with images")
    from PIL import Image, UnidentifiedImageError

    what = f"image {index + 1} of the row"
    at = f"{where}: " if where else ""
    source: Any = entry
    if isinstance(entry, dict):
        source = entry.get("bytes") or entry.get("path") or entry.get("image")
    try:
        if isinstance(source, (bytes, bytearray)):
            image = Image.open(io.BytesIO(source))
        elif isinstance(source, str) and source:
            image = Image.open(os.path.expanduser(source))
        else:
            raise UserError(f"{at}an image entry is {type(entry).__name__} {str(entry)[:80]!r}, not image bytes "
                            "or a path.",
                            'Store each image as {"bytes": <the encoded file>} (a datasets Image column) or as a '
                            "local path.")
        image.load()
    except UnidentifiedImageError:
        raise UserError(f"{at}{what} is not an image file Pillow can read (PNG, JPEG, WebP, ...).",
                        "Check the row's images: encoded image files or paths to them.") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"{at}{what} cannot be read: {type(exc).__name__}: {exc}",
                        "Check the row's images: encoded image files or paths to them.") from None
    return image.convert("RGB")


class VisionPrompts:
    """A vision-language model folder's image processor and image token, for its prompts."""

    def __init__(self, model_path: str, tokenizer: Any, *, trust_remote_code: bool = False) -> None:
        from transformers import AutoConfig, AutoImageProcessor

        from rlx.errors import require

        require("PIL", "vision", "A vision-language model's prompts with images")
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.model_type = str(getattr(config, "model_type", ""))
        if self.model_type not in FAMILIES or getattr(config, "image_token_id", None) is None:
            raise UserError(f"The data holds images and the model at {model_path} ({self.model_type or 'no type'}) is "
                            "not a vision-language model rlx can feed images to.",
                            "Use a model of the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) or GLM-4.1V, or "
                            "data without images (data.image_key names the column).")
        self.image_token_id = int(config.image_token_id)
        self.merge = int(getattr(config.vision_config, "spatial_merge_size", 2))
        try:
            self.processor = AutoImageProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            raise UserError(f"The model at {model_path} has no image processor that transformers can load: {exc}",
                            "A vision-language model folder holds a preprocessor_config.json (the Hugging Face "
                            "repository's own).") from None
        self.tokenizer = tokenizer

    def encode(self, messages: list[dict[str, Any]], entries: Any, where: str,
               template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
        """The rendered prompt text and its token ids, with each image's token repeated once per merged patch."""
        stored = entries if isinstance(entries, (list, tuple)) else [entries]
        images = [open_image(e, where, k) for k, e in enumerate(stored)]
        parts = content_parts(messages, len(images), where)
        text = self.tokenizer.apply_chat_template(parts, add_generation_prompt=True, tokenize=False,
                                                  **(template_kwargs or {}))
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        marks = sum(1 for t in ids if t == self.image_token_id)
        if marks != len(images):
            raise UserError(f"{where}: the chat template rendered {marks} image token(s) for {len(images)} image(s).",
                            "Use the model's own chat template (it renders an image part as its image token), or "
                            "model.tokenizer_path with a tokenizer whose template does.")
        grids = self.processor(images=images, return_tensors="np")["image_grid_thw"]
        return text, self.expand(ids, [int(g[0] * g[1] * g[2]) // (self.merge ** 2) for g in grids])

    def expand(self, ids: list[int], counts: list[int]) -> list[int]:
        """``ids`` with the k-th image token repeated ``counts[k]`` times."""
        out: list[int] = []
        images = iter(counts)
        for t in ids:
            out.extend([t] * next(images) if t == self.image_token_id else [t])
        return out

    def batch_columns(self, rows: list[Any], where: str) -> dict[str, list[Any]]:
        """The per-row ``multi_modal_inputs`` and ``multi_modal_data`` columns of a batch; rows without images get
        None in both."""
        inputs: list[Any] = []
        data: list[Any] = []
        for entries in rows:
            if not image_count(entries):
                inputs.append(None)
                data.append(None)
                continue
            stored = list(entries) if isinstance(entries, (list, tuple)) else [entries]
            out = self.processor(images=[open_image(e, where, k) for k, e in enumerate(stored)], return_tensors="pt")
            inputs.append({"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]})
            data.append({"image": stored})  # as stored (bytes or paths): plain data a checkpoint can hold
        return {"multi_modal_inputs": inputs, "multi_modal_data": data}


def vision_prompts(model_path: str, tokenizer: Any, trust_remote_code: bool = False) -> VisionPrompts | None:
    """The :class:`VisionPrompts` of a vision-language model folder (its config names a vision tower and an image
    token), None for a language model."""
    if image_token_id(model_path) is None:
        return None
    return VisionPrompts(model_path, tokenizer, trust_remote_code=trust_remote_code)


@functools.lru_cache(maxsize=32)
def image_token_id(model_path: str) -> int | None:
    """The image token of a vision-language model (its config.json's ``image_token_id``; a hub id's config through
    transformers' cache), None for a language model or a model without a readable config."""
    import json

    from rlx.run.models import is_local

    if is_local(model_path):
        try:
            with open(os.path.join(os.path.expanduser(model_path), "config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            return None
    else:
        try:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model_path).to_dict()
        except Exception:  # not reachable or not a model: its own loading reports it
            return None
    value = config.get("image_token_id") if isinstance(config, dict) and "vision_config" in config else None
    return int(value) if isinstance(value, int) else None


def engine_prompts(prompts: Any, ids: list[list[int]], token: int | None) -> list[Any]:
    """Per prompt row, the images an inference server takes with the row's tokens (``multi_modal_data``, decoded to
    PIL images) and the tokens with each image's run of image tokens as one (the server repeats it itself):
    ``(ids, images)``, images None for a text-only row."""
    column = prompts.non_tensors.get("multi_modal_data")
    out = []
    for k, row in enumerate(ids):
        data = column[k] if column is not None else None
        if data is None or token is None:
            out.append((row, None))
            continue
        collapsed = [t for j, t in enumerate(row) if not (t == token and j and row[j - 1] == token)]
        out.append((collapsed, [open_image(e, f"prompt {k}", j) for j, e in enumerate(data["image"])]))
    return out


# What a vision-language model folder holds beside the model and tokenizer files: its processors' settings.
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
                   "chat_template.json")


def copy_processor_files(source: str, target: str) -> None:
    """Copy a vision-language model folder's processor settings into a model folder rlx writes (the trained
    model, ``rlx export``), so that it loads with its images as the original does; nothing for a language model."""
    import shutil

    if image_token_id(source) is None:
        return
    for name in PROCESSOR_FILES:
        path = os.path.join(source, name)
        if os.path.isfile(path) and not os.path.exists(os.path.join(target, name)):
            shutil.copyfile(path, os.path.join(target, name))


def image_problems(row: Any, prompt_key: str = "prompt", image_key: str = "images") -> list[str]:
    """Why a prompt row's images cannot be used (``rlx data validate``): a count of ``<image>`` markers other than
    the row's images, or an image that does not decode; empty for a row without images or a fine one."""
    if not isinstance(row, dict) or not image_count(row.get(image_key)):
        return []
    entries = row[image_key] if isinstance(row[image_key], (list, tuple)) else [row[image_key]]
    prompt = row.get(prompt_key)
    texts = [prompt] if isinstance(prompt, str) else [
        m.get("content") for m in prompt or [] if isinstance(m, dict) and isinstance(m.get("content"), str)]
    problems = []
    marks = sum(t.count(IMAGE_PLACEHOLDER) for t in texts)
    if marks != len(entries):
        problems.append(f"the prompt marks {marks} image(s) with {IMAGE_PLACEHOLDER!r} and {image_key!r} holds "
                        f"{len(entries)}")
    for k, entry in enumerate(entries):
        try:
            open_image(entry, "", k)
        except UserError as exc:
            problems.append(exc.message.rstrip("."))
    return problems
