"""Built-in resources for the default job: a tiny model, its tokenizer and a synthetic task.

They are written once to a cache folder as ordinary files (a Hugging Face model folder and parquet
files in the usual row shape) and then loaded through the same code paths as a user's model and
data. Refer to them in a config as ``builtin:NAME``:

- ``builtin:tiny-qwen2``  a 2-layer Qwen2 with random weights and a 64-token byte-level BPE tokenizer;
- ``builtin:arith-train`` / ``builtin:arith-test``  single-digit addition prompts whose answers are
  single digits ("What is 3+4?" -> "7"), scored by the ``arith`` reward.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

PREFIX = "builtin:"
SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Every character the synthetic task and chat template use, plus a few more letters so the
# untrained model has wrong answers to unlearn.
ALPHABET = list("0123456789+-=?.,:# abcdefghijklmnopqrstuvwxyzWAS\n")
VOCAB_SIZE = 64
RESOURCES = ("tiny-qwen2", "arith-train", "arith-test")


def cache_dir() -> Path:
    return Path(os.environ.get("RLX_CACHE", Path.home() / ".cache" / "rlx")) / "builtin"


def is_builtin(ref: str) -> bool:
    return ref.startswith(PREFIX)


def resolve(ref: str) -> str:
    """The local path of a ``builtin:`` resource, writing it first if needed; other refs unchanged."""
    if not is_builtin(ref):
        return ref
    name = ref[len(PREFIX):]
    if name not in RESOURCES:
        from rlx.errors import UserError, did_you_mean

        raise UserError(f"Unknown built-in resource {ref!r}.{did_you_mean(name, RESOURCES)} "
                        f"Built-ins: {', '.join(PREFIX + r for r in RESOURCES)}")
    target = cache_dir() / (name if name == "tiny-qwen2" else f"{name}.parquet")
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        writer = _write_tiny_model if name == "tiny-qwen2" else _write_arith
        _atomic_write(target, lambda tmp: writer(tmp, name))
    return str(target)


def _atomic_write(target: Path, write) -> None:
    """Write to a temporary sibling, then rename: a concurrent or killed writer leaves no half file."""
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        out = tmp / target.name
        write(out)
        try:
            os.replace(out, target)
        except OSError:
            if not target.exists():  # another process may have won the race; theirs is complete
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_tokenizer():
    """A byte-level BPE tokenizer of 64 tokens with a chat template, trained with `tokenizers`.

    Byte-level BPE is what Qwen2 models use, so `AutoTokenizer` loads it as a Qwen2 tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=[], show_progress=False)
    tok.train_from_iterator(["".join(ALPHABET)] * 4 + ["user assistant What is"], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _write_tiny_model(path: Path, _name: str) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
        tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)


def arith_rows(split: str, count: int, seed: int) -> list[dict]:
    """Prompts "What is a+b?" with a + b <= 9, in the verl row shape."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10) for b in range(10) if a + b <= 9]
    rows = []
    for i in range(count):
        a, b = rng.choice(pairs)
        rows.append({
            "prompt": [{"role": "user", "content": f"What is {a}+{b}?"}],
            "data_source": "rlx/arith",
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": i, "a": a, "b": b},
        })
    return rows


def _write_arith(path: Path, name: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    split = name.split("-")[1]
    rows = arith_rows(split, 2048 if split == "train" else 64, seed=0 if split == "train" else 1)
    pq.write_table(pa.Table.from_pylist(rows), path)
