"""The rollout-engine contract: what every engine plugin (``hf``, ``vllm``, ``sglang`` or a third party's) must
do, as checks and as one pytest class to subclass.

A plugin runs the whole contract with one import and one method::

    # tests/test_my_engine.py
    from rlx.plugins.testing import RolloutEngineContract

    class TestMyEngine(RolloutEngineContract):
        def make_engine(self, model_path, tokenizer):
            return MyEngine(model_path, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)

The class builds its own policies (the built-in tiny Qwen2's architecture, head_dim 32, with larger random
weights so that next-token distributions are peaked and differ between prompts; the end-of-sequence token is
made likely so that responses end at different places), builds one engine on the first and runs these checks
against the training backend's forward pass (``rlx.plugins.modeling.head.response_log_probs``):

- layout: ``B*n`` rows, each prompt's ``n`` samples adjacent, prompts and masks as given, non-tensor columns
  repeated, responses right-padded with mask 0, finite log-probs <= 0 and 0 at padding;
- sampling: temperature, top-k and top-p (applied in that order, as Hugging Face, vLLM and SGLang do) give
  the processed, renormalised distribution: thousands of one-token samples per prompt are compared with it
  token by token (five binomial standard deviations), and excluded tokens never appear;
- greedy decoding takes the arg-max whatever the options, is deterministic and equals a decode by full
  forward passes; the same seed gives the same samples, another seed other samples;
- a response ends at (and includes) its first EOS or ``stop_token_ids`` token and is cut at ``max_tokens``;
- ``rollout_log_probs`` equal the training forward pass's log-probs of the sampled tokens at the sampling
  temperature within ``logprob_atol`` (1e-4 by default: float32 on the CPU; an engine computing in another
  precision sets its own and says so), and are the log of the processed probability for top-k / top-p;
- ``update_weights`` with a generator of ``(name, tensor)`` pairs (the tied ``lm_head.weight`` left out, a new
  buffer per bucket, as ``rlx.plugins.launchers.weight_sync`` sends them) switches the policy visibly, and ``sleep``
  then
  ``wake_up`` keep the weights the engine holds (not the ones it was started with).

The statistical checks cannot flake: the seed is fixed (through ``torch.manual_seed`` and
``SamplingParams.seed``), and a correct engine passes the five-sigma bound with any seed but for a ~1e-5
chance, while :func:`assert_distinguishable` makes sure a wrong distribution (an option ignored) is far
outside it.

This module imports torch, transformers and pytest: it is for tests only (``import rlx`` does not load it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlx.batch import Batch
from rlx.protocols import SamplingParams

__all__ = [
    "RolloutEngineContract",
    "assert_distinguishable",
    "check_first_token_distribution",
    "check_greedy",
    "check_stops_and_length",
    "frequency_bound",
    "make_peaked_model",
    "manual_greedy",
    "next_token_logits",
    "options_changed",
    "pick_top_p",
    "processed_distribution",
]


# ---------------------------------------------------------------------------------------------------------
# Distributions
def next_token_logits(model: Any, prompts: Batch) -> torch.Tensor:
    """(B, V) float32 logits of the first response token, from one unpadded forward pass per prompt."""
    rows = []
    with torch.no_grad():
        for ids, mask in zip(prompts["input_ids"], prompts["attention_mask"]):
            seq = ids[mask.bool()].unsqueeze(0).to(model.device)
            rows.append(model(input_ids=seq).logits[0, -1].float().cpu())
    return torch.stack(rows)


def processed_distribution(logits: torch.Tensor, params: SamplingParams, strict: bool = True) -> torch.Tensor:
    """(B, V) probabilities the first token must be sampled from: softmax(logits / temperature), then
    the k most likely tokens, then the smallest set of most likely tokens whose mass reaches top_p
    (a token is kept when the mass of the tokens more likely than it is below top_p), renormalised
    after each cut. Greedy: a point mass on the arg-max. ``strict``: refuse a top_p within 1e-3 of a
    nucleus boundary, where float rounding decides which side a token falls on."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    if 0 < params.top_k < probs.shape[-1]:
        kth = probs.topk(params.top_k, dim=-1).values[:, -1:]
        probs = torch.where(probs >= kth, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens more likely than each
        if strict:
            gap = (before - params.top_p).abs()
            assert float(gap.min()) > 1e-3, "top_p is too close to a nucleus boundary for a clean test; move it"
        keep_sorted = before < params.top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs.float()


def frequency_bound(probs: torch.Tensor, samples: int) -> torch.Tensor:
    """Five binomial standard deviations of each token's empirical frequency (plus one count)."""
    return 5 * torch.sqrt(probs * (1 - probs) / samples) + 1.0 / samples


def assert_distinguishable(expected: torch.Tensor, wrong: torch.Tensor, samples: int) -> None:
    """The check can tell ``expected`` from ``wrong``: some token differs by three times the bound."""
    margin = (expected - wrong).abs() - 3 * frequency_bound(expected, samples)
    assert float(margin.max()) > 0, "the two distributions are too close for this many samples"


def options_changed(params: SamplingParams) -> list[str]:
    """The sampling options of ``params`` that differ from their defaults."""
    defaults = SamplingParams()
    return [o for o in ("temperature", "top_k", "top_p") if getattr(params, o) != getattr(defaults, o)]


def _distinguishable(logits: torch.Tensor, params: SamplingParams, option: str) -> bool:
    ignored = dataclasses.replace(params, **{option: getattr(SamplingParams(), option)})
    try:
        assert_distinguishable(processed_distribution(logits, params),
                               processed_distribution(logits, ignored, strict=False), params.n)
    except AssertionError:
        return False
    return True


def pick_top_p(logits: torch.Tensor, params: SamplingParams) -> SamplingParams:
    """``params`` with top_p moved (by at most 0.1) to a value clearly inside a gap between the nucleus
    boundaries of every prompt (a token whose preceding mass equals top_p could fall on either side through
    float rounding) at which leaving out any one changed option gives a distribution the sampling check
    rejects. The model's exact distribution is not fixed, so neither is top_p."""
    if params.top_p >= 1.0:
        return params
    sorted_p = processed_distribution(logits, dataclasses.replace(params, top_p=1.0)).double().sort(
        dim=-1, descending=True).values
    boundaries = (sorted_p.cumsum(-1) - sorted_p).flatten()
    best, best_gap = None, 0.003
    for top_p in torch.arange(params.top_p - 0.1, params.top_p + 0.1001, 0.0025, dtype=torch.float64).tolist():
        gap = float((boundaries - top_p).abs().min())
        candidate = dataclasses.replace(params, top_p=round(top_p, 4))
        if gap > best_gap and all(_distinguishable(logits, candidate, o) for o in options_changed(candidate)):
            best, best_gap = candidate, gap
    assert best is not None, f"no clean, telling top_p near {params.top_p}"
    return best


# ---------------------------------------------------------------------------------------------------------
# Checks on one engine call
def _generate(engine: Any, prompts: Batch, params: SamplingParams) -> Batch:
    """One call with the seed fixed both ways an engine may read it: torch's global generator (the ``hf``
    engine) and ``params.seed`` (vLLM, SGLang)."""
    if params.seed is not None:
        torch.manual_seed(params.seed)
    return engine.generate(prompts, params)


def _check_layout(out: Batch, prompts: Batch, n: int, max_tokens: int) -> None:
    B = prompts["input_ids"].shape[0]
    assert len(out) == B * n, f"{len(out)} rows for {B} prompts x n={n}"
    assert torch.equal(out["prompts"], prompts["input_ids"].repeat_interleave(n, dim=0)), \
        "prompts must be the input prompts, each repeated n times in place"
    assert torch.equal(out["prompt_mask"], prompts["attention_mask"].repeat_interleave(n, dim=0))
    R = out["responses"].shape[1]
    assert 1 <= R <= max_tokens, f"response width {R} with max_tokens={max_tokens}"
    for key in ("response_mask", "rollout_log_probs"):
        if key in out:
            assert out[key].shape == (B * n, R), key


def check_first_token_distribution(engine: Any, prompts: Batch, logits: torch.Tensor, params: SamplingParams,
                                   seed: int = 0, atol: float = 2e-4,
                                   log_probs_after_filters: bool = True) -> dict[str, torch.Tensor]:
    """Sample ``params.n`` one-token responses per prompt and compare them with
    :func:`processed_distribution`; ``rollout_log_probs`` must be the log of the processed probability of
    each sampled token (within ``atol``), or, with ``log_probs_after_filters=False`` (an engine that reports
    them before top-k and top-p, as SGLang), of softmax(logits / temperature). Returns the expected and
    empirical distributions."""
    params = dataclasses.replace(params, max_tokens=1, stop_token_ids=(), seed=seed)
    out = _generate(engine, prompts, params)
    n, (B, V) = params.n, logits.shape
    _check_layout(out, prompts, n, 1)
    assert bool(out["response_mask"][:, 0].all()), "a one-token response holds its token"
    tokens = out["responses"][:, 0].view(B, n)
    expected = processed_distribution(logits, params)
    counts = torch.zeros(B, V).scatter_add_(1, tokens, torch.ones(B, n))
    empirical = counts / n
    outside = (expected == 0) & (counts > 0)
    assert not outside.any(), (
        f"sampled tokens the options exclude: prompt/token {outside.nonzero()[:5].tolist()} "
        f"(temperature={params.temperature}, top_k={params.top_k}, top_p={params.top_p}, greedy={params.greedy})")
    deviation = (empirical - expected).abs() - frequency_bound(expected, n)
    worst = deviation.flatten().argmax()
    assert float(deviation.max()) <= 0, (
        f"prompt {int(worst) // V} token {int(worst) % V}: frequency {float(empirical.flatten()[worst]):.4f}, "
        f"expected {float(expected.flatten()[worst]):.4f} over {n} samples ({params})")
    if "rollout_log_probs" in out:
        temperature = params.log_prob_temperature
        # The log-probs are those of the distribution each token was sampled from; for greedy decoding
        # that is the policy at temperature 1 (SamplingParams.log_prob_temperature: the trainer compares them
        # with the actor's log-probs at that temperature).
        unfiltered = params.greedy or not log_probs_after_filters
        reference = torch.softmax(logits.double() / temperature, -1).float() if unfiltered else expected
        want = reference.log().gather(1, tokens).flatten()
        got = out["rollout_log_probs"][:, 0]
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
    return {"expected": expected, "empirical": empirical}


def check_stops_and_length(engine: Any, prompts: Batch, logits: torch.Tensor, params: SamplingParams,
                           stop: set[int], seed: int = 0) -> Batch:
    """Responses end at (and include) their first token in ``stop``, are cut at ``params.max_tokens``
    and padded after with mask 0; the first token is still drawn from the unstopped distribution
    (stopping must not change what is sampled), so rows ending after one token come as often as the
    stop tokens' probability says."""
    params = dataclasses.replace(params, seed=seed)
    out = _generate(engine, prompts, params)
    n, B = params.n, logits.shape[0]
    _check_layout(out, prompts, n, params.max_tokens)
    responses, mask = out["responses"], out["response_mask"].bool()
    lengths = mask.sum(-1)
    for row in range(len(out)):
        k = int(lengths[row])
        assert k >= 1 and bool(mask[row, :k].all()) and not bool(mask[row, k:].any()), f"row {row}: mask not a prefix"
        body = responses[row, :k].tolist()
        assert not set(body[:-1]) & stop, f"row {row} goes on after a stop token: {body}"
        assert k == params.max_tokens or body[-1] in stop, f"row {row} ends early without a stop token: {body}"
        if "rollout_log_probs" in out:
            assert bool((out["rollout_log_probs"][row, k:] == 0).all()), f"row {row}: log-probs after the end"
    first = responses[:, 0].view(B, n)
    ended_at_once = (lengths == 1).view(B, n).float().mean(-1)
    p_stop = processed_distribution(logits, params)[:, sorted(stop)].sum(-1)
    if params.max_tokens > 1:
        torch.testing.assert_close(ended_at_once, torch.isin(first, torch.tensor(sorted(stop))).float().mean(-1))
        bound = 5 * torch.sqrt(p_stop * (1 - p_stop) / n) + 1.0 / n
        assert bool(((ended_at_once - p_stop).abs() <= bound).all()), (ended_at_once, p_stop)
    return out


def check_greedy(engine: Any, prompts: Batch, logits: torch.Tensor, n: int = 3, atol: float = 2e-4) -> None:
    """Greedy decoding ignores temperature, top-k and top-p and takes the arg-max every time."""
    for seed, extra in enumerate([{}, {"temperature": 1.7, "top_p": 0.3, "top_k": 7}]):
        params = SamplingParams(n=n, greedy=True, **extra)
        check_first_token_distribution(engine, prompts, logits, params, seed=seed, atol=atol)


def manual_greedy(model: Any, prompt_ids: list[int], max_tokens: int, stop: set[int]) -> list[int]:
    """Greedy decoding by full forward passes on one unpadded sequence (no KV cache, no padding)."""
    seq, out = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(max_tokens):
            token = int(model(input_ids=torch.tensor([seq], device=model.device)).logits[0, -1].argmax())
            out.append(token)
            seq.append(token)
            if token in stop:
                break
    return out


def _unpadded(prompts: Batch) -> list[list[int]]:
    return [ids[m.bool()].tolist() for ids, m in zip(prompts["input_ids"], prompts["attention_mask"])]


def _rows(out: Batch) -> list[list[int]]:
    return [row[:k] for row, k in zip(out["responses"].tolist(), out["response_mask"].sum(-1).tolist())]


# ---------------------------------------------------------------------------------------------------------
# Policies for the contract
def make_peaked_model(base_path: str, folder: str | Path, seed: int, likely_eos: bool) -> Any:
    """``base_path``'s architecture and tokenizer with random weights 0.2 sigma away from its own (peaked,
    prompt-dependent next-token distributions), saved to ``folder``; returns the float32 model.
    ``likely_eos``: the EOS token's output row is 0.9 times the row of a token that is often the most
    likely, so that responses end at different places (never an exact tie with it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_path)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    torch.manual_seed(seed)
    model = type(base)(base.config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
        if likely_eos:
            head = model.get_output_embeddings().weight
            probe = torch.tensor([[11, 23, 37, 5], [42, 17, 8, 9], [30, 31, 32, 33]])
            favourite = int(model(input_ids=probe).logits[:, -1].argmax(-1)[0])
            head[tok.eos_token_id] = 0.9 * head[favourite]
    model.requires_grad_(False)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model


def _bucketed(model: Any, tensors_per_bucket: int = 3) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights as ``rlx.plugins.launchers.weight_sync`` streams them: bucket after bucket, each
    bucket's tensors views of one new buffer; the tied ``lm_head.weight`` is sent once, under the embedding's name."""
    items = list(model.state_dict(keep_vars=False).items())
    seen: set[int] = set()
    unique = []
    for name, t in items:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        unique.append((name, t))
    for i in range(0, len(unique), tensors_per_bucket):
        bucket = unique[i:i + tensors_per_bucket]
        buffer = torch.cat([t.detach().reshape(-1).float() for _, t in bucket])
        offset = 0
        for name, t in bucket:
            yield name, buffer[offset:offset + t.numel()].view(t.shape).to(t.dtype)
            offset += t.numel()


class RolloutEngineContract:
    """Subclass this in a test module and define :meth:`make_engine`; pytest runs every check below on one
    engine (built once per class: engines that take seconds to start stay affordable).

    Class attributes an engine may set: ``logprob_atol`` (the tolerance of its log-probs against the
    training forward pass in float32; say why in the subclass when you raise it), ``samples`` (one-token
    samples per prompt in the distribution checks), ``base_model`` (the architecture and tokenizer the
    contract policies are built from: a model folder or ``builtin:tiny-qwen2``),
    ``log_probs_after_filters`` (False for an engine whose log-probs are those of softmax(logits /
    temperature) before top-k and top-p, as SGLang's), ``interruptible`` (True for an engine whose component
    declares ``extra["interruptible"]``: the interrupt checks run too).
    """

    logprob_atol: float = 1e-4
    log_probs_after_filters: bool = True
    interruptible: bool = False  # generate(prompts, params, interrupt=EVENT) stops where it is (rollout.partial)
    samples: int = 2000
    base_model: str = "builtin:tiny-qwen2"

    def make_engine(self, model_path: str, tokenizer: Any) -> Any:
        """Build the engine under test on the model folder ``model_path`` (it holds the tokenizer too).

        Stop at ``tokenizer.eos_token_id`` and pad with ``tokenizer.pad_token_id``."""
        raise NotImplementedError("define make_engine(model_path, tokenizer) in your RolloutEngineContract subclass")

    # -- fixtures ---------------------------------------------------------------------------------------
    @pytest.fixture(scope="class")
    def contract_policies(self, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
        """Two policies: ``a`` (the engine starts on it; EOS likely) and ``b`` (loaded through update_weights)."""
        from transformers import AutoTokenizer

        from rlx.run.data import resolve_path

        base = resolve_path(self.base_model)
        root = tmp_path_factory.mktemp("engine_contract")
        a = make_peaked_model(base, root / "a", seed=1234, likely_eos=True)
        b = make_peaked_model(base, root / "b", seed=4321, likely_eos=False)
        return {"a": a, "b": b, "a_path": str(root / "a"), "tokenizer": AutoTokenizer.from_pretrained(root / "a")}

    @pytest.fixture(scope="class")
    def engine(self, contract_policies: dict[str, Any]) -> Iterator[Any]:
        engine = self.make_engine(contract_policies["a_path"], contract_policies["tokenizer"])
        yield engine
        engine.close()

    @pytest.fixture(scope="class")
    def prompts(self, contract_policies: dict[str, Any]) -> Batch:
        """Three short prompts of different lengths (left-padded), each a row with its own reward inputs."""
        from rlx.run.data import PromptExample, collate

        tok = contract_policies["tokenizer"]
        ids = [[11, 23, 37, 5], [42, 17], [30, 31, 32, 33, 34, 35, 36]]
        return collate([PromptExample(x, tok.decode(x), f"source{i}", str(i), {"index": i})
                        for i, x in enumerate(ids)], tok.pad_token_id)

    @pytest.fixture(scope="class")
    def logits(self, contract_policies: dict[str, Any], prompts: Batch) -> torch.Tensor:
        out = next_token_logits(contract_policies["a"], prompts)
        assert len(set(out.argmax(-1).tolist())) > 1, "the prompts' distributions differ (rows cannot be swapped)"
        return out

    # -- the contract -----------------------------------------------------------------------------------
    def test_layout_and_masks(self, engine: Any, prompts: Batch) -> None:
        n, max_tokens = 3, 6
        out = _generate(engine, prompts, SamplingParams(n=n, max_tokens=max_tokens, seed=0))
        _check_layout(out, prompts, n, max_tokens)
        B, R = len(prompts) * n, out["responses"].shape[1]
        assert out["responses"].dtype == torch.long
        assert {"responses", "response_mask", "rollout_log_probs"} <= set(out.tensors)
        assert out["rollout_log_probs"].dtype == torch.float32 and out["rollout_log_probs"].shape == (B, R)
        for key, values in prompts.non_tensors.items():
            assert out[key] == [v for v in values for _ in range(n)], f"column {key} not repeated per sample"
        mask = out["response_mask"].bool()
        lp = out["rollout_log_probs"]
        assert bool(torch.isfinite(lp).all()) and bool((lp[mask] <= 0).all()) and bool((lp[~mask] == 0).all())

    @pytest.mark.parametrize("case", ["plain", "cold", "hot_top_k", "top_p", "all_three"])
    def test_sampling_options_give_the_processed_distribution(self, engine: Any, prompts: Batch,
                                                              logits: torch.Tensor, case: str) -> None:
        params = {
            "plain": SamplingParams(n=self.samples),
            "cold": SamplingParams(n=self.samples, temperature=0.6),
            "hot_top_k": SamplingParams(n=self.samples, temperature=2.0, top_k=8),
            "top_p": SamplingParams(n=self.samples, top_p=0.5),
            "all_three": SamplingParams(n=self.samples, temperature=1.3, top_k=5, top_p=0.7),
        }[case]
        params = pick_top_p(logits, params)
        for option in options_changed(params):  # the check would catch this option being ignored
            assert _distinguishable(logits, params, option), option
        check_first_token_distribution(engine, prompts, logits, params, seed=7, atol=max(self.logprob_atol, 2e-4),
                                       log_probs_after_filters=self.log_probs_after_filters)

    def test_greedy_is_the_arg_max_deterministic_and_a_full_forward_decode(
            self, engine: Any, prompts: Batch, logits: torch.Tensor, contract_policies: dict[str, Any]) -> None:
        check_greedy(engine, prompts, logits, atol=max(self.logprob_atol, 2e-4))
        params = SamplingParams(n=2, max_tokens=8, greedy=True, temperature=0.3)
        a = _generate(engine, prompts, dataclasses.replace(params, seed=0))
        b = _generate(engine, prompts, dataclasses.replace(params, seed=1))
        assert torch.equal(a["responses"], b["responses"]) and torch.equal(a["response_mask"], b["response_mask"])
        eos = {contract_policies["tokenizer"].eos_token_id}
        want = [manual_greedy(contract_policies["a"], ids, 8, eos) for ids in _unpadded(prompts)]
        assert _rows(a) == [w for w in want for _ in range(2)]

    def test_a_sequence_continues_from_its_prompt_and_tokens(self, engine: Any, prompts: Batch,
                                                             contract_policies: dict[str, Any]) -> None:
        """What asynchronous RL's partial rollouts rely on (rlx.overlap): greedy, generating from a prompt followed
        by the first tokens of its response gives the rest of that response."""
        from rlx.overlap import continuation_prompts, stitch

        tok = contract_policies["tokenizer"]
        params = SamplingParams(n=1, max_tokens=8, greedy=True, temperature=0.0)
        whole = _generate(engine, prompts, params)
        rows = (whole["response_mask"].sum(-1) >= 2).nonzero().squeeze(-1).tolist()
        assert rows, "every greedy response is one token long: nothing to continue"
        whole = whole.index(rows)
        head = whole.index(list(range(len(whole))))
        keep = torch.zeros_like(head["response_mask"])
        keep[:, :1] = 1  # the first token; the engine makes the rest
        head.tensors["response_mask"] = head["response_mask"] * keep
        head.tensors["responses"] = head["responses"].masked_fill(head["response_mask"] == 0, tok.pad_token_id)
        head.tensors["rollout_log_probs"] = head["rollout_log_probs"] * head["response_mask"]
        have = head["response_mask"].sum(-1)
        rest = _generate(engine, continuation_prompts(head, tok.pad_token_id),
                         dataclasses.replace(params, max_tokens=int(8 - have.min())))
        rest.tensors.setdefault("finished", torch.ones(len(rest), dtype=torch.bool))
        out = stitch(head, rest, 1, 8, tok.pad_token_id)
        assert _rows(out) == _rows(whole)
        mask = whole["response_mask"].bool()
        assert torch.allclose(out["rollout_log_probs"][:, :mask.shape[1]][mask], whole["rollout_log_probs"][mask],
                              atol=max(self.logprob_atol, 2e-4))

    def test_interrupt_stops_where_it_is(self, engine: Any, prompts: Batch) -> None:
        if not self.interruptible:
            pytest.skip("the engine does not declare that it can be interrupted (rollout.partial)")
        import threading

        params = SamplingParams(n=2, max_tokens=6, seed=0)
        event = threading.Event()
        free = engine.generate(prompts, params, interrupt=event)  # never set: every response ends
        ended = free["response_mask"].sum(-1)
        assert free["finished"].all() and (ended > 0).all()
        event.set()
        stopped = engine.generate(prompts, params, interrupt=event)  # set before: nothing is generated
        assert len(stopped) == len(free) and not stopped["finished"].any()
        assert (stopped["response_mask"].sum(-1) == 0).all()

    def test_seeded_sampling_repeats_and_other_seeds_differ(self, engine: Any, prompts: Batch) -> None:
        params = SamplingParams(n=4, max_tokens=8, temperature=1.0)
        first = _generate(engine, prompts, dataclasses.replace(params, seed=3))
        again = _generate(engine, prompts, dataclasses.replace(params, seed=3))
        other = _generate(engine, prompts, dataclasses.replace(params, seed=4))
        assert _rows(first) == _rows(again), "the same seed must give the same samples"
        assert _rows(first) != _rows(other), "another seed must give other samples"
        samples = _rows(first)
        assert len({tuple(r) for r in samples}) > len(prompts), "a prompt's n samples must be drawn independently"

    def test_eos_ends_responses(self, engine: Any, prompts: Batch, logits: torch.Tensor,
                                contract_policies: dict[str, Any]) -> None:
        eos = contract_policies["tokenizer"].eos_token_id
        out = check_stops_and_length(engine, prompts, logits, SamplingParams(n=300, max_tokens=4), {eos})
        lengths = out["response_mask"].sum(-1)
        assert int((lengths == 1).sum()) > 30 and int((lengths == 4).sum()) > 30, "the policy's EOS is likely"

    def test_stop_token_ids_end_responses(self, engine: Any, prompts: Batch, logits: torch.Tensor,
                                          contract_policies: dict[str, Any]) -> None:
        eos = contract_policies["tokenizer"].eos_token_id
        stop = {int(t) for t in logits.argmax(-1)} - {eos}  # likely first tokens: many rows stop at once
        params = SamplingParams(n=300, max_tokens=5, stop_token_ids=tuple(sorted(stop)))
        out = check_stops_and_length(engine, prompts, logits, params, stop | {eos})
        lengths = out["response_mask"].sum(-1)
        assert int((lengths == 1).sum()) > 30 and int((lengths == 5).sum()) > 10

    @pytest.mark.parametrize("max_tokens", [1, 5])
    def test_max_tokens_cuts_responses(self, engine: Any, prompts: Batch, logits: torch.Tensor,
                                       contract_policies: dict[str, Any], max_tokens: int) -> None:
        eos = contract_policies["tokenizer"].eos_token_id
        out = check_stops_and_length(engine, prompts, logits, SamplingParams(n=100, max_tokens=max_tokens), {eos})
        assert out["responses"].shape[1] == max_tokens  # with 300 rows, some run to the limit

    @pytest.mark.parametrize("temperature", [1.0, 0.7])
    def test_log_probs_match_the_training_forward_pass(self, engine: Any, prompts: Batch,
                                                       contract_policies: dict[str, Any], temperature: float) -> None:
        out = _generate(engine, prompts, SamplingParams(n=4, max_tokens=12, temperature=temperature, seed=11))
        self._assert_log_probs_of(contract_policies["a"], out, temperature)

    def test_update_weights_take_effect_and_survive_sleep(self, engine: Any, prompts: Batch,
                                                          contract_policies: dict[str, Any]) -> None:
        a, b = contract_policies["a"], contract_policies["b"]
        eos = {contract_policies["tokenizer"].eos_token_id}
        greedy = SamplingParams(max_tokens=8, greedy=True, seed=0)
        want = {name: [manual_greedy(m, ids, 8, eos) for ids in _unpadded(prompts)] for name, m in (("a", a), ("b", b))}
        assert want["a"] != want["b"], "the two policies must decode differently for this check to tell them apart"
        try:
            stream = _bucketed(b)
            engine.update_weights(stream)
            assert next(stream, None) is None, "update_weights must read every tensor it is given"
            assert _rows(_generate(engine, prompts, greedy)) == want["b"], "the new weights did not take effect"
            sampled = _generate(engine, prompts, SamplingParams(n=2, max_tokens=8, temperature=0.7, seed=2))
            self._assert_log_probs_of(b, sampled, 0.7)
            engine.sleep()
            engine.wake_up()
            assert _rows(_generate(engine, prompts, greedy)) == want["b"], "sleep/wake_up lost the new weights"
        finally:
            engine.update_weights(_bucketed(a))
        assert _rows(_generate(engine, prompts, greedy)) == want["a"]

    def test_sleep_and_wake_up_keep_the_weights(self, engine: Any, prompts: Batch) -> None:
        params = SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=5)
        before = _generate(engine, prompts, params)
        engine.sleep()
        engine.wake_up()
        after = _generate(engine, prompts, params)
        assert _rows(before) == _rows(after)
        torch.testing.assert_close(after["rollout_log_probs"], before["rollout_log_probs"], atol=self.logprob_atol,
                                   rtol=0)

    def _assert_log_probs_of(self, model: Any, out: Batch, temperature: float) -> None:
        """``out``'s log-probs against the training backend's forward pass of ``model`` (padded, as the
        actor computes old_log_probs)."""
        from rlx.plugins.modeling.head import response_log_probs

        with torch.no_grad():
            lp, _ = response_log_probs(model, out, temperature, with_entropy=False)
        mask = out["response_mask"].bool()
        torch.testing.assert_close(out["rollout_log_probs"][mask], lp[mask].float(), atol=self.logprob_atol, rtol=0)


# ---------------------------------------------------------------------------------------------
# Agent loops and tools (rlx.agent): a scripted engine, a real tokenizer with a Qwen2.5-shaped template, prompts.
AGENT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def agent_tokenizer(corpus: str) -> Any:
    """A byte-level BPE tokenizer (every byte encodable) trained on ``corpus``, with Qwen2.5's special and tool
    tokens (``<tool_call>`` etc. added as Qwen2.5 has them, not special) and :data:`AGENT_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|pad|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    t.train_from_iterator([corpus] * 8, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<|pad|>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    fast.chat_template = AGENT_TEMPLATE
    return fast


class ScriptedEngine:
    """A ``RolloutEngine.generate`` for agent-loop tests: its reply to each row is ``reply(conversation so far as
    text)`` followed by the end-of-turn token (``stop=False``: no end-of-turn token, the reply runs to the turn's
    budget); each token's log-prob is -0.5. ``calls`` records the batch size of every call."""

    def __init__(self, tok: Any, reply: Any, stop: bool = True) -> None:
        self.tok, self.reply, self.stop = tok, reply, stop
        self.calls: list[int] = []

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        assert params.n == 1
        self.calls.append(len(prompts))
        rows = []
        for ids, mask in zip(prompts["input_ids"].tolist(), prompts["attention_mask"].tolist()):
            context = self.tok.decode([t for t, m in zip(ids, mask) if m])
            out = self.tok(self.reply(context), add_special_tokens=False)["input_ids"]
            out = [*out, self.tok.eos_token_id] if self.stop else out * params.max_tokens
            rows.append(out[: params.max_tokens])
        width = max(len(r) for r in rows)
        responses = torch.full((len(rows), width), self.tok.pad_token_id)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            responses[i, :len(r)] = torch.tensor(r)
            mask[i, :len(r)] = 1
        return Batch({"prompts": prompts["input_ids"], "prompt_mask": prompts["attention_mask"],
                      "responses": responses, "response_mask": mask, "rollout_log_probs": -0.5 * mask.float()})


def prompt_batch(tok: Any, questions: list[str], ground_truth: str = "") -> Batch:
    """Left-padded chat prompts of one user turn each, with a ``ground_truth`` column."""
    rows = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for q in questions]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return Batch({"input_ids": ids, "attention_mask": mask}, {"ground_truth": [ground_truth] * len(rows)})
