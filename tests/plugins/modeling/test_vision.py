"""Prompts with images for vision-language models (rlx.run.vision, rlx.plugins.modeling.vision): the data path, the
trainer's forward pass against the model's own, the hf engine's log-probs, and `rlx train` on the built-in
colours task (a tiny Qwen2.5-VL)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlx.batch import Batch
from rlx.errors import UserError
from rlx.run.data import collate, load_prompts
from rlx.run.models import load_tokenizer
from rlx.run.vision import content_parts, engine_prompts, open_image, vision_prompts


@pytest.fixture(scope="module")
def vl_path(rlx_cache: str) -> str:
    from rlx.plugins.tasks import builtin

    return builtin.resolve("builtin:tiny-qwen2-vl")


@pytest.fixture(scope="module")
def colors_test(rlx_cache: str) -> str:
    from rlx.plugins.tasks import builtin

    return builtin.resolve("builtin:colors-test")


@pytest.fixture(scope="module")
def vision(vl_path: str):
    tok = load_tokenizer(vl_path, False)
    return tok, vision_prompts(vl_path, tok)


def png(color: tuple[int, int, int], size: tuple[int, int] = (56, 84)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def write_rows(path: Path, rows: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def row(content: str, images: list | None, truth: str = "3") -> dict:
    return {"prompt": [{"role": "user", "content": content}], "images": images, "data_source": "rlx/colors",
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"index": 0}}


# -- the data path -------------------------------------------------------------------------------
def test_image_markers_become_content_parts_in_order():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "<image>left <image>right"}]
    parts = content_parts(messages, 2, "row 0")
    assert parts[0] == messages[0]
    assert parts[1]["content"] == [{"type": "image"}, {"type": "text", "text": "left "}, {"type": "image"},
                                   {"type": "text", "text": "right"}]
    with pytest.raises(UserError, match="marks 1 image"):
        content_parts([{"role": "user", "content": "<image>x"}], 2, "row 3")


def test_image_entries_in_every_stored_form_and_a_bad_one(tmp_path: Path):
    data = png((255, 0, 0))
    (tmp_path / "a.png").write_bytes(data)
    for entry in ({"bytes": data, "path": None}, data, str(tmp_path / "a.png"), {"bytes": None, "path": str(
            tmp_path / "a.png")}):
        image = open_image(entry, "row 0")
        assert image.size == (56, 84) and image.mode == "RGB"
    with pytest.raises(UserError, match="row 7: image 1 of the row is not an image file"):
        open_image({"bytes": b"not an image"}, "row 7")
    with pytest.raises(UserError, match="not image bytes or a path"):
        open_image(12, "row 7")


def test_each_image_token_is_repeated_once_per_merged_patch(vision):
    tok, vis = vision
    text, ids = vis.encode([{"role": "user", "content": "<image>What?"}], [{"bytes": png((0, 0, 255))}], "row 0")
    assert "<|vision_start|><|image_pad|><|vision_end|>What?" in text
    grid = vis.processor(images=[open_image(png((0, 0, 255)), "")], return_tensors="np")["image_grid_thw"][0]
    expected = int(grid.prod()) // 4  # 2 x 2 patches merged into one token
    assert expected > 1
    assert ids.count(vis.image_token_id) == expected
    plain = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(plain) + expected - 1
    # inference servers take the unexpanded prompt and the images
    batch = Batch({"input_ids": torch.tensor([ids])}, {"multi_modal_data": [{"image": [{"bytes": png((0, 0, 255))}]}]})
    (short, images), = engine_prompts(batch, [ids], vis.image_token_id)
    assert short == plain and images[0].mode == "RGB" and images[0].getpixel((0, 0)) == (0, 0, 255)


def test_data_with_images_loads_collates_and_names_bad_rows(vision, tmp_path: Path, tiny_model_path: str):
    tok, vis = vision
    good = write_rows(tmp_path / "good.parquet", [row("<image>Which digit?", [{"bytes": png((255, 0, 0))}]),
                                                  row("Which digit?", None, "4")])
    data = load_prompts([good], tok, prompt_key="prompt", max_prompt_length=64, filter_overlong=False,
                        source_key="data.train_files", vision=vis)
    assert data.examples[0].images is not None and data.examples[1].images is None
    batch = collate(data.examples, tok.pad_token_id, vis)
    inputs, raw = batch["multi_modal_inputs"], batch["multi_modal_data"]
    assert inputs[1] is None and raw[1] is None
    # 56 x 84 pixels, over the processor's 56 x 56 budget: scaled to 28 x 56, 2 x 4 patches of 14
    assert inputs[0]["image_grid_thw"].tolist() == [[1, 4, 2]]
    assert inputs[0]["pixel_values"].shape == (8, 3 * 2 * 14 * 14)
    assert raw[0]["image"][0] == {"bytes": png((255, 0, 0))}  # as stored: plain data for checkpoints

    missing = write_rows(tmp_path / "missing.parquet", [row("Which digit?", [{"bytes": png((1, 2, 3))}])])
    with pytest.raises(UserError, match=r"row 0: the prompt marks 0 image\(s\)"):
        load_prompts([missing], tok, prompt_key="prompt", max_prompt_length=64, filter_overlong=False,
                     source_key="data.train_files", vision=vis)
    broken = write_rows(tmp_path / "broken.parquet", [row("<image>x", [{"bytes": b"\x89PNG broken"}])])
    with pytest.raises(UserError, match="row 0: image 1 of the row is not an image file"):
        load_prompts([broken], tok, prompt_key="prompt", max_prompt_length=64, filter_overlong=False,
                     source_key="data.train_files", vision=vis)
    text_tok = load_tokenizer(tiny_model_path, False)
    with pytest.raises(UserError, match=r"row 0 holds images .* not a vision-language model"):
        load_prompts([good], text_tok, prompt_key="prompt", max_prompt_length=64, filter_overlong=False,
                     source_key="data.train_files", vision=vision_prompts(tiny_model_path, text_tok))


def test_rollouts_with_images_are_plain_data_a_checkpoint_holds(vision, colors_test: str, tmp_path: Path):
    from rlx.overlap import Rollouts
    from rlx.trainer import load_rollouts, save_rollouts

    tok, vis = vision
    data = load_prompts([colors_test], tok, prompt_key="prompt", max_prompt_length=64, filter_overlong=False,
                        source_key="x", vision=vis)
    batch = collate(data.examples[:3], tok.pad_token_id, vis)
    save_rollouts(tmp_path / "rollouts.pt", Rollouts(batch, {}, {}, 1))
    back = load_rollouts(tmp_path / "rollouts.pt").batch
    assert back["multi_modal_data"] == batch["multi_modal_data"]
    torch.testing.assert_close(back["multi_modal_inputs"][2]["pixel_values"],
                               batch["multi_modal_inputs"][2]["pixel_values"])


# -- the forward passes --------------------------------------------------------------------------
def _rollout_batch(vision, colors_test: str, rows: int = 6) -> Batch:
    """Prompts with images and without, left-padded to different widths, and random responses."""
    tok, vis = vision
    data = load_prompts([colors_test], tok, prompt_key="prompt", max_prompt_length=64, filter_overlong=False,
                        source_key="x", vision=vis)
    examples = list(data.examples[:rows])
    # a text-only prompt and a longer one: the rows are padded differently
    from rlx.run.data import PromptExample

    examples[1] = PromptExample(tok("<|im_start|>user\nWhich?<|im_end|>\n<|im_start|>assistant\n",
                                    add_special_tokens=False)["input_ids"], "", "rlx/colors", "1", {})
    longer = examples[2]
    examples[2] = PromptExample([tok.convert_tokens_to_ids("<|im_start|>")] * 5 + longer.input_ids, longer.text,
                                longer.data_source, longer.ground_truth, {}, longer.images)
    prompts = collate(examples, tok.pad_token_id, vis)
    g = torch.Generator().manual_seed(0)
    responses = torch.randint(10, 40, (len(examples), 4), generator=g)
    response_mask = torch.ones_like(responses)
    response_mask[0, 3:] = 0
    responses[3, 1] = vis.image_token_id  # a sampled image token is read as padding, its log-prob still taken
    return Batch({"prompts": prompts["input_ids"], "prompt_mask": prompts["attention_mask"],
                  "responses": responses, "response_mask": response_mask}, dict(prompts.non_tensors))


def test_trainer_log_probs_equal_the_models_own_forward_of_each_row(vision, colors_test: str, vl_path: str):
    from transformers import AutoModelForImageTextToText

    from rlx.plugins.modeling.head import response_log_probs

    model = AutoModelForImageTextToText.from_pretrained(vl_path, dtype=torch.float32).eval()
    batch = _rollout_batch(vision, colors_test)
    with torch.no_grad():
        ours, _ = response_log_probs(model, batch, 1.0, with_entropy=False, packed=True)
        for i in range(len(batch)):
            if i == 3:
                continue  # its input holds an image token the model would take for an image
            p = batch["prompts"][i][batch["prompt_mask"][i].bool()]
            r = batch["responses"][i][batch["response_mask"][i].bool()]
            ids = torch.cat([p, r])[None]
            kwargs = {}
            entry = batch["multi_modal_inputs"][i]
            if entry is not None:  # the model computes its own multimodal positions from its token types
                kwargs = {"pixel_values": entry["pixel_values"], "image_grid_thw": entry["image_grid_thw"],
                          "mm_token_type_ids": (ids == model.config.image_token_id).int()}
            logits = model(input_ids=ids, **kwargs).logits[0, len(p) - 1:-1].float()
            expected = torch.log_softmax(logits, -1).gather(-1, r[:, None])[:, 0]
            torch.testing.assert_close(ours[i, :len(r)], expected, atol=1e-5, rtol=1e-5)
            assert (ours[i, len(r):] == 0).all()
    assert torch.isfinite(ours[3]).all()


def test_hf_engine_samples_from_images_with_the_trainers_log_probs(vision, colors_test: str, vl_path: str):
    from transformers import AutoModelForImageTextToText

    from rlx.plugins.modeling.head import response_log_probs
    from rlx.plugins.rollout.hf import HFRollout, HFRolloutOptions
    from rlx.protocols import SamplingParams

    tok, vis = vision
    data = load_prompts([colors_test], tok, prompt_key="prompt", max_prompt_length=64, filter_overlong=False,
                        source_key="x", vision=vis)
    prompts = collate(data.examples[:10], tok.pad_token_id, vis)
    engine = HFRollout(vl_path, HFRolloutOptions(micro_batch_size=6), "cpu", [tok.eos_token_id], tok.pad_token_id)
    out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=3))
    assert out["responses"].shape[0] == 20 and len(out["multi_modal_inputs"]) == 20
    model = AutoModelForImageTextToText.from_pretrained(vl_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ours, _ = response_log_probs(model, out, 1.0, with_entropy=False)
    torch.testing.assert_close(ours, out["rollout_log_probs"], atol=1e-4, rtol=1e-4)
    # the image decides the reply: the first-token distributions of different colours differ
    first = {}
    with torch.no_grad():
        for i in (0, 1):
            row = out.index([2 * i])
            logits = model(input_ids=torch.cat([row["prompts"], row["responses"][:, :0]], 1),
                           attention_mask=row["prompt_mask"], **_model_images(row, model)).logits[0, -1]
            first[i] = torch.softmax(logits, -1)
    assert not torch.allclose(first[0], first[1], atol=1e-4)


def _model_images(row: Batch, model) -> dict:
    entry = row["multi_modal_inputs"][0]
    return {"pixel_values": entry["pixel_values"], "image_grid_thw": entry["image_grid_thw"],
            "mm_token_type_ids": (row["prompts"] == model.config.image_token_id).int()}


# -- rlx train -------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("backend, freeze", [("torch", False), ("fsdp2", True)])
def test_rlx_train_on_images_trains_the_vision_tower_unless_frozen(backend: str, freeze: bool, tmp_path: Path,
                                                                   vl_path: str):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlx", "train", "--preset", "tiny", "--backend", backend,
           "--model", "builtin:tiny-qwen2-vl", "data.train_files=builtin:colors-train",
           "data.val_files=builtin:colors-test", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
           "trainer.total_steps=2", "trainer.test_freq=2", "trainer.save_freq=2", f"trainer.output_dir={out}",
           f"actor.freeze_vision_tower={str(freeze).lower()}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("val/acc" in m for m in metrics)
    assert all(torch.isfinite(torch.tensor(m["actor/pg_loss"])) for m in metrics if "actor/pg_loss" in m)
    exported = out / "hf_model"  # the trained model, with the image processor's settings
    assert (exported / "preprocessor_config.json").is_file()
    before = load_file(str(Path(vl_path) / "model.safetensors"))
    after = load_file(str(exported / "model.safetensors"))
    tower = [k for k in before if "visual" in k and k.endswith("weight")]
    assert tower and set(tower) <= set(after)
    language = [k for k in before if "visual" not in k and k.endswith("weight")]
    assert any(not torch.equal(before[k], after[k]) for k in language), "the language model did not train"
    if freeze:
        assert all(torch.equal(before[k], after[k]) for k in tower), "a frozen vision tower changed"
    else:
        assert any(not torch.equal(before[k], after[k]) for k in tower), "the vision tower did not train"


def test_data_validate_names_rows_whose_images_do_not_fit(tmp_path: Path):
    path = write_rows(tmp_path / "rows.parquet", [row("<image>ok", [{"bytes": png((1, 2, 3))}]),
                                                  row("no marker", [{"bytes": png((1, 2, 3))}]),
                                                  row("<image>bad", [{"bytes": b"junk"}])])
    done = subprocess.run([sys.executable, "-m", "rlx", "data", "validate", path], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "row 1: the prompt marks 0 image(s)" in done.stdout
    assert "row 2: image 1 of the row is not an image file" in done.stdout
    assert "row 0" not in done.stdout and "Traceback" not in done.stderr


@pytest.mark.slow
def test_rlx_eval_scores_a_vision_language_model_on_images(tmp_path: Path, vl_path: str):
    out = tmp_path / "eval.json"
    done = subprocess.run([sys.executable, "-m", "rlx", "eval", "--model", "builtin:tiny-qwen2-vl", "--data",
                           "builtin:colors-test", "--reward", "arith", "--max-tokens", "4", "--output", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    scores = json.loads(out.read_text())["metrics"]["rlx/colors"]  # every prompt, with its image, was answered
    assert scores["prompts"] == scores["samples"] == 100 and 0.0 <= scores["acc"] <= 1.0


def test_data_prepare_geo3k_keeps_the_figures_as_image_rows(tmp_path: Path, vision):
    from PIL import Image

    from rlx.run.data import row_problems
    from rlx.run.vision import image_problems

    src = tmp_path / "geometry3k"
    # the hub's parquet layout: images as {"bytes", "path"} structs; one record without its figure is skipped
    src.mkdir()
    write_rows(src / "train-00000-of-00001.parquet", [
        {"problem": "<image>Find x.", "answer": "3", "images": [{"bytes": png((9, 9, 9)), "path": None}]},
        {"problem": "<image>Find y.", "answer": "4", "images": []}])
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "rlx", "data", "prepare", "geo3k", "--out", str(out), "--source",
                           str(src)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "train: 1 rows" in done.stdout and "--reward geo3k" in done.stdout
    (prepared,) = pq.read_table(out / "train.parquet").to_pylist()
    assert prepared["data_source"] == "hiyouga/geometry3k" and prepared["reward_model"]["ground_truth"] == "3"
    assert prepared["prompt"][0]["content"].startswith("<image>Find x.") and "\\boxed{}" in \
        prepared["prompt"][0]["content"]
    assert not row_problems(prepared) and not image_problems(prepared)
    assert Image.open(io.BytesIO(prepared["images"][0]["bytes"])).getpixel((0, 0)) == (9, 9, 9)
    tok, vis = vision
    data = load_prompts([str(out / "train.parquet")], tok, prompt_key="prompt", max_prompt_length=256,
                        filter_overlong=False, source_key="x", vision=vis)
    assert data.examples[0].input_ids.count(vis.image_token_id) > 1
