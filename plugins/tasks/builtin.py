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
- ``builtin:tiny-qwen2-tools``  a 2-layer Qwen2 for multi-turn tool use, with its own byte-level BPE
  tokenizer (:func:`build_tools_tokenizer`: every digit a token of its own, the tool-call JSON a few tokens,
  ``<tool_call>`` and ``<tool_response>`` as added tokens, a chat template in Qwen2.5's shape) and a
  supervised warm start (:func:`tools_warm_start`): to "What is A+B?" (two-digit A and B) it calls the
  ``calculator`` tool half the time, copying the expression, and otherwise guesses a number; after the
  tool's reply it copies the result half the time and otherwise guesses. Its sampled exact-match reward is about
  0.12, and calling the tool and copying what it returns is what reinforcement learning has to add;
- ``builtin:tools-train`` / ``builtin:tools-test``  the questions of that task, "What is A+B?" with A and B
  in 10-49 and every sum (20-98) equally common (:func:`tools_rows`), scored by the ``arith`` reward on the
  episode's final answer.
- ``builtin:tiny-qwen2-vl``, ``builtin:colors-train`` / ``builtin:colors-test``  a tiny Qwen2.5-VL and prompts
  whose answer (a digit) is the colour of their image (:mod:`rlx.plugins.tasks.builtin_vision`).

The warm starts run once, when a model is first written (about 5 s on one core for ``tiny-qwen2``,
about 30 s for ``tiny-qwen2-tools``), and are cached with the rest; delete the cache folder
(:func:`cache_dir`) to write everything again. The tool-use resources have a version of their own
(``TOOLS_VERSION``, a sub-folder of the cache), so changing them leaves the other resources as they are.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

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
TOOLS_RESOURCES = ("tiny-qwen2-tools", "tools-train", "tools-test")
# The vision task (rlx.plugins.tasks.builtin_vision), in a sub-folder of its own version.
VISION_RESOURCES = ("tiny-qwen2-vl", "colors-train", "colors-test")
VISION_VERSION = 1
RESOURCES = ("tiny-qwen2", "arith-train", "arith-test", "arith-pref-train", "arith-pref-test", *TOOLS_RESOURCES,
             *VISION_RESOURCES)
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
    folder = (cache_dir() / f"tools-v{TOOLS_VERSION}" if name in TOOLS_RESOURCES
              else cache_dir() / f"vision-v{VISION_VERSION}" if name in VISION_RESOURCES else cache_dir())
    target = folder / (name if name.startswith("tiny-qwen2") else f"{name}.parquet")
    if not target.exists():
        from rlx.plugins.tasks import builtin_vision

        target.parent.mkdir(parents=True, exist_ok=True)
        writer = (builtin_vision.write_tiny_vl_model if name == "tiny-qwen2-vl"
                  else builtin_vision.write_colors if name.startswith("colors-")
                  else _write_tiny_model if name == "tiny-qwen2"
                  else _write_tools_model if name == "tiny-qwen2-tools"
                  else _write_tools_data if name.startswith("tools-")
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


def _write_model(path: Path, tok, warm_start, heads: int, kv_heads: int) -> None:
    """A 2-layer, 64-wide Qwen2 for ``tok``, initialised from seed 0, given its warm start, saved with ``tok``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=32, max_position_embeddings=256,
        tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id, initializer_range=INIT_STD,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    warm_start(model, tok)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)


def _write_tiny_model(path: Path, _name: str) -> None:
    _write_model(path, build_tokenizer(), format_warm_start, heads=2, kv_heads=1)


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
        losses.append(format_step(optim, model(input_ids=ids).logits, digit_ids, tok.eos_token_id))
    model.eval()
    return losses


def format_step(optim: Any, logits: Any, digit_ids: Any, eos_token_id: int) -> float:
    """One optimizer step of the format warm start on replies of one digit and the end of the turn: the first
    reply token's cross-entropy with every digit equally likely, plus the end token's after it; the loss."""
    import torch

    logp = torch.log_softmax(logits[:, -2:].float(), dim=-1)  # (b, 2, V)
    any_digit = -logp[:, 0, digit_ids].mean()  # cross-entropy with the uniform distribution over digits
    stop = -logp[:, 1, eos_token_id].mean()
    loss = any_digit + stop
    optim.zero_grad()
    loss.backward()
    optim.step()
    return float(loss.detach())


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


# -- Tool use: builtin:tiny-qwen2-tools, builtin:tools-train, builtin:tools-test -------------------------------
# Versioned apart from VERSION (a sub-folder of the cache): changing these leaves the other resources as they are.
TOOLS_VERSION = 1
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Qwen2.5's shape: a tool's reply is a user turn wrapped in <tool_response>; `tools=` is ignored.
TOOLS_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Characters of the tokenizer's base alphabet. The digits are in it but never in the BPE training text,
# so no merge contains a digit: every number is spelled digit by digit, in a question, a tool call or a reply.
TOOLS_ALPHABET = "0123456789+-*/=?.,:#()[]{}\"'_<> \nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
# What the BPE merges are trained on (no digits): the chat roles, the question and the tool call's JSON
# skeleton, so that a call to the calculator is 24 tokens.
TOOLS_BPE_TEXT = ['\n{"name": "calculator", "arguments": {"expression": "+"}}\n', "user\nWhat is +?", "assistant\n"]
TOOLS_OPERANDS = (10, 49)  # A and B; sums 20-98, always two digits
TOOLS_SUMS = (TOOLS_OPERANDS[0] * 2, TOOLS_OPERANDS[1] * 2)
TOOLS_WARM_START_STEPS = 400
TOOLS_WARM_START_BATCH = 32


def _byte_level(text: str) -> list[str]:
    """The characters byte-level BPE uses for the bytes of ``text`` (GPT-2's byte-to-unicode map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in table)})
    return sorted({table[b] for b in text.encode()})


def build_tools_tokenizer():
    """The byte-level BPE tokenizer of ``builtin:tiny-qwen2-tools`` (143 tokens): single-digit tokens, the
    tool call's JSON skeleton merged into a few tokens, the special tokens of :func:`build_tokenizer` and,
    as Qwen2.5 has them, ``<tool_call>``, ``</tool_call>``, ``<tool_response>`` and ``</tool_response>`` as
    added tokens that are not special (``decode(..., skip_special_tokens=True)`` keeps them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=_byte_level(TOOLS_ALPHABET), show_progress=False)
    tok.train_from_iterator(TOOLS_BPE_TEXT, trainer=trainer)  # learns every merge the text has (< 1024)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"], clean_up_tokenization_spaces=False,
    )
    fast.add_tokens(TOOL_TOKENS)
    fast.chat_template = TOOLS_CHAT_TEMPLATE
    return fast


def tool_call_text(expression: str) -> str:
    """An assistant turn that calls the calculator (hermes / Qwen2.5 format), without its end of turn."""
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + expression + '"}}\n</tool_call>'


def tool_turn_text(result: str) -> str:
    """What follows an assistant's ``<|im_end|>`` when a tool replies: the tool's turn and the next prompt."""
    return f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def tools_pair(rng: random.Random, total: int | None = None) -> tuple[int, int]:
    """Operands (A, B) in TOOLS_OPERANDS with the sum ``total``, or a sum drawn uniformly (every sum equally common)."""
    low, high = TOOLS_OPERANDS
    total = rng.randint(*TOOLS_SUMS) if total is None else total
    a = rng.randint(max(low, total - high), min(high, total - low))
    return a, total - a


def tools_episode_ids(tok, a: int, b: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """The token ids of a right episode on "What is a+b?": the prompt, the tool call (ending in <|im_end|>),
    the tool's turn (:func:`tool_turn_text`) and the answer (ending in <|im_end|>)."""
    eos = tok.eos_token_id
    prompt = _question_ids(tok, f"What is {a}+{b}?")
    call = [*tok.encode(tool_call_text(f"{a}+{b}"), add_special_tokens=False), eos]
    turn = tok.encode(tool_turn_text(str(a + b)), add_special_tokens=False)
    answer = [*tok.encode(str(a + b), add_special_tokens=False), eos]
    return prompt, call, turn, answer


def _write_tools_model(path: Path, _name: str) -> None:
    _write_model(path, build_tools_tokenizer(), tools_warm_start, heads=4, kv_heads=4)


def tools_warm_start(model, tok, steps: int = TOOLS_WARM_START_STEPS, lr: float = 3e-3, seed: int = 0) -> list[float]:
    """Teach the episode's format and copying, not when to use them: a short supervised run on episodes of
    "What is A+B?" whose targets are mixtures where the policy has a choice.

    - The first token of the first turn: ``<tool_call>`` with probability 1/2, else a guess's first digit
      (a guess is uniform over 20-99). After ``<tool_call>`` the call is taught token by token, its
      expression copied from the question; after a guess's first digit, any second digit, then the end.
    - After the tool's turn (which holds the true sum S): S's first digit with probability 1/2, else a guess's;
      after S's first digit copied, S's second, after a guess's any digit, then the end.

    Soft labels at the choices make the model's sampling distribution land near those probabilities: it
    calls the tool about half the time and copies the expression when it does (measured: 0.5, 0.93);
    the copy of the result is learnt less far in these steps (sampled, it copies about 1 time in 4, not 2),
    so its expected exact-match reward starts near 0.12. Greedy decoding already calls and copies.
    Returns the loss curve.
    """
    import torch

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    vocab = len(tok)
    digit = torch.tensor(tok.convert_tokens_to_ids([str(d) for d in range(10)]))
    lead = digit[TOOLS_SUMS[0] // 10:]  # a guess's first digit: 2-9
    call_id = tok.convert_tokens_to_ids("<tool_call>")

    def soft(ids: torch.Tensor, weight: float) -> torch.Tensor:  # weight on each of `ids`, as a (vocab,) row
        return torch.zeros(vocab).index_fill_(0, ids, weight)

    first_target = soft(lead, 0.5 / len(lead)) + soft(torch.tensor([call_id]), 0.5)
    any_digit = soft(digit, 0.1)
    any_lead = soft(lead, 1.0 / len(lead))
    episodes = [tools_episode_ids(tok, *tools_pair(rng)) for _ in range(steps * TOOLS_WARM_START_BATCH)]
    p_len, c_len, t_len = (len(x) for x in episodes[0][:3])
    rows = torch.tensor([[t for part in e for t in part] for e in episodes])  # (n, L): all one length
    q = p_len + c_len + t_len  # the answer's first token
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    # Linear decay to 0: the mixtures settle instead of swinging with each batch's draws.
    schedule = torch.optim.lr_scheduler.LambdaLR(optim, lambda i: 1.0 - i / steps)
    losses = []
    model.train()
    for step in range(steps):
        ids = rows[step * TOOLS_WARM_START_BATCH:(step + 1) * TOOLS_WARM_START_BATCH].clone()
        n = len(ids)
        s1, s2 = ids[:, q], ids[:, q + 1]
        copy = torch.rand(n, generator=gen) < 0.5
        guess1 = lead[torch.randint(len(lead), (n,), generator=gen)]
        guess2 = digit[torch.randint(10, (n,), generator=gen)]
        ids[:, q] = torch.where(copy, s1, guess1)
        ids[:, q + 1] = torch.where(copy, s2, guess2)
        # The prompt, a guess, <|im_end|>:
        direct = torch.cat([ids[:, :p_len], guess1[:, None], guess2[:, None], ids[:, -1:]], dim=1)
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)  # (n, L, V)
        logp_direct = torch.log_softmax(model(input_ids=direct).logits[:, p_len:].float(), dim=-1)  # (n, 3, V)

        def hard(lp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # summed over positions, mean over rows
            return -lp.gather(-1, targets[..., None]).squeeze(-1).sum(-1).mean()

        answer_first = 0.5 * torch.nn.functional.one_hot(s1, vocab) + 0.5 * any_lead
        answer_second = torch.where(copy[:, None], torch.nn.functional.one_hot(s2, vocab).float(), any_digit)
        loss = (
            -(logp[:, p_len - 1] * first_target).sum(-1).mean()
            + hard(logp[:, p_len:p_len + c_len - 1], ids[:, p_len + 1:p_len + c_len])  # the call, then <|im_end|>
            - (logp[:, q - 1] * answer_first).sum(-1).mean()
            - (logp[:, q] * answer_second).sum(-1).mean()
            + hard(logp[:, q + 1:q + 2], ids[:, q + 2:q + 3])  # <|im_end|> after the answer
            - (logp_direct[:, 0] * any_digit).sum(-1).mean()  # a guess's second digit
            + hard(logp_direct[:, 1:2], direct[:, -1:])  # <|im_end|> after a guess
        )
        optim.zero_grad()
        loss.backward()
        optim.step()
        schedule.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def tools_rows(split: str, count: int, seed: int) -> list[dict]:
    """Prompts "What is A+B?" with A, B in 10-49, in the verl row shape, for the tool-use task.

    The sum is drawn uniformly from 20-98 (the test split takes each in turn) and then a pair that makes
    it, so a policy that answers without the tool gains nothing from favouring one number.
    """
    rng = random.Random(seed)
    low, high = TOOLS_SUMS
    rows = []
    for i in range(count):
        a, b = tools_pair(rng, None if split == "train" else low + i % (high - low + 1))
        rows.append({
            "prompt": [{"role": "user", "content": f"What is {a}+{b}?"}],
            "data_source": "rlx/tools",
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": i, "a": a, "b": b},
        })
    return rows


def _write_tools_data(path: Path, name: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    split = name.split("-")[1]
    rows = tools_rows(split, 2048 if split == "train" else 100, seed=4 if split == "train" else 5)
    pq.write_table(pa.Table.from_pylist(rows), path)
