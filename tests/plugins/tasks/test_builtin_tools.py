"""The built-in tool-use resources (issue 28): builtin:tiny-qwen2-tools (tokenizer, chat template, warm start),
builtin:tools-train / builtin:tools-test, and the arith reward on multi-turn episodes."""

from __future__ import annotations

import random
from collections import Counter

import pyarrow.parquet as pq
import pytest

from rlx.plugins.rewards.arith import ArithOptions, build
from rlx.plugins.tasks import builtin
from rlx.protocols import RewardBatch


@pytest.fixture(scope="module")
def tok():
    return builtin.build_tools_tokenizer()


@pytest.fixture(scope="module")
def tools_model(rlx_cache):
    """The model folder written once (warm start included) into the session's cache."""
    return builtin.resolve("builtin:tiny-qwen2-tools")


def test_digits_are_single_tokens_and_tool_tokens_are_added_not_special(tok):
    vocab = tok.get_vocab()
    assert not [t for t in vocab if any(c.isdigit() for c in t) and len(t) > 1]
    for text in ("What is 47+38?", "1234567890", tool_call_text("99+10")):
        digits = [t for t in tok.convert_ids_to_tokens(tok.encode(text)) if any(c.isdigit() for c in t)]
        assert digits == [c for c in text if c.isdigit()]
    for t in builtin.TOOL_TOKENS:
        assert len(tok.encode(t)) == 1 and t not in tok.all_special_tokens
    ids = tok.encode(tool_call_text("47+38") + "<|im_end|>")
    assert len(ids) == 25  # 24 for the call (its JSON skeleton merged), then <|im_end|>
    assert tok.decode(ids, skip_special_tokens=True) == tool_call_text("47+38")
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|pad|>")


def tool_call_text(expression: str) -> str:
    return builtin.tool_call_text(expression)


def conversation(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {a}+{b}?"},
            {"role": "assistant", "content": tool_call_text(f"{a}+{b}")},
            {"role": "tool", "name": "calculator", "content": str(a + b)},
            {"role": "assistant", "content": str(a + b)}]


def test_template_renders_a_tool_turn_as_qwen25_does(tok):
    text = tok.apply_chat_template(conversation(47, 38)[2:3], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n<tool_response>\n85\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert "\n" + text == builtin.tool_turn_text("85")
    full = tok.apply_chat_template(conversation(47, 38), tokenize=False)
    assert full.startswith("<|im_start|>user\nWhat is 47+38?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n")


@pytest.mark.parametrize("pair", [(47, 38), (10, 10), (49, 49), (12, 30)])
def test_whole_conversation_tokenizes_as_its_pieces(tok, pair):
    prompt, call, turn, answer = builtin.tools_episode_ids(tok, *pair)
    full = tok.apply_chat_template(conversation(*pair), tokenize=False)
    assert tok.encode(full) == prompt + call + turn + answer + tok.encode("\n")
    assert call[-1] == answer[-1] == tok.eos_token_id
    assert tok.decode(turn) == builtin.tool_turn_text(str(sum(pair)))


@pytest.mark.parametrize("split, count", [("train", 2048), ("test", 100)])
def test_data_rows_shape_and_balance(rlx_cache, split, count):
    rows = pq.read_table(builtin.resolve(f"builtin:tools-{split}")).to_pylist()
    assert len(rows) == count
    for row in rows:
        a, b = row["extra_info"]["a"], row["extra_info"]["b"]
        assert 10 <= a <= 49 and 10 <= b <= 49
        assert row["prompt"] == [{"role": "user", "content": f"What is {a}+{b}?"}]
        assert (row["data_source"], row["ability"]) == ("rlx/tools", "math")
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(a + b)}
    sums = Counter(int(r["reward_model"]["ground_truth"]) for r in rows)
    assert set(sums) <= set(range(20, 99))
    if split == "train":
        assert len(sums) == 79 and max(sums.values()) < 3 * count / 79  # uniform over the sums, not triangular
    else:
        assert len(sums) == 79


def sample(model, ids, max_new: int, eos: int, seed: int, greedy: bool = False) -> list[list[int]]:
    """Temperature-1 sampling (or greedy) of equal-length prompts, each row cut after its first ``eos``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(input_ids=ids).logits[:, -1].float()
            nxt = logits.argmax(-1) if greedy else torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]
            out.append(nxt)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
    rows = torch.stack(out, 1).tolist()
    return [r[:r.index(eos) + 1] if eos in r else r for r in rows]


def behaviour(model, tok, n: int, greedy: bool) -> dict[str, float]:
    import torch

    rng = random.Random(7)
    episodes = [builtin.tools_episode_ids(tok, *builtin.tools_pair(rng)) for _ in range(n)]
    eos = tok.eos_token_id
    first = sample(model, torch.tensor([e[0] for e in episodes]), len(episodes[0][1]) + 2, eos, 0, greedy)
    calls = [tok.decode(f, skip_special_tokens=True).startswith("<tool_call>") for f in first]
    exact = [i for i, (f, e) in enumerate(zip(first, episodes)) if f == e[1]]
    contexts = torch.tensor([[t for part in episodes[i][:3] for t in part] for i in exact])  # through the tool turn
    answers = sample(model, contexts, 4, eos, 1, greedy)
    copied = sum(a == episodes[i][3] for a, i in zip(answers, exact))
    return {"call": sum(calls) / n, "exact": len(exact) / max(1, sum(calls)), "copy": copied / max(1, len(exact))}


def test_warm_started_model_calls_half_the_time_and_copies(tools_model, one_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tools_model)
    model = AutoModelForCausalLM.from_pretrained(tools_model).eval()
    text = tok.apply_chat_template(conversation(47, 38), tokenize=False)
    assert tok.encode(text) == builtin.build_tools_tokenizer().encode(text)
    sampled = behaviour(model, tok, 200, greedy=False)
    assert 0.35 <= sampled["call"] <= 0.65, sampled  # measured 0.51
    assert sampled["exact"] >= 0.8, sampled  # measured 0.93: the expression copied from the question
    assert 0.08 <= sampled["copy"] <= 0.6, sampled  # measured 0.25: the result copied, RL must raise it
    greedy = behaviour(model, tok, 50, greedy=True)
    assert greedy == {"call": 1.0, "exact": 1.0, "copy": 1.0}, greedy


def test_arith_reward_scores_the_final_answer_of_an_episode():
    call = tool_call_text("47+38")
    turns = [
        [{"role": "assistant", "content": call}, {"role": "tool", "name": "calculator", "content": "85"},
         {"role": "assistant", "content": "85"}],
        [{"role": "assistant", "content": call}, {"role": "tool", "name": "calculator", "content": "85"},
         {"role": "assistant", "content": "84"}],
        [{"role": "assistant", "content": call}, {"role": "tool", "name": "calculator", "content": "85"}],
        [{"role": "assistant", "content": "85"}],
        [],  # single-turn: the response itself
    ]
    transcripts = [call + "\n85\n85", call + "\n85\n84", call + "\n85", "85", "85"]
    batch = RewardBatch(["What is 47+38?"] * 5, transcripts, ["85"] * 5, ["rlx/tools"] * 5, [{}] * 5, messages=turns)
    out = build(ArithOptions(), None)(batch)
    assert out.scores == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert out.extra["arith/correct"] == [1.0, 0.0, 0.0, 1.0, 1.0]
