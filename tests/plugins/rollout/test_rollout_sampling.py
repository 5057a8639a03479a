"""Every sampling option of the ``hf`` rollout engine against the distribution it must produce
(the checks are the engine contract's, ``rlx.plugins.testing``).

The policy is the built-in tiny model's architecture with larger random weights, so that its
next-token distributions are far from uniform and differ between prompts; its exact next-token
logits come from a plain forward pass. Each case draws thousands of one-token samples (one batched
prefill, so a case takes well under a second).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlx.batch import Batch
from rlx.plugins.rollout.hf import HFRollout, HFRolloutOptions
from rlx.plugins.testing import (
    assert_distinguishable,
    check_first_token_distribution,
    check_greedy,
    check_stops_and_length,
    next_token_logits,
    options_changed,
    pick_top_p,
    processed_distribution,
)
from rlx.protocols import SamplingParams
from rlx.run.data import PromptExample, collate

SAMPLES = 4000  # per prompt: the 5-sigma bound is then at most 0.04 and typically 0.02


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """The tiny model runs on one thread."""


@pytest.fixture(scope="module")
def policy(tiny_model_path, tmp_path_factory):
    """A model folder with peaked, prompt-dependent next-token distributions, and its tokenizer."""
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    torch.manual_seed(1234)
    model = type(base)(base.config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("peaked_model")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder), tok


def make_engine(policy, eos: list[int] | None = None) -> HFRollout:
    folder, tok = policy
    return HFRollout(folder, HFRolloutOptions(micro_batch_size=8192), "cpu", eos or [tok.eos_token_id],
                     tok.pad_token_id)


@pytest.fixture(scope="module")
def engine(policy) -> HFRollout:
    return make_engine(policy)


@pytest.fixture(scope="module")
def prompts(policy) -> Batch:
    """Two short token sequences of different lengths (the shorter one left-padded): prefilling
    thousands of copies stays cheap."""
    tok = policy[1]
    ids = [[11, 23, 37, 5], [42, 17]]
    return collate([PromptExample(x, tok.decode(x), "s", str(i), {}) for i, x in enumerate(ids)], tok.pad_token_id)


@pytest.fixture(scope="module")
def logits(engine, prompts) -> torch.Tensor:
    out = next_token_logits(engine.model, prompts)
    assert out.argmax(-1)[0] != out.argmax(-1)[1], "the prompts' distributions differ (rows cannot be swapped)"
    return out


CASES = {
    "plain": SamplingParams(n=SAMPLES),
    "cold": SamplingParams(n=SAMPLES, temperature=0.6),
    "hot": SamplingParams(n=SAMPLES, temperature=1.6),
    "top_p": SamplingParams(n=SAMPLES, top_p=0.5),
    "top_p_cold": SamplingParams(n=SAMPLES, temperature=0.7, top_p=0.8),
    "top_k": SamplingParams(n=SAMPLES, top_k=5),
    "top_k_top_p_hot": SamplingParams(n=SAMPLES, temperature=1.3, top_k=5, top_p=0.7),
}


def resolve(case: str, logits: torch.Tensor) -> SamplingParams:
    """The case's parameters with top_p moved to a clean, telling value (``rlx.plugins.testing.pick_top_p``)."""
    return pick_top_p(logits, CASES[case])


@pytest.mark.parametrize("case", list(CASES))
def test_sampling_options_give_the_processed_distribution(engine, prompts, logits, case):
    params = resolve(case, logits)
    check_first_token_distribution(engine, prompts, logits, params, seed=7)


@pytest.mark.parametrize("case", [c for c in CASES if c != "plain"])
def test_each_case_tells_a_missing_option_apart(logits, case):
    """Dropping any one option of a case gives a distribution the sampling check rejects: the cases
    above would fail if the engine ignored temperature, top_k or top_p."""
    params = resolve(case, logits)
    for option in options_changed(params):
        ignored = dataclasses.replace(params, **{option: getattr(SamplingParams(), option)})
        assert_distinguishable(processed_distribution(logits, params),
                               processed_distribution(logits, ignored, strict=False), params.n)


def test_top_p_excludes_the_tail(logits):
    """The nucleus cut leaves out tokens worth a real share of the mass, so a sampler that ignores it
    draws hundreds of excluded tokens in the sampling test."""
    params = resolve("top_p", logits)
    kept = processed_distribution(logits, params) > 0
    tail = torch.softmax(logits, -1)[~kept].sum() / logits.shape[0]
    assert 0.3 < float(tail) < 0.7
    assert int(kept.sum(-1).min()) >= 3


def test_greedy_takes_the_arg_max_whatever_the_options(engine, prompts, logits):
    check_greedy(engine, prompts, logits)


def test_stop_token_ids_end_responses(engine, prompts, logits, policy):
    stop = {int(logits[0].argmax()), int(logits[1].argmax())}  # likely first tokens: many rows stop at once
    params = SamplingParams(n=1000, max_tokens=5, stop_token_ids=tuple(sorted(stop)))
    out = check_stops_and_length(engine, prompts, logits, params, stop | {policy[1].eos_token_id})
    lengths = out["response_mask"].sum(-1)
    assert int((lengths == 1).sum()) > 100 and int((lengths == 5).sum()) > 100


def test_engine_eos_ends_responses(policy, prompts, logits):
    """The engine's own EOS ids stop a response as ``stop_token_ids`` do."""
    tok = policy[1]
    eos = int(logits[0].argmax())
    engine = make_engine(policy, eos=[tok.eos_token_id, eos])
    out = check_stops_and_length(engine, prompts, logits, SamplingParams(n=1000, max_tokens=4),
                                 {tok.eos_token_id, eos})
    assert int((out["response_mask"].sum(-1) == 1).sum()) > 50


@pytest.mark.parametrize("max_tokens", [1, 3, 7])
def test_max_tokens_cuts_responses(engine, prompts, logits, max_tokens, policy):
    out = check_stops_and_length(engine, prompts, logits, SamplingParams(n=200, max_tokens=max_tokens),
                                 {policy[1].eos_token_id})
    assert out["responses"].shape[1] == max_tokens  # with 400 rows, some run to the limit
