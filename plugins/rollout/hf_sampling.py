"""Sampling for the ``hf`` engine: the processed distribution, the draw, and a decode loop with a dynamic cache.

The log-prob of each chosen token is taken from the step's own distribution while it is at hand, so no
full-vocabulary scores are kept across steps. Every operation here is free of host synchronisation, so the
static engine (``hf_static``) records the same functions inside a CUDA graph.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from rlx.protocols import SamplingParams


@dataclass(frozen=True)
class Sampler:
    """What one step does with the next-token logits (greedy ignores temperature, top-k and top-p)."""

    greedy: bool
    temperature: float
    top_k: int
    top_p: float

    @classmethod
    def from_params(cls, params: SamplingParams) -> Sampler:
        greedy = params.greedy or params.temperature <= 0
        if greedy:
            return cls(True, 1.0, 0, 1.0)
        return cls(False, float(params.temperature), max(int(params.top_k), 0), float(params.top_p))

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(b, V) float32 log-probs of the distribution tokens are drawn from: logits / temperature, then the
        top-k tokens (ties at the k-th value kept), then the nucleus (a token stays when the mass of the tokens
        more likely than it is below top_p), renormalised. Greedy: the policy at temperature 1."""
        import torch

        x = logits.float()
        if self.greedy:
            return torch.log_softmax(x, dim=-1)
        if self.temperature != 1.0:
            x = x / self.temperature
        vocab = x.shape[-1]
        if 0 < self.top_k < vocab:
            kth = torch.topk(x, self.top_k, dim=-1).values[:, -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_x, order = torch.sort(x, dim=-1, descending=True)
            p = torch.softmax(sorted_x, dim=-1)
            drop_sorted = (p.cumsum(-1) - p) >= self.top_p
            drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
            x = x.masked_fill(drop, float("-inf"))
        return torch.log_softmax(x, dim=-1)

    def choose(self, log_probs: torch.Tensor) -> torch.Tensor:
        """(b,) tokens: the arg-max, or a draw by the exponential race (arg-max of p / E with E ~ Exp(1) is
        distributed as p), which needs no host synchronisation, unlike ``torch.multinomial``, and uses the
        default generator, which CUDA graphs can replay."""
        import torch

        if self.greedy:
            return log_probs.argmax(-1)
        race = torch.empty_like(log_probs).exponential_().clamp_min_(torch.finfo(torch.float32).tiny)
        return (log_probs.exp() / race).argmax(-1)

    @property
    def plain(self) -> bool:
        """Whether the distribution is the logits' softmax at the temperature alone (no top-k or top-p cut)."""
        return self.greedy or (self.top_k <= 0 and self.top_p >= 1.0)

    def race(self, logits: torch.Tensor, noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`step` for a :attr:`plain` sampler without the (b, V) log-probs: with x the scaled logits, the
        token is the arg-max of x - log E (``noise``: E ~ Exp(1) per token, the exponential race of
        :meth:`choose`, since log p = x - logsumexp(x) differs from x by a constant per row), or of x when greedy
        (``noise`` None), and its log-prob x_token - logsumexp(x): two passes over the logits instead of four,
        and no float32 copy of them kept."""
        import torch

        x = logits.float()
        if not self.greedy and self.temperature != 1.0:
            x = x / self.temperature
        if noise is None:
            token = x.argmax(-1)
        else:
            token = (x - noise.clamp_min(torch.finfo(torch.float32).tiny).log()).argmax(-1)
        chosen = x.gather(-1, token.unsqueeze(-1)).squeeze(-1)
        return token, chosen - torch.logsumexp(x, dim=-1)

    def step(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(b,) chosen tokens and (b,) their log-probs."""
        if self.plain:
            import torch

            noise = None if self.greedy else torch.empty_like(logits, dtype=torch.float32).exponential_()
            return self.race(logits, noise)
        log_probs = self.log_probs(logits)
        tokens = self.choose(log_probs)
        return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def cache_argument(model: Any) -> str:
    """The name under which the model's forward takes its KV cache (``past_key_values`` before
    transformers 5.18, ``cache`` after)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def prompt_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded prompts: 0 at each row's first real token (padding gets 0 too)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def decode_dynamic(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, sampler: Sampler,
                   max_tokens: int, stop: torch.Tensor, interrupt: Any = None, *,
                   prefill: dict[str, torch.Tensor] | None = None,
                   positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to ``max_tokens`` tokens for left-padded prompts with the model's dynamic cache.

    Every row is sampled at every step until all rows have produced a stop token, so the random draws of a
    row do not depend on when the others stop. Returns the raw (b, R) tokens and their (b, R) log-probs; the
    caller cuts each row after its first stop token. Once ``interrupt.is_set()``, decoding stops after the
    current step (partial rollouts). ``prefill``: further inputs of the prompt's forward pass (a vision-language
    model's image tensors); ``positions``: the prompts' position ids when they are not the plain ones (the (3, b, P)
    multimodal rotary positions), each new token one past its row's last.
    """
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    cache_kw = cache_argument(model)
    mask = attention_mask.long()
    if positions is None:
        positions = prompt_positions(mask)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                logits_to_keep=1, **(prefill or {}), **{cache_kw: cache})
    last_position = positions[..., -1:]
    tokens, log_probs = [], []
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for step in range(max_tokens):
        token, log_prob = sampler.step(out.logits[:, -1])
        tokens.append(token)
        log_probs.append(log_prob)
        done |= torch.isin(token, stop)
        if step + 1 == max_tokens or bool(done.all()) or (interrupt is not None and interrupt.is_set()):
            break
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        last_position = last_position + 1
        out = model(input_ids=token.unsqueeze(-1), attention_mask=mask, position_ids=last_position,
                    use_cache=True, **{cache_kw: cache})
    return torch.stack(tokens, dim=1), torch.stack(log_probs, dim=1)
