"""What every rollout engine must do with ``SamplingParams``, as reusable checks.

Each check takes an engine (anything with ``RolloutEngine.generate``), a prompt batch and the exact
next-token logits of the engine's policy for those prompts (``next_token_logits`` computes them from
a Hugging Face model holding the same weights), and compares what the engine samples with the
distribution the options must produce:

- temperature, top-k and top-p, applied in that order (as Hugging Face, vLLM and SGLang do): the first
  response token's empirical frequencies over many samples match the processed, renormalised
  distribution, tokens outside top-k / the nucleus never appear, and ``rollout_log_probs`` is the log
  of the processed probability of the sampled token;
- ``n``: each prompt's ``n`` samples are adjacent and drawn from that prompt's distribution;
- ``greedy``: every sample is the arg-max, whatever the temperature;
- ``max_tokens`` and stop tokens (``stop_token_ids`` or the engine's EOS): a response ends at and
  includes its first stop token, is cut at ``max_tokens``, and is padded with mask 0 after.

The statistical checks cannot flake: the caller fixes the seed (the engine may also read
``params.seed``), and the bound per token is five standard deviations of its binomial frequency, so a
correct engine passes with any seed but for a ~1e-5 chance, while :func:`assert_distinguishable`
makes sure a wrong distribution (an option ignored) is far outside the bound.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rlx.batch import Batch
from rlx.protocols import SamplingParams


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


def _check_layout(out: Batch, prompts: Batch, n: int, max_tokens: int) -> None:
    B = prompts["input_ids"].shape[0]
    assert len(out) == B * n
    assert torch.equal(out["prompts"], prompts["input_ids"].repeat_interleave(n, dim=0))
    assert torch.equal(out["prompt_mask"], prompts["attention_mask"].repeat_interleave(n, dim=0))
    R = out["responses"].shape[1]
    assert 1 <= R <= max_tokens
    for key in ("response_mask", "rollout_log_probs"):
        if key in out:
            assert out[key].shape == (B * n, R), key


def check_first_token_distribution(engine: Any, prompts: Batch, logits: torch.Tensor, params: SamplingParams,
                                   seed: int = 0) -> dict[str, torch.Tensor]:
    """Sample ``params.n`` one-token responses per prompt and compare them with
    :func:`processed_distribution`; returns the expected and empirical distributions."""
    params = dataclasses.replace(params, max_tokens=1, stop_token_ids=(), seed=seed)
    torch.manual_seed(seed)
    out = engine.generate(prompts, params)
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
        temperature = out.meta.get("temperature", 1.0 if params.greedy else params.temperature)
        # The log-probs are those of the distribution each token was sampled from; for greedy decoding
        # that is the policy at the temperature the engine reports (the trainer compares them with the
        # actor's log-probs at that temperature).
        reference = expected if not params.greedy else torch.softmax(logits.double() / temperature, -1).float()
        want = reference.log().gather(1, tokens).flatten()
        got = out["rollout_log_probs"][:, 0]
        torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    return {"expected": expected, "empirical": empirical}


def check_stops_and_length(engine: Any, prompts: Batch, logits: torch.Tensor, params: SamplingParams,
                           stop: set[int], seed: int = 0) -> Batch:
    """Responses end at (and include) their first token in ``stop``, are cut at ``params.max_tokens``
    and padded after with mask 0; the first token is still drawn from the unstopped distribution
    (stopping must not change what is sampled), so rows ending after one token come as often as the
    stop tokens' probability says."""
    params = dataclasses.replace(params, seed=seed)
    torch.manual_seed(seed)
    out = engine.generate(prompts, params)
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


def check_greedy(engine: Any, prompts: Batch, logits: torch.Tensor, n: int = 3) -> None:
    """Greedy decoding ignores temperature, top-k and top-p and takes the arg-max every time."""
    for seed, extra in enumerate([{}, {"temperature": 1.7, "top_p": 0.3, "top_k": 7}]):
        params = SamplingParams(n=n, greedy=True, **extra)
        check_first_token_distribution(engine, prompts, logits, params, seed=seed)

