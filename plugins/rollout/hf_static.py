"""The ``hf`` engine's fast path: a static KV cache and the decode step recorded once in a CUDA graph.

A step runs transformers' own model code on one token per row, then picks the next token and its
log-prob (``hf_sampling.Sampler``) without leaving the device; on a GPU all of it is one graph replay.
Prompts are left-padded to a multiple of ``prompt_bucket`` tokens and the batch to a power of two, so the
few shapes a run meets each get one cache, one compilation and one graph, reused for every later batch.

Masks are built here, as 4D tensors that transformers takes as they are, so no mask code (which may
synchronise with the host) runs inside the graph. Padding query positions of the prompt attend to
themselves alone: a row with no key to attend to would give NaN and poison the cache.

With sdpa, the engine's model runs its attention through :func:`decode_attention` (registered with
transformers' attention interface): for a one-token query it folds the query heads that share a key/value
head into one group, so grouped-query attention reads the cache once instead of through ``repeat_kv``'s
copy of it per query head (with a mask, transformers' sdpa path makes that copy); other calls go to
transformers' own sdpa function.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Literal

from rlx.plugins.rollout.hf_sampling import Sampler, cache_argument, prompt_positions

if TYPE_CHECKING:
    import torch

CompileMode = Literal["off", "default", "max-autotune"]
DECODE_ATTENTION = "rlx_sdpa_decode"


def decode_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Transformers' sdpa attention, except for one query token with grouped key/value heads and a mask shared
    by all heads: the ``n_rep`` query heads of each key/value head become ``n_rep`` query rows of it."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if (q_len != 1 or heads == kv_heads or attention_mask is None or attention_mask.dim() != 4
            or attention_mask.shape[1] != 1 or dropout):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)  # head h uses key/value head h // n_rep
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask,
                                                           scale=scaling)
    return out.reshape(batch, 1, heads, dim), None  # (b, q, heads, dim), as transformers' functions return


def use_decode_attention(model: Any) -> None:
    """Run the model's sdpa attention through :func:`decode_attention` (masks built as for sdpa)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(DECODE_ATTENTION, decode_attention)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)
    model.set_attn_implementation(DECODE_ATTENTION)


def supports_static(model: Any) -> str | None:
    """Why the static path cannot run this model, or None when it can."""
    config = model.config
    impl = getattr(config, "_attn_implementation", "sdpa")
    if impl not in ("sdpa", "eager", DECODE_ATTENTION):
        return f"attention implementation {impl!r} (the static path builds masks for sdpa and eager)"
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    if any(t != "full_attention" for t in layer_types):
        return "sliding-window or other non-full attention layers"
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    return None


def next_power_of_two(n: int, floor: int = 8) -> int:
    return max(floor, 1 << (n - 1).bit_length())


class StaticDecoder:
    """Decoding for one batch size, prompt width, response length and sampler: its own static cache and
    buffers, and (on CUDA) one recorded decode step."""

    def __init__(self, model: Any, batch: int, prompt_len: int, max_tokens: int, sampler: Sampler,
                 stop: list[int], use_graph: bool, pool: Any) -> None:
        import torch
        from transformers import StaticCache

        self.model, self.sampler, self.max_tokens = model, sampler, max_tokens
        self.length = prompt_len + max_tokens
        device = model.device
        self.cache = StaticCache(config=model.config, max_cache_len=self.length)
        self.cache_kw = cache_argument(model)
        self.additive = getattr(model.config, "_attn_implementation", "sdpa") == "eager"
        self.dtype = model.dtype
        long = {"dtype": torch.long, "device": device}
        self.tok = torch.zeros(batch, 1, **long)  # the token fed to the next step
        self.pos = torch.zeros(batch, 1, **long)  # its position id
        self.slot = torch.zeros(1, **long)  # its cache slot
        self.column = torch.zeros(1, **long)  # the output column the next step writes
        self.key_ok = torch.zeros(batch, self.length, dtype=torch.bool, device=device)
        self.tokens = torch.zeros(batch, max_tokens, **long)
        self.log_probs = torch.zeros(batch, max_tokens, dtype=torch.float32, device=device)
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.stop = torch.tensor(sorted(set(stop)) or [-1], **long)
        self.step_fn: Any = self._log_probs  # (ids, mask, positions) -> (b, V) log-probs; the engine may compile it
        self.use_graph, self.pool = use_graph, pool
        self.graph: Any = None

    # -- the pieces ---------------------------------------------------------------------------------
    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        import torch

        if not self.additive:
            return allowed
        # eager attention adds the mask to the scores
        zero = torch.zeros((), dtype=self.dtype, device=allowed.device)
        return torch.where(allowed, zero, torch.finfo(self.dtype).min)

    def _log_probs(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         **{self.cache_kw: self.cache})
        return self.sampler.log_probs(out.logits[:, -1])

    def _stopped(self, token: torch.Tensor) -> torch.Tensor:
        return (token.unsqueeze(-1) == self.stop).any(-1)

    def _record(self, token: torch.Tensor, log_prob: torch.Tensor) -> None:
        self.tokens.index_copy_(1, self.column, token.unsqueeze(-1))
        self.log_probs.index_copy_(1, self.column, log_prob.unsqueeze(-1))
        self.done |= self._stopped(token)
        self.tok.copy_(token.unsqueeze(-1))

    def step(self) -> None:
        """One decode step, entirely on the device (this is what the graph records)."""
        self.key_ok.index_fill_(1, self.slot, True)
        log_probs = self.step_fn(self.tok, self._mask(self.key_ok[:, None, None, :]), self.pos)
        token = self.sampler.choose(log_probs)
        self._record(token, log_probs.gather(-1, token.unsqueeze(-1)).squeeze(-1))
        self.pos.add_(1)
        self.slot.add_(1)
        self.column.add_(1)

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """Fill the cache with the prompts (b, P) and draw the first response token."""
        import torch

        self.cache.reset()
        b, p = ids.shape
        device = ids.device
        query = torch.arange(p, device=device)[:, None]
        key = torch.arange(self.length, device=device)[None, :]
        key_real = torch.zeros(b, self.length, dtype=torch.bool, device=device)
        key_real[:, :p] = mask.bool()
        allowed = ((key <= query)[None] & key_real[:, None, :]) | (key == query)[None]  # (b, P, L)
        positions = prompt_positions(mask)
        out = self.model(input_ids=ids, attention_mask=self._mask(allowed[:, None]), position_ids=positions,
                         use_cache=True, logits_to_keep=1, **{self.cache_kw: self.cache})
        token, log_prob = self.sampler.step(out.logits[:, -1])
        self.column.zero_()
        self.done.zero_()
        self._record(token, log_prob)
        self.key_ok.copy_(key_real)
        self.pos.copy_(positions[:, -1:] + 1)
        self.slot.fill_(p)
        self.column.fill_(1)

    def capture(self, ids: torch.Tensor, mask: torch.Tensor, warmup: int = 3) -> None:
        """Record the decode step, after warm-up steps on a side stream (compilation and library
        workspaces happen there, outside the recording)."""
        import torch

        self.prefill(ids, mask)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread of this process may be training meanwhile (asynchronous RL, rlx.overlap);
        # its allocations are not this recording's business.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.step()
        self.graph = graph

    def generate(self, ids: torch.Tensor, mask: torch.Tensor, check_every: int = 16,
                 interrupt: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(b, R) raw tokens and their log-probs; R < max_tokens only when every row has stopped, or when
        ``interrupt`` was set (looked at every ``check_every`` steps, with the stop check)."""
        if self.use_graph and self.graph is None:
            self.capture(ids, mask)
        self.prefill(ids, mask)
        width = self.max_tokens
        if bool(self.done.all()):
            width = 1
        else:
            for column in range(1, self.max_tokens):
                if self.graph is not None:
                    self.graph.replay()
                else:
                    self.step()
                # A host read costs a synchronisation: look every few steps only.
                if (column + 1) % check_every == 0 and column + 1 < self.max_tokens and (
                        bool(self.done.all()) or (interrupt is not None and interrupt.is_set())):
                    width = column + 1
                    break
        return self.tokens[:, :width].clone(), self.log_probs[:, :width].clone()


class StaticEngine:
    """The static decoders of one model, by shape; the least recently used is dropped beyond ``max_shapes``."""

    def __init__(self, model: Any, pad_token_id: int, use_graph: bool, compile_mode: CompileMode,
                 prompt_bucket: int = 64, max_shapes: int = 4) -> None:
        self.model, self.pad_token_id = model, pad_token_id
        self.use_graph, self.compile_mode = use_graph, compile_mode
        self.prompt_bucket, self.max_shapes = prompt_bucket, max_shapes
        self.decoders: OrderedDict[tuple[Any, ...], StaticDecoder] = OrderedDict()
        if getattr(model.config, "_attn_implementation", None) == "sdpa":
            use_decode_attention(model)
        self.pool: Any = None
        self.compile_failed = False

    def clear(self) -> None:
        """Forget every cache and graph (the graphs hold the weights' addresses, which a move changes)."""
        self.decoders.clear()
        self.pool = None

    def _step_fn(self, decoder: StaticDecoder) -> Any:
        if self.compile_mode == "off" or self.compile_failed:
            return None
        import torch

        mode = "max-autotune-no-cudagraphs" if self.compile_mode == "max-autotune" else None
        return torch.compile(decoder._log_probs, mode=mode, dynamic=False)

    def _decoder(self, batch: int, prompt_len: int, max_tokens: int, sampler: Sampler,
                 stop: list[int]) -> StaticDecoder:
        import torch

        key = (batch, prompt_len, max_tokens, sampler, tuple(sorted(set(stop))))
        if key in self.decoders:
            self.decoders.move_to_end(key)
            return self.decoders[key]
        while len(self.decoders) >= self.max_shapes:
            self.decoders.popitem(last=False)
        if self.use_graph and self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        decoder = StaticDecoder(self.model, batch, prompt_len, max_tokens, sampler, stop, self.use_graph, self.pool)
        decoder.step_fn = self._step_fn(decoder) or decoder.step_fn
        self.decoders[key] = decoder
        return decoder

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, sampler: Sampler, max_tokens: int,
                 stop: list[int], interrupt: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Like ``decode_dynamic``: (b, R) raw tokens and log-probs for left-padded prompts."""
        import torch

        b, p = input_ids.shape
        width = -(-p // self.prompt_bucket) * self.prompt_bucket
        rows = next_power_of_two(b)
        ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long, device=input_ids.device)
        mask = torch.zeros((rows, width), dtype=torch.long, device=input_ids.device)
        ids[:b, width - p:] = input_ids
        mask[:b, width - p:] = attention_mask
        ids[b:], mask[b:] = ids[0], mask[0]  # filler rows: copies of a real prompt, dropped below
        decoder = self._decoder(rows, width, max_tokens, sampler, stop)
        try:
            tokens, log_probs = decoder.generate(ids, mask, interrupt=interrupt)
        except Exception as exc:  # a compiler failure must not end the run: decode uncompiled
            if decoder.step_fn == decoder._log_probs:
                raise
            warnings.warn(f"torch.compile of the decode step failed ({type(exc).__name__}: {exc}); "
                          "decoding without compilation.", RuntimeWarning, stacklevel=2)
            self.compile_failed = True
            self.clear()
            decoder = self._decoder(rows, width, max_tokens, sampler, stop)
            tokens, log_probs = decoder.generate(ids, mask, interrupt=interrupt)
        return tokens[:b], log_probs[:b]
