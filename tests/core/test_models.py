"""Model folders that cannot be loaded are named precisely (`rlx.run.models`), before any heavy load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from rlx.errors import UserError
from rlx.run.models import check_model_folder, is_local, load_tokenizer

TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture
def model_copy(tiny_model_path: str, tmp_path: Path) -> Path:
    """A copy of the built-in tiny model folder to break."""
    return Path(shutil.copytree(tiny_model_path, tmp_path / "model"))


def set_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del config[key]
    (folder / "config.json").write_text(json.dumps(config))


def problem(path: Path | str, **kwargs: object) -> str:
    with pytest.raises(UserError) as info:
        check_model_folder(str(path), **kwargs)  # type: ignore[arg-type]
    return str(info.value)


def test_a_good_folder_passes_and_loads(tiny_model_path):
    check_model_folder(tiny_model_path)
    tok = load_tokenizer(tiny_model_path, False)
    assert tok.chat_template and tok.pad_token_id is not None


def test_missing_file_and_empty_folders(tmp_path):
    assert f"model.path: the folder '{tmp_path / 'nope'}' does not exist." in problem(tmp_path / "nope")
    (tmp_path / "weights.bin").write_bytes(b"x")
    assert "is a file, not a model folder" in problem(tmp_path / "weights.bin")
    (tmp_path / "empty").mkdir()
    assert f"the folder '{tmp_path / 'empty'}' is empty" in problem(tmp_path / "empty")
    assert "reward.path: the folder" in problem(tmp_path / "empty", key="reward.path")


def test_an_rlx_run_folder_given_as_the_model_points_to_its_model(model_copy, tmp_path):
    """`rlx eval --model outputs/rlx/run`: the run folder, not its hf_model, is the usual slip."""
    run = tmp_path / "run"
    (run / "checkpoints" / "global_step_2" / "actor").mkdir(parents=True)
    (run / "checkpoints" / "global_step_2" / "COMPLETE").write_text("")
    (run / "config.yaml").write_text("{}")
    assert f"`rlx export {run} --out DIR` writes its model" in problem(run)
    step = run / "checkpoints" / "global_step_2"
    assert f"It is an rlx checkpoint: `rlx export {step} --out DIR`" in problem(step)
    shutil.copytree(model_copy, run / "hf_model")
    assert f"It is an rlx run folder: its trained model is {run / 'hf_model'}; give that folder." in problem(run)
    check_model_folder(str(run / "hf_model"))


def test_config_json_missing_unreadable_or_without_a_known_model_type(model_copy):
    os.remove(model_copy / "config.json")
    msg = problem(model_copy)
    assert "has no config.json (it holds: chat_template.jinja, generation_config.json, model.safetensors" in msg
    (model_copy / "config.json").write_text("{not json")
    assert "config.json cannot be read as JSON" in problem(model_copy)
    (model_copy / "config.json").write_text("[1, 2]")
    assert "config.json holds a list, not a JSON object" in problem(model_copy)
    (model_copy / "config.json").write_text('{"hidden_size": 8}')
    assert "config.json has no model_type" in problem(model_copy)
    set_config(model_copy, model_type="qwen99")
    msg = problem(model_copy)
    assert f"config.json has model_type 'qwen99', which transformers {transformers.__version__} does not know" in msg
    assert "pip install -U transformers" in msg


def test_a_model_type_with_its_own_code_needs_trust_remote_code(tiny_model_path, model_copy):
    config = json.loads(Path(tiny_model_path, "config.json").read_text())
    config.update(model_type="my_arch", auto_map={"AutoConfig": "configuration_my_arch.MyConfig"})
    (model_copy / "config.json").write_text(json.dumps(config))
    msg = problem(model_copy)
    assert "is a 'my_arch' model with its own code" in msg and "model.trust_remote_code=true" in msg
    check_model_folder(str(model_copy), trust_remote_code=True)


def test_no_tokenizer_files(model_copy):
    for name in TOKENIZER:
        os.remove(model_copy / name)
    msg = problem(model_copy)
    assert "has no tokenizer files (looked for tokenizer.json, *.model, *.spm, *.tiktoken, vocab.json" in msg
    assert "it holds: config.json, generation_config.json, model.safetensors" in msg
    assert "model.tokenizer_path" in msg
    check_model_folder(str(model_copy), tokenizer=False)  # the tokenizer comes from model.tokenizer_path
    with pytest.raises(UserError, match="has no tokenizer files"):
        load_tokenizer(str(model_copy), False)


def test_no_weights_or_missing_shards(model_copy):
    os.rename(model_copy / "model.safetensors", model_copy / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = problem(model_copy)
    assert "model.safetensors.index.json names 2 weight files, of which 1 are missing: " \
           "model-00002-of-00002.safetensors" in msg
    (model_copy / "model.safetensors.index.json").write_text("{}")
    assert "model.safetensors.index.json is not a weight index" in problem(model_copy)
    os.remove(model_copy / "model.safetensors.index.json")
    os.remove(model_copy / "model-00001-of-00002.safetensors")
    msg = problem(model_copy)
    assert "has no weights (looked for *.safetensors, pytorch_model*.bin, model.safetensors.index.json" in msg
    check_model_folder(str(model_copy), weights=False)


def test_truncated_or_damaged_safetensors(model_copy):
    weights = model_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-100])
    assert f"the weight file model.safetensors is not usable: it has {len(data) - 100} bytes where its header " \
           f"describes {len(data)} (truncated or damaged)" in problem(model_copy)
    weights.write_bytes(data[:20])
    assert "its header claims" in problem(model_copy)
    weights.write_bytes(data[:8] + b"x" * (len(data) - 8))
    assert "its header cannot be read (UnicodeDecodeError)" in problem(model_copy) or \
        "its header cannot be read (JSONDecodeError)" in problem(model_copy)
    weights.write_bytes(data)
    check_model_folder(str(model_copy))


def test_load_tokenizer_names_the_problem_instead_of_a_converter_message(tmp_path, model_copy):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="is empty"):
        load_tokenizer(str(tmp_path / "empty"), False)
    (model_copy / "tokenizer.json").write_text("{broken")
    with pytest.raises(UserError, match=r"model\.tokenizer_path: cannot load a tokenizer from the folder"):
        load_tokenizer(str(model_copy), False, key="model.tokenizer_path")


def test_chat_template_is_required(tiny_model_path, tmp_path):
    folder = Path(shutil.copytree(tiny_model_path, tmp_path / "base"))
    os.remove(folder / "chat_template.jinja")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="has no chat template"):
        load_tokenizer(str(folder), False)


def test_hub_ids_and_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert not is_local("Qwen/Qwen2.5-0.5B-Instruct") and not is_local("gpt2")
    assert is_local("./model") and is_local("~/models/x") and is_local("/abs/x") and is_local("a/b/c")
    assert is_local("my model")
    (tmp_path / "Qwen").mkdir()
    (tmp_path / "Qwen" / "Qwen2.5-0.5B-Instruct").mkdir()
    assert is_local("Qwen/Qwen2.5-0.5B-Instruct")  # a folder of that name is what the user means
    check_model_folder("someone/not-downloaded")  # hub ids are left to from_pretrained


# -- through `rlx eval` ---------------------------------------------------------------------------
def rlx_eval(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlx", "eval", "--data", "builtin:arith-test", "--max-tokens", "2",
                           *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_eval_names_the_folder_problem_and_exits_2(model_copy, tmp_path):
    set_config(model_copy, model_type="qwen99")
    proc = rlx_eval("--model", str(model_copy), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model_type 'qwen99'" in proc.stderr and "Traceback" not in proc.stderr
    (tmp_path / "empty").mkdir()
    proc = rlx_eval("--model", str(tmp_path / "empty"), cwd=tmp_path)
    assert proc.returncode == 2 and "is empty" in proc.stderr and "sentencepiece" not in proc.stderr
    proc = rlx_eval("--model", "someone/not-downloaded-anywhere", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cannot load a tokenizer from the hub id 'someone/not-downloaded-anywhere'" in proc.stderr
    assert "Traceback" not in proc.stderr
