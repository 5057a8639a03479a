"""The reward-model reward: a tiny Qwen2 sequence-classification model written here with random weights,
loaded through the same from_pretrained path as a real one; and a mixture with a rule reward trained
end to end through `rlx train`."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlx.errors import UserError
from rlx.plugins.loggers.jsonl import read_metrics
from rlx.plugins.modeling.reward_model import PromptUnwrapper, RewardModelOptions, RewardModelScorer
from rlx.plugins.tasks.builtin import build_tokenizer, resolve
from rlx.protocols import RewardBatch

RM_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")


def write_tiny_reward_model(path: Path, *, num_labels: int = 1, chat_template: str | None = RM_TEMPLATE) -> Path:
    """A 2-layer Qwen2ForSequenceClassification with random weights and the built-in tiny tokenizer."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok = build_tokenizer()
    if chat_template is not None:
        tok.chat_template = chat_template
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                         num_labels=num_labels, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory) -> Path:
    return write_tiny_reward_model(tmp_path_factory.mktemp("tiny-rm") / "rm")


@pytest.fixture(scope="module")
def policy_tok():
    return build_tokenizer()  # the built-in chat template: <|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n


def batch(policy_tok, questions: list[str], responses: list[str]) -> RewardBatch:
    prompts = [policy_tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                              tokenize=False) for q in questions]
    n = len(responses)
    return RewardBatch(prompts, responses, [""] * n, ["s"] * n, [{}] * n, [len(r) for r in responses])


QUESTIONS = ["What is 3+4?", "What is 1+1?", "What is 9+0?", "What is 2+5?", "What is 0+0?"]
RESPONSES = ["7", "2 is the sum of one and one", "9.", "it is seven", "0"]


def test_prompt_unwrapper_recovers_the_user_message(policy_tok):
    unwrap = PromptUnwrapper(policy_tok)
    prompt = policy_tok.apply_chat_template([{"role": "user", "content": "What is 3+4?"}],
                                            add_generation_prompt=True, tokenize=False)
    assert unwrap(prompt) == "What is 3+4?"
    assert unwrap("not templated") == "not templated"
    assert PromptUnwrapper(None)("x") == "x"


def test_scores_are_the_raw_logit_of_the_rm_conversation(rm_path, policy_tok):
    scorer = RewardModelScorer(RewardModelOptions(path=str(rm_path), batch_size=2), policy_tok)
    out = scorer(batch(policy_tok, QUESTIONS, RESPONSES))
    # The reward model sees its own template, with the question unwrapped from the policy's prompt.
    text = scorer.conversation(batch(policy_tok, QUESTIONS[:1], RESPONSES[:1]).prompts[0], RESPONSES[0])
    assert text == "user: What is 3+4?\nassistant: 7\n"
    ids = scorer.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        direct = scorer.model(input_ids=ids).logits[0, 0].item()
    assert out.scores[0] == pytest.approx(direct, abs=1e-5)
    assert out.extra["reward_model/logit"] == out.scores
    assert len(set(out.scores)) == len(out.scores)  # a real model: different inputs, different scores


def test_batching_and_padding_do_not_change_scores(rm_path, policy_tok):
    b = batch(policy_tok, QUESTIONS, RESPONSES)
    batched = RewardModelScorer(RewardModelOptions(path=str(rm_path), batch_size=8), policy_tok)(b).scores
    one_by_one = RewardModelScorer(RewardModelOptions(path=str(rm_path), batch_size=1), policy_tok)(b).scores
    assert batched == pytest.approx(one_by_one, abs=1e-5)


def test_transform_scale_shift_and_truncation(rm_path, policy_tok):
    b = batch(policy_tok, QUESTIONS, RESPONSES)
    raw = RewardModelScorer(RewardModelOptions(path=str(rm_path)), policy_tok)(b).scores
    squashed = RewardModelScorer(RewardModelOptions(path=str(rm_path), transform="sigmoid", scale=2.0, shift=-1.0),
                                 policy_tok)(b)
    assert squashed.scores == pytest.approx([2.0 / (1.0 + math.exp(-x)) - 1.0 for x in raw], abs=1e-6)
    assert squashed.extra["reward_model/logit"] == pytest.approx(raw, abs=1e-6)
    short = RewardModelScorer(RewardModelOptions(path=str(rm_path), max_length=4), policy_tok)
    long_response = "x" * 200
    text = short.conversation(b.prompts[0], long_response)
    enc = short.tokenizer([text], truncation=True, max_length=4, add_special_tokens=False)["input_ids"][0]
    assert len(enc) == 4 and short.tokenizer.decode(enc).endswith("x\n")  # the end of the response is kept


def test_its_own_chat_template_option(rm_path, policy_tok):
    scorer = RewardModelScorer(RewardModelOptions(
        path=str(rm_path), chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}"), policy_tok)
    assert scorer.conversation(batch(policy_tok, ["Q?"], ["A"]).prompts[0], "A") == "[Q?][A]"


def test_load_errors_are_user_errors(tmp_path, rm_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"reward\.path: the folder .* is empty"):
        RewardModelScorer(RewardModelOptions(path=str(tmp_path / "empty")))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "qwen2"}')
    (tmp_path / "broken" / "tokenizer.json").write_text("{}")
    with pytest.raises(UserError, match=r"reward\.path: the folder .* has no weights"):
        RewardModelScorer(RewardModelOptions(path=str(tmp_path / "broken")))
    two = write_tiny_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(UserError, match="has 2 outputs"):
        RewardModelScorer(RewardModelOptions(path=str(two)))
    with pytest.raises(UserError, match="no trained reward head"):  # a policy model is not a reward model
        RewardModelScorer(RewardModelOptions(path=resolve("builtin:tiny-qwen2")))
    with pytest.raises(ValueError, match="no such folder"):
        RewardModelOptions(path=str(tmp_path / "missing"))
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA device"):
            RewardModelScorer(RewardModelOptions(path=str(rm_path), device="cuda"))


@pytest.mark.slow
def test_mix_of_rule_and_reward_model_trains_end_to_end(tmp_path, rm_path):
    """0.7 arith + 0.3 reward model, 2 GRPO steps on the CPU, validation with n=2 at the end."""
    run_dir = tmp_path / "run"
    components = (f"reward.components=[{{name: arith, weight: 0.7}}, "
                  f"{{name: reward_model, weight: 0.3, options: {{path: '{rm_path}', batch_size: 32}}}}]")
    proc = subprocess.run(
        [sys.executable, "-m", "rlx", "train", "--preset", "tiny", "reward.name=mix", components,
         "trainer.total_steps=2", "trainer.test_freq=2", "trainer.val_before_train=false", "rollout.val_n=2",
         "rollout.val_temperature=1.0",
         "data.val_batch_size=64", "trainer.loggers=[jsonl]", "trainer.save_hf_model=false", "trainer.save_freq=0",
         f"trainer.output_dir={run_dir}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        arith, rm = r["reward/arith/score"], r["reward/reward_model/score"]
        assert r["reward/mean"] == pytest.approx(0.7 * arith + 0.3 * rm, abs=1e-4)
        assert r["reward/reward_model/logit"] == pytest.approx(rm, abs=1e-6)
        assert r["reward/failed"] == 0.0
    last = rows[-1]
    for key in ("val/acc", "val/mean@2", "val/pass@1", "val/pass@2", "val/maj@2", "val/reward/mean",
                "val/rlx/arith/acc", "val/rlx/arith/pass@2", "val/rlx/arith/maj@2"):
        assert key in last, key
    assert last["val/pass@1"] <= last["val/pass@2"]
    assert last["val/pass@1"] == pytest.approx(last["val/acc"])
