"""The ``hf`` rollout engine on the built-in tiny Qwen2: batch layout, stop handling, greedy decoding,
log-probs consistent with the training forward pass, and weight updates."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlx.batch import Batch
from rlx.plugins.modeling.head import response_log_probs
from rlx.plugins.rollout.hf import HFRollout, HFRolloutOptions
from rlx.protocols import SamplingParams
from rlx.run.data import PromptExample, collate

TEXTS = ["What is 3+4?", "hi", "What is the sum 1+2+3+4+5, then minus 6?"]


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    return tiny_model_path, AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs the tiny model on one thread."""


@pytest.fixture(scope="module")
def tok(tiny):
    return tiny[1]


@pytest.fixture(scope="module")
def prompts(tok) -> Batch:
    examples = []
    for i, text in enumerate(TEXTS):
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False)
        ids = tok(chat, add_special_tokens=False)["input_ids"]
        examples.append(PromptExample(ids, chat, f"source{i}", str(i), {"index": i}))
    assert len({len(e.input_ids) for e in examples}) == len(examples)  # every prompt a different length
    return collate(examples, tok.pad_token_id)


def make_rollout(tiny, micro_batch_size: int = 4) -> HFRollout:
    path, tok = tiny
    return HFRollout(path, HFRolloutOptions(micro_batch_size=micro_batch_size), "cpu", [tok.eos_token_id],
                     tok.pad_token_id)


@pytest.fixture(scope="module")
def rollout(tiny) -> HFRollout:
    # micro_batch_size=4 with 3 prompts x n=3 gives chunks of 4, 4 and 1 rows.
    return make_rollout(tiny)


@pytest.fixture(scope="module")
def other(tiny, tmp_path_factory):
    """The tiny model's architecture with other, larger random weights (whose greedy decodes vary with
    the prompt, unlike the built-in model's), in memory and saved as its own model folder."""
    path, tok = tiny
    base = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(1234)
    model = type(base)(base.config).eval()
    with torch.no_grad():  # biases start at 0 and norms at 1: move every tensor away from the base model
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    for name, tensor in base.state_dict().items():
        assert not torch.equal(tensor, model.state_dict()[name]), name
    folder = tmp_path_factory.mktemp("other_model")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model, str(folder)


@pytest.fixture(scope="module")
def engines(tiny, other, rollout):
    """Rollout engines on the built-in model and on the other model."""
    return {"builtin": rollout, "other": make_rollout((other[1], tiny[1]))}


def generate(engine: HFRollout, prompts: Batch, seed: int = 0, **params) -> Batch:
    torch.manual_seed(seed)
    return engine.generate(prompts, SamplingParams(**params))


def unpadded_prompts(prompts: Batch) -> list[list[int]]:
    return [ids[m.bool()].tolist() for ids, m in zip(prompts["input_ids"], prompts["attention_mask"])]


def manual_greedy(model, prompt_ids: list[int], max_tokens: int, stop: set[int]) -> list[int]:
    """Greedy decoding by full forward passes on one unpadded sequence (no KV cache, no padding)."""
    seq, out = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(max_tokens):
            token = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
            out.append(token)
            seq.append(token)
            if token in stop:
                break
    return out


def assert_matches_decodes(out: Batch, expected: list[list[int]], pad_token_id: int) -> None:
    """Each row's response is ``expected[row]``, then padding with a zero mask."""
    assert out["responses"].shape[1] == max(len(e) for e in expected)
    for row, want in enumerate(expected):
        k = len(want)
        assert out["responses"][row, :k].tolist() == want, row
        assert out["response_mask"][row, :k].tolist() == [1] * k, row
        assert (out["response_mask"][row, k:] == 0).all(), row
        assert (out["responses"][row, k:] == pad_token_id).all(), row


# ---------------------------------------------------------------------------------------------
def test_output_layout(rollout, prompts, tok):
    n, max_tokens = 3, 6
    out = generate(rollout, prompts, n=n, max_tokens=max_tokens)
    B, P = prompts["input_ids"].shape
    assert len(out) == B * n
    R = out["responses"].shape[1]
    assert max_tokens >= R
    for key, width in [("prompts", P), ("prompt_mask", P), ("responses", R), ("response_mask", R),
                       ("rollout_log_probs", R)]:
        assert out[key].shape == (B * n, width), key
    assert out["responses"].dtype == torch.long and out["rollout_log_probs"].dtype == torch.float32
    # Each prompt's n samples are adjacent, the prompts left-padded exactly as given.
    assert torch.equal(out["prompts"], prompts["input_ids"].repeat_interleave(n, dim=0))
    assert torch.equal(out["prompt_mask"], prompts["attention_mask"].repeat_interleave(n, dim=0))
    for key, values in prompts.non_tensors.items():
        assert out[key] == [v for v in values for _ in range(n)], key
    assert (out["response_mask"].sum(-1) <= max_tokens).all()
    assert torch.isfinite(out["rollout_log_probs"]).all() and (out["rollout_log_probs"] <= 0).all()


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_max_tokens_respected(engines, prompts, max_tokens):
    # the random-weight model: it rarely samples EOS, so responses run to the limit (the built-in
    # model is warm-started to answer with one digit and stop)
    out = generate(engines["other"], prompts, n=2, max_tokens=max_tokens)
    assert out["responses"].shape == (6, max_tokens)
    assert (out["response_mask"].sum(-1) <= max_tokens).all()


def test_response_ends_at_first_stop_token(tiny, other, prompts, tok):
    """The mask is 1 up to and including the first stop token, 0 after; later tokens are padding.

    The stop token is picked from an unstopped run so that some responses must end early. One chunk
    holds every row: generate samples every row at every step until all are done, so the stopped
    run draws the same tokens as the free run up to each row's stop.
    """
    engine = make_rollout((other[1], tok), micro_batch_size=64)  # a model whose responses run long
    max_tokens = 10
    free = generate(engine, prompts, seed=3, n=3, max_tokens=max_tokens, temperature=1.5)
    free_rows = [row[:k] for row, k in zip(free["responses"].tolist(), free["response_mask"].sum(-1).tolist())]
    first_long = next(row for row in free_rows if len(row) == max_tokens)
    stop = first_long[2]
    stopped = generate(engine, prompts, seed=3, n=3, max_tokens=max_tokens, temperature=1.5, stop_token_ids=(stop,))

    # each row as in the free run (which may have ended at EOS), cut after its first `stop`
    expected = [row[:row.index(stop) + 1] if stop in row else row for row in free_rows]
    assert min(len(e) for e in expected) <= 3 and len({len(e) for e in expected}) > 1  # ends at different places
    assert_matches_decodes(stopped, expected, tok.pad_token_id)
    lp, mask = stopped["rollout_log_probs"], stopped["response_mask"].bool()
    assert (lp[~mask] == 0).all() and (lp[mask] < 0).all()
    # The same through the engine's own EOS list.
    engine.eos_token_ids = [tok.eos_token_id, stop]
    via_eos = generate(engine, prompts, seed=3, n=3, max_tokens=max_tokens, temperature=1.5)
    assert_matches_decodes(via_eos, expected, tok.pad_token_id)


@pytest.mark.parametrize("model", ["builtin", "other"])
def test_greedy_is_deterministic_and_matches_manual_decode(engines, model, prompts, tok):
    engine = engines[model]
    params = {"n": 2, "max_tokens": 6, "greedy": True, "temperature": 0.3}  # greedy ignores temperature
    a = generate(engine, prompts, seed=0, **params)
    b = generate(engine, prompts, seed=1, **params)
    for key in ("responses", "response_mask", "rollout_log_probs"):
        assert torch.equal(a[key], b[key]), key
    expected = [manual_greedy(engine.model, ids, 6, {tok.eos_token_id}) for ids in unpadded_prompts(prompts)]
    assert_matches_decodes(a, [e for e in expected for _ in range(2)], tok.pad_token_id)


@pytest.mark.parametrize("model", ["builtin", "other"])
def test_top_k_one_equals_greedy(engines, model, prompts):
    engine = engines[model]
    greedy = generate(engine, prompts, n=2, max_tokens=6, greedy=True)
    top1 = generate(engine, prompts, seed=5, n=2, max_tokens=6, top_k=1, temperature=1.3)
    assert torch.equal(top1["responses"], greedy["responses"])
    assert torch.equal(top1["response_mask"], greedy["response_mask"])
    # After top-k=1 the sampling distribution is a point mass: every log-prob is 0.
    assert torch.allclose(top1["rollout_log_probs"], torch.zeros_like(top1["rollout_log_probs"]))


@pytest.mark.parametrize("model", ["builtin", "other"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_log_probs_match_training_forward(engines, model, prompts, temperature):
    """The sampler's log-probs equal a padded training forward pass (position ids from the mask)."""
    engine = engines[model]
    stop = (5, 17, 33, 40, 48)  # a few stop ids so that responses have different lengths
    out = generate(engine, prompts, seed=11, n=3, max_tokens=12, temperature=temperature, stop_token_ids=stop)
    with torch.no_grad():
        lp, _ = response_log_probs(engine.model, out, temperature, with_entropy=False)
    mask = out["response_mask"].bool()
    torch.testing.assert_close(lp[mask], out["rollout_log_probs"][mask], atol=1e-4, rtol=0)


def test_update_weights_switches_policy(tiny, prompts, tok, other):
    engine = make_rollout(tiny)
    other = other[0]
    stops = {tok.eos_token_id}
    before = generate(engine, prompts, max_tokens=8, greedy=True)
    want = [manual_greedy(other, ids, 8, stops) for ids in unpadded_prompts(prompts)]
    assert before["responses"].tolist() != want  # the two models disagree, so the test can tell them apart

    engine.update_weights(other.state_dict().items())
    assert engine.weight_version == 1
    for name, tensor in other.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], tensor), name
    after = generate(engine, prompts, max_tokens=8, greedy=True)
    assert_matches_decodes(after, want, tok.pad_token_id)
    # The log-probs it reports now are the new model's.
    sampled = generate(engine, prompts, seed=2, n=2, max_tokens=8, temperature=0.7)
    with torch.no_grad():
        lp, _ = response_log_probs(other, sampled, 0.7, with_entropy=False)
    mask = sampled["response_mask"].bool()
    torch.testing.assert_close(lp[mask], sampled["rollout_log_probs"][mask], atol=1e-4, rtol=0)


def test_update_weights_accepts_tied_name_once(tiny):
    engine = make_rollout(tiny)
    state = AutoModelForCausalLM.from_pretrained(tiny[0]).state_dict()
    state.pop("lm_head.weight", None)  # tied to the embedding: sending one of the two is enough
    engine.update_weights(state.items())
    assert engine.weight_version == 1


def test_update_weights_missing_tensor_raises(tiny):
    engine = make_rollout(tiny)
    state = AutoModelForCausalLM.from_pretrained(tiny[0]).state_dict()
    del state["model.norm.weight"]
    with pytest.raises(RuntimeError, match=r"model\.norm\.weight"):
        engine.update_weights(state.items())
    assert engine.weight_version == 0
    with pytest.raises(RuntimeError):
        engine.update_weights([])


def test_model_folder_sampling_defaults_are_ignored(other, prompts, tok, tmp_path):
    """A generation_config.json with sampling defaults (as instruct models ship) must not change what is
    sampled: only SamplingParams count, or rollout log-probs would not be the actor's."""
    folder = tmp_path / "model"
    shutil.copytree(other[1], folder)
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(do_sample=True, repetition_penalty=3.0, temperature=0.1, top_k=2, top_p=0.5, max_new_tokens=2)
    (folder / "generation_config.json").write_text(json.dumps(config))
    engine = make_rollout((str(folder), tok))
    greedy = generate(engine, prompts, max_tokens=6, greedy=True)
    want = [manual_greedy(engine.model, ids, 6, {tok.eos_token_id}) for ids in unpadded_prompts(prompts)]
    assert_matches_decodes(greedy, want, tok.pad_token_id)
    out = generate(engine, prompts, seed=4, n=2, max_tokens=6, temperature=0.7)
    assert out["responses"].shape[1] == 6
    with torch.no_grad():
        lp, _ = response_log_probs(engine.model, out, 0.7, with_entropy=False)
    mask = out["response_mask"].bool()
    torch.testing.assert_close(lp[mask], out["rollout_log_probs"][mask], atol=1e-4, rtol=0)
