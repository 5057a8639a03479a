"""Vision-language models on the torch side: the Hugging Face class that loads one, the image tensors of a batch
and the rotary positions of its rows.

A row with images carries, in the batch's ``multi_modal_inputs`` column, the image processor's ``pixel_values``
(patches, features) and ``image_grid_thw`` (images, 3) of its own images (``rlx.run.vision``); its token ids hold
one image token per merged patch. A forward pass gets every row's patches concatenated in row order, which is the
order the model fills its image tokens in, and the multimodal rotary positions (``get_rope_index`` of Qwen2-VL,
Qwen2.5-VL, Qwen3-VL and GLM-4.1V: three position rows, time, height and width, that differ on image tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from rlx.batch import Batch

COLUMN = "multi_modal_inputs"


def is_vision_config(config: Any) -> bool:
    """Whether a Hugging Face config describes a vision-language model of the kind rlx feeds images to."""
    return getattr(config, "vision_config", None) is not None and getattr(config, "image_token_id", None) is not None


def causal_lm_class(config: Any) -> Any:
    """The auto class that loads the model of ``config`` with its language-model head: ``AutoModelForCausalLM``,
    or ``AutoModelForImageTextToText`` for a vision-language model (transformers keeps those out of the causal-LM
    mapping)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM


def load_causal_lm(path: str, *, config: Any = None, trust_remote_code: bool = False, **kwargs: Any) -> Any:
    """``from_pretrained`` of the model folder ``path`` through :func:`causal_lm_class`."""
    from transformers import AutoConfig

    if config is None:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    return causal_lm_class(config).from_pretrained(path, config=config, trust_remote_code=trust_remote_code,
                                                   **kwargs)


# Where the Hugging Face vision-language classes keep their vision tower (Qwen2-VL family, GLM-4.1V: ``visual``).
TOWERS = ("visual", "vision_tower", "vision_model")


def freeze_vision_tower(model: Any, where: str) -> int:
    """Stop every parameter of ``model``'s vision tower (its LoRA adapters too) from training; the number of
    parameters frozen. A model without a vision tower is a user error naming ``where``."""
    from rlx.errors import UserError

    frozen = 0
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in TOWERS:
            for p in module.parameters():
                if p.requires_grad:
                    p.requires_grad_(False)
                    frozen += p.numel()
    if not frozen and not any(n.rpartition(".")[2] in TOWERS for n, _ in model.named_modules()):
        raise UserError(f"actor.freeze_vision_tower=true, and {where} ({type(model).__name__}) has no vision tower.",
                        "Set actor.freeze_vision_tower=false for a language model.")
    return frozen


def has_images(batch: Batch) -> bool:
    column = batch.non_tensors.get(COLUMN)
    return column is not None and any(entry is not None for entry in column)


def image_tensors(batch: Batch, device: Any, dtype: Any = None) -> dict[str, torch.Tensor]:
    """``pixel_values`` and ``image_grid_thw`` of the batch's rows with images, concatenated in row order."""
    import torch

    rows = [entry for entry in batch.non_tensors[COLUMN] if entry is not None]
    pixels = torch.cat([torch.as_tensor(r["pixel_values"]) for r in rows]).to(device)
    if dtype is not None and pixels.is_floating_point():
        pixels = pixels.to(dtype)
    grid = torch.cat([torch.as_tensor(r["image_grid_thw"]) for r in rows]).to(device=device, dtype=torch.long)
    return {"pixel_values": pixels, "image_grid_thw": grid}


def _rope_owner(model: Any) -> Any:
    """The module that has ``get_rope_index`` (the inner ``*Model`` of a ``*ForConditionalGeneration``)."""
    for candidate in (model, getattr(model, "model", None), getattr(model, "base_model", None)):
        if candidate is not None and callable(getattr(candidate, "get_rope_index", None)):
            return candidate
    raise TypeError(f"{type(model).__name__} has no get_rope_index: rlx feeds images to models of the Qwen2-VL "
                    "family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) and GLM-4.1V")


def rope_positions(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   image_grid_thw: torch.Tensor) -> torch.Tensor:
    """The (3, b, L) rotary positions of padded rows whose image tokens stand for the images of
    ``image_grid_thw`` (in row order); padding gets position 1, which no real token attends to."""
    import inspect

    import torch

    owner = _rope_owner(model)
    config = getattr(owner, "config", None) or model.config
    kwargs: dict[str, Any] = {"image_grid_thw": image_grid_thw, "attention_mask": attention_mask}
    if "mm_token_type_ids" in inspect.signature(owner.get_rope_index).parameters:  # transformers >= 5.2x
        kwargs["mm_token_type_ids"] = (input_ids == int(config.image_token_id)).to(torch.int32)
    positions, _ = owner.get_rope_index(input_ids, **kwargs)
    return positions


def with_images(inputs: dict[str, Any], batch: Batch, model: Any, input_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> dict[str, Any]:
    """``inputs`` (padded rows, prompt then response) with the batch's image tensors and the rows' multimodal
    rotary positions. A response that sampled the image (or video) token itself reads a padding token there: the
    model fills its image tokens with the prompts' image features and counts them, so only the prompt may hold
    them. The log-prob of the sampled token is still the one computed; only what such a row attends to after it
    differs from what the engine read (real models give those tokens no probability to speak of)."""
    import torch

    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    config = _rope_owner(model).config
    width = batch["prompts"].shape[1]
    response = input_ids[:, width:]
    special = [int(t) for t in (config.image_token_id, getattr(config, "video_token_id", None)) if t is not None]
    sampled = torch.isin(response, torch.tensor(special, device=response.device))
    if bool(sampled.any()):
        pad = getattr(config, "pad_token_id", None)
        pad = getattr(getattr(config, "text_config", None), "pad_token_id", None) if pad is None else pad
        input_ids = torch.cat([input_ids[:, :width], response.masked_fill(sampled, int(pad or 0))], dim=1)
    images = image_tensors(batch, input_ids.device, dtype)
    positions = rope_positions(model, input_ids, attention_mask, images["image_grid_thw"])
    return {**inputs, "input_ids": input_ids, **images, "position_ids": positions}
