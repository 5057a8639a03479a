"""Built-in resources for the default job: a tiny model, its tokenizer and a synthetic task.

They are written once to a cache folder as ordinary files (a Hugging Face model folder and parquet
files in the usual row shape) and then loaded through the same code paths as a user's model and
data. Refer to them in a config as ``builtin:NAME``:

- ``builtin:tiny-qwen2``  a 2-layer Qwen2 (77.6k parameters) and a 64-token byte-level BPE tokenizer,
  given a short supervised *format* warm start when it is written (:func:`format_warm_start`): it
  replies to "What is a+b?" with a lone digit, each digit equally likely, so its accuracy is chance;
- ``builtin:arith-train`` / ``builtin:arith-test``  single-digit addition prompts whose answers are
  single digits ("What is 3+4?" -> "7"), every answer equally common, scored by the ``arith`` reward;
- ``builtin:arith-pref-train`` / ``builtin:arith-pref-test``  preference pairs on the same questions for
  ``rlx rm train``: the correct sum chosen, a wrong digit rejected (:func:`arith_pref_rows`).

The warm start runs once, when the model is first written (about 5 s on one core), and is cached
with the rest; delete the cache folder (:func:`cache_dir`) to write everything again.
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
RESOURCES = ("tiny-qwen2", "arith-train", "arith-test", "arith-pref-train", "arith-pref-test")
VERSION = 2
# Initial weights' std: HF's default of 0.02 suits wide models; at width 64 it leaves the attention
# nearly uniform and its gradients tiny, and learning to read the question's digits stalls for hundreds
# of steps.
INIT_STD = 0.1
# The format warm start (see format_warm_start): a few seconds on one CPU core.
WARM_START_STEPS = 100
WARM_START_BATCH = 32


def cache_dir() -> Path:
    # Versioned: a cache written by an earlier rlx holds another model and data (v1: random weights,
    # unbalanced sums), which the tiny preset's settings do not fit.
    return Path(os.environ.get("RLX_CACHE", Path.home() / ".cache" / "rlx")) / "builtin" / f"v{VERSION}"


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
        writer = (_write_tiny_model if name == "tiny-qwen2"
                  else _write_arith_pref if name.startswith("arith-pref-") else _write_arith)
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
        bos_token_id=tok.eos_token_id, initializer_range=INIT_STD,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    format_warm_start(model, tok)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)


def _question_ids(tok, question: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)


def format_warm_start(model, tok, steps: int = WARM_START_STEPS, lr: float = 3e-3, seed: int = 0) -> list[float]:
    """Teach the reply's format, not the answer: a short supervised run on the task's questions
    ("What is a+b?") whose target for the reply's first token is *every* digit equally (a uniform soft
    label), and for the token after that digit the end of the turn.

    Afterwards the model replies with a lone digit, each about equally likely, whatever the question:
    its accuracy is chance (0.1 on the balanced task), and everything above that has to come from
    reinforcement learning. Without this start a random model almost never replies with a lone digit
    (about 1 sample in 70), so an exact-match reward is almost always 0 and there is nothing to learn
    from. Returns the loss curve.
    """
    import torch

    digit_ids = torch.tensor(tok.convert_tokens_to_ids([str(d) for d in range(10)]))
    questions = torch.tensor([_question_ids(tok, f"What is {a}+{b}?") for a in range(10) for b in range(10 - a)])
    gen = torch.Generator().manual_seed(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    for _ in range(steps):
        rows = torch.randint(len(questions), (WARM_START_BATCH,), generator=gen)
        replies = digit_ids[torch.randint(10, (WARM_START_BATCH,), generator=gen)]
        ids = torch.cat([questions[rows], replies[:, None]], dim=1)  # (b, L + 1); all questions have one length
        logp = torch.log_softmax(model(input_ids=ids).logits[:, -2:].float(), dim=-1)  # (b, 2, V)
        any_digit = -logp[:, 0, digit_ids].mean()  # cross-entropy with the uniform distribution over digits
        stop = -logp[:, 1, tok.eos_token_id].mean()
        loss = any_digit + stop
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def arith_rows(split: str, count: int, seed: int) -> list[dict]:
    """Prompts "What is a+b?" with a + b <= 9, in the verl row shape.

    The sum is drawn uniformly from 0-9 and then the pair that makes it, so every answer is equally
    common: a policy that ignores the question scores 0.1 whatever digit it favours, and nothing pulls
    it towards always giving the most common answer.
    """
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        total = rng.randrange(10) if split == "train" else i % 10
        a = rng.randrange(total + 1)
        b = total - a
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
    rows = arith_rows(split, 2048 if split == "train" else 100, seed=0 if split == "train" else 1)
    pq.write_table(pa.Table.from_pylist(rows), path)


def arith_pref_rows(split: str, count: int, seed: int) -> list[dict]:
    """Preference pairs on the built-in questions: "What is a+b?" with the correct sum chosen and one of the
    nine wrong digits rejected, both drawn uniformly, so neither the reply's digit alone nor the question
    alone tells them apart: a reward model has to relate the reply to the question."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        total = rng.randrange(10)
        a = rng.randrange(total + 1)
        wrong = rng.choice([d for d in range(10) if d != total])
        rows.append({
            "prompt": [{"role": "user", "content": f"What is {a}+{total - a}?"}],
            "chosen": str(total),
            "rejected": str(wrong),
            "data_source": "rlx/arith-pref",
            "extra_info": {"split": split, "index": i},
        })
    return rows


def _write_arith_pref(path: Path, name: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    split = name.rsplit("-", 1)[1]
    rows = arith_pref_rows(split, 2048 if split == "train" else 200, seed=2 if split == "train" else 3)
    pq.write_table(pa.Table.from_pylist(rows), path)
