"""The built-in vision task: a tiny Qwen2.5-VL and prompts whose answer is in the image.

- ``builtin:tiny-qwen2-vl``  a 2-layer, 64-wide Qwen2.5-VL language model with a 2-block, 32-wide vision tower
  (14-pixel patches merged 2 x 2), the byte-level BPE tokenizer of ``builtin:tiny-qwen2`` with Qwen2-VL's vision
  tokens, a chat template that renders image parts as Qwen2.5-VL's does, and a Pillow image processor
  (``preprocessor_config.json``: every image resized to 56 x 56 pixels, 16 patches, 4 image tokens). A supervised
  warm start (:func:`vision_warm_start`) teaches the reply's format: a lone digit, each equally likely whatever the
  image, so its accuracy is chance (0.1);
- ``builtin:colors-train`` / ``builtin:colors-test``  prompts "<image>Which digit?" whose image is a square of one
  of ten colours (:data:`COLORS`, with a little noise), the answer the colour's index (0-9), every answer equally
  common, scored by the ``arith`` reward. The text of every prompt is the same: what the policy learns to answer
  it has to read from the image.
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Ten colours far apart in RGB.
COLORS = [(230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48), (145, 30, 180),
          (70, 240, 240), (240, 50, 230), (128, 128, 128), (20, 20, 20)]
IMAGE_SIZE = 56
QUESTION = "<image>Which digit?"
WARM_START_STEPS = 60


def build_vision_tokenizer() -> Any:
    """``builtin:tiny-qwen2``'s tokenizer with the vision tokens added (special) and the vision chat template."""
    from rlx.plugins.tasks.builtin import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_TOKENS]})
    tok.chat_template = VISION_TEMPLATE
    return tok


def image_processor() -> Any:
    """Qwen2-VL's image processor on Pillow (transformers' torchvision one where that backend is not there)."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as Processor,
        )
    except ImportError:
        from transformers import Qwen2VLImageProcessor as Processor

    pixels = IMAGE_SIZE * IMAGE_SIZE
    return Processor(size={"shortest_edge": pixels, "longest_edge": pixels}, patch_size=14, merge_size=2,
                     temporal_patch_size=2)


def color_png(index: int, rng: random.Random) -> bytes:
    """A square of colour ``index`` with each pixel's channels moved by up to 12, as PNG bytes."""
    import numpy as np
    from PIL import Image

    noise = np.random.default_rng(rng.getrandbits(64)).integers(-12, 13, (IMAGE_SIZE, IMAGE_SIZE, 3))
    pixels = np.clip(np.array(COLORS[index])[None, None, :] + noise, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


def color_rows(split: str, count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        answer = rng.randrange(10) if split == "train" else i % 10
        rows.append({
            "prompt": [{"role": "user", "content": QUESTION}],
            "images": [{"bytes": color_png(answer, rng), "path": None}],
            "data_source": "rlx/colors",
            "ability": "vision",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"split": split, "index": i},
        })
    return rows


def write_colors(path: Path, name: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    split = name.split("-")[1]
    rows = color_rows(split, 1024 if split == "train" else 100, seed=0 if split == "train" else 1)
    pq.write_table(pa.Table.from_pylist(rows), path)


def write_tiny_vl_model(path: Path, _name: str) -> None:
    """The model folder of ``builtin:tiny-qwen2-vl``, given its warm start (a few seconds)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from rlx.plugins.tasks.builtin import INIT_STD

    tok = build_vision_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}, tie_word_embeddings=True,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                initializer_range=INIT_STD)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                  initializer_range=INIT_STD)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True,
                              pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                              bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config)
    processor = image_processor()
    vision_warm_start(model, tok, processor)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    processor.save_pretrained(path)


def vision_warm_start(model: Any, tok: Any, processor: Any, steps: int = WARM_START_STEPS, lr: float = 3e-3,
                      seed: int = 0, batch: int = 32) -> list[float]:
    """Teach the reply's format, not the answer (as ``builtin:tiny-qwen2``'s warm start does): prompts with a
    random colour's image, the first reply token's target every digit equally, the next the end of the turn."""
    import torch

    from rlx.plugins.modeling.vision import rope_positions
    from rlx.plugins.tasks.builtin import format_step
    from rlx.run.vision import content_parts

    rng = random.Random(seed)
    text = tok.apply_chat_template(content_parts([{"role": "user", "content": QUESTION}], 1, "warm start"),
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    tokens = IMAGE_SIZE * IMAGE_SIZE // (14 * 14) // 4
    prompt = [t for i in ids for t in ([i] * tokens if i == image_id else [i])]
    digit_ids = torch.tensor(tok.convert_tokens_to_ids([str(d) for d in range(10)]))
    gen = torch.Generator().manual_seed(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    from PIL import Image

    pool = [Image.open(io.BytesIO(color_png(k % 10, rng))) for k in range(100)]
    for _ in range(steps):
        images = [pool[rng.randrange(len(pool))] for _ in range(batch)]
        pixels = processor(images=images, return_tensors="pt")
        replies = digit_ids[torch.randint(10, (batch,), generator=gen)]
        input_ids = torch.cat([torch.tensor([prompt] * batch), replies[:, None]], dim=1)
        mask = torch.ones_like(input_ids)
        positions = rope_positions(model, input_ids, mask, pixels["image_grid_thw"])
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                       pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"]).logits
        losses.append(format_step(optim, logits, digit_ids, tok.eos_token_id))
    model.eval()
    return losses
