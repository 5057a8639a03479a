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

Llama-family models (Llama, Qwen2, Qwen3, Mistral without a sliding window: :func:`supports_slots`) decode
through :class:`SlotDecoder` instead: rlx's own step (:func:`slot_forward`, transformers' arithmetic) over
fused q/k/v and gate/up weights (the model's parameters become views of them, so weight updates need no
second copy), a per-layer cache, and ``rlx::slot_attention``, which on a GPU is a Triton kernel that writes
the new key/value and reads each row's own columns only (its prompt start to the current column, not the
cache's whole length). The prefill runs the model's own forward for many prompts at once. Every 16 steps
the rows still decoding move to the front and the step runs at the smallest power-of-two bucket that holds
them (one recorded graph per bucket, one compilation for all, the batch dimension symbolic), so rows that
finished are not decoded any more. Sampling runs inside the compiled step; on a GPU without top-k or top-p it
is one Triton pass over the logits that draws its own noise (``hf_kernels``, ``rlx::race_sample``).
"""

from __future__ import annotations

import functools
import warnings
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Literal

from rlx.plugins.rollout.hf_sampling import Sampler, cache_argument, prompt_positions
from rlx.step import distinct_prompts

if TYPE_CHECKING:
    import torch

CompileMode = Literal["off", "default", "max-autotune"]
DECODE_ATTENTION = "rlx_sdpa_decode"
# The slot step's matrix products through rlx::skinny_linear (hf_linear: Triton kernels chosen per shape by
# measurement against cuBLAS). Off until measured on a GPU (benchmarks/perf_probe.sh; decode_speed.py
# --with skinny-linear turns it on for a run): its first use tunes every shape, which costs compilation time.
SKINNY_LINEAR = False
# The slot decoder's prefill through rlx's own pass over the fused weights (slot_prefill, compiled with the step),
# writing keys and values straight into its cache; off: the model's own forward and a copy. Measured on an H100
# (2026-12-07, 0.5b shape, 64 prompts of 214 tokens): prefill 0.030 s against 0.060 s; the sampled tokens'
# log-probs differ from the training pass's by 0.0098 on average against 0.0096 (bf16).
OWN_PREFILL = True
# The slot decoder's prefill runs each distinct prompt once and copies its keys, values and last logits to the
# rows that repeat it (a GRPO step's n samples of one prompt); off: every row is prefilled. Measured on an H100
# (2026-12-07, the GRPO benchmark, 8 prompts of 214 tokens x 8 rows, one call): generation 0.339 s against 0.354 s.
SHARE_PREFILL = True
# Round 3's decode kernels (the fused sampling, the attention in ranges and with the rotary embedding inside it).
# A failure of any of them at run time (a GPU whose Triton cannot build one) sets this off for the process, with a
# warning, and the engine decodes again with the kernels before them.
FUSED_KERNELS = True
# Recording the graphs of a decoder shape this engine recorded before (rollout.free_on_sleep=discard records them
# again at every rollout): True warms each bucket up again first, as at its first recording; False records it at
# once (its step is compiled and its kernels loaded already). A recording that fails without warm-up is done again
# with it. Measured on an H100 (2026-12-07, the GRPO benchmark's memory-lean setting, 64 rows of 256 tokens):
# generation 0.410 s against 0.478 s, and 0.39 GiB less held between steps (4.87 against 5.25 GiB).
REWARM = False


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
    from rlx.plugins.modeling.vision import is_vision_config

    if is_vision_config(config):
        return "a vision-language model (its prompts' images and multimodal rotary positions)"
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
        if self.use_graph and self.graph is None and self.max_tokens > 1:
            self.capture(ids, mask)
        self.prefill(ids, mask)
        width = self.max_tokens
        if self.max_tokens == 1 or bool(self.done.all()):
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


# -- the slot decoder: rlx's own decode step for Llama-family models ---------------------------------------
SLOT_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
MIN_BUCKET = 8


def supports_slots(model: Any) -> str | None:
    """Why :class:`SlotDecoder` cannot step this model, or None when it can: a Llama-family decoder (Llama,
    Qwen2, Qwen3, Mistral without a sliding window) with the module layout transformers gives them."""
    config = model.config
    if getattr(config, "model_type", None) not in SLOT_MODEL_TYPES:
        return f"model type {getattr(config, 'model_type', None)!r}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "a sliding window"
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or any(not hasattr(inner, n) for n in needed) or not hasattr(model, "lm_head"):
        return "an unfamiliar module layout"
    if getattr(inner.rotary_emb, "rope_type", "default") not in STATIC_ROPE_TYPES:
        return f"rope type {inner.rotary_emb.rope_type!r}"
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or any(not hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "an unfamiliar attention layout"
        if any(not hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return "an unfamiliar MLP layout"
        if len({attn.q_proj.bias is None, attn.k_proj.bias is None, attn.v_proj.bias is None}) > 1:
            return "biases on some of the q/k/v projections only"
        if (mlp.gate_proj.bias is None) != (mlp.up_proj.bias is None):
            return "a bias on one of the gate/up projections only"
    return None


def _fused(parts: list[Any]) -> Any:
    """One tensor holding ``parts`` stacked along dim 0; the parts' ``.data`` become views of it, so an update
    that copies into a part writes into the fused tensor and no second copy is kept."""
    import torch

    fused = torch.cat([p.data for p in parts], 0)
    offset = 0
    for p in parts:
        p.data = fused[offset:offset + p.shape[0]]
        offset += p.shape[0]
    return fused


class FusedWeights:
    """The engine model's weights as the slot step reads them: q/k/v and gate/up fused into one matrix each,
    the model's own parameters views of those (no second copy; weight updates stay in sync)."""

    def __init__(self, model: Any) -> None:
        inner = model.model
        self.embed, self.head = inner.embed_tokens.weight, model.lm_head.weight
        self.norm_w, self.norm_eps = inner.norm.weight, _eps(inner.norm)
        self.rotary = inner.rotary_emb
        self.layers: list[dict[str, Any]] = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
            bias = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
            gate_up_bias = [mlp.gate_proj.bias, mlp.up_proj.bias]
            entry = {
                "in_w": layer.input_layernorm.weight, "in_eps": _eps(layer.input_layernorm),
                "post_w": layer.post_attention_layernorm.weight, "post_eps": _eps(layer.post_attention_layernorm),
                "qkv": _fused(qkv), "qkv_b": _fused(bias) if bias[0] is not None else None,
                "o": attn.o_proj.weight, "o_b": attn.o_proj.bias,
                "gate_up": _fused([mlp.gate_proj.weight, mlp.up_proj.weight]),
                "gate_up_b": _fused(gate_up_bias) if gate_up_bias[0] is not None else None,
                "down": mlp.down_proj.weight, "down_b": mlp.down_proj.bias, "act": mlp.act_fn,
                "q_norm": getattr(attn, "q_norm", None), "k_norm": getattr(attn, "k_norm", None),
            }
            self.layers.append(entry)
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.intermediate = self.layers[0]["gate_up"].shape[0] // 2
        self.scale = float(getattr(inner.layers[0].self_attn, "scaling", self.head_dim ** -0.5))
        self.attention = attention_op()
        self.rope_attention = rope_attention_op()
        if SKINNY_LINEAR:
            from rlx.plugins.rollout.hf_linear import linear_op

            self.linear: Any = linear_op()
        else:
            import torch

            self.linear = torch.nn.functional.linear
        self.pointers = self._pointers(model)
        # The MLP weights pulled into L2 while the attention half of each layer runs (hf_prefetch), where on.
        from rlx.plugins.rollout import hf_prefetch

        self.scratch: Any = None
        if hf_prefetch.usable(self.embed.device):
            import torch

            self.prefetch: Any = hf_prefetch.prefetch_op()
            self.schedule = hf_prefetch.SCHEDULE
            self.scratch = torch.zeros(1, dtype=torch.int32, device=self.embed.device)

    @staticmethod
    def _pointers(model: Any) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in model.parameters())

    def current(self, model: Any) -> bool:
        """Whether the model's parameters are still the tensors fused here (a move or a freeing sleep replaces
        them)."""
        return self._pointers(model) == self.pointers


def _eps(norm: Any) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _rms_norm(x: Any, weight: Any, eps: float) -> Any:
    """transformers' Llama RMSNorm: float32 statistics, the weight applied in the input's dtype."""
    import torch

    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: Any, cos: Any, sin: Any) -> Any:
    import torch

    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attend_reference(q: Any, k: Any, v: Any, k_cache: Any, v_cache: Any, start: Any, slot: Any,
                     scale: float) -> Any:
    """The slot step's attention in plain torch: writes the new keys/values (b, kv_heads, d) at cache column
    ``slot`` of rows :b, then attends each row's query heads (b, heads, d) to its columns start..slot."""
    import torch

    b, heads, d = q.shape
    kv_heads, length = k_cache.shape[1], k_cache.shape[2]
    k_cache[:b].index_copy_(2, slot, k.unsqueeze(2))
    v_cache[:b].index_copy_(2, slot, v.unsqueeze(2))
    keys, values = k_cache[:b], v_cache[:b]
    grouped = q.view(b, kv_heads, heads // kv_heads, d)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scale  # (b, kv, rep, L)
    column = torch.arange(length, device=q.device)
    allowed = (column[None, :] >= start[:, None]) & (column[None, :] <= slot)  # (b, L)
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).reshape(b, heads, d)


@functools.cache
def _triton_attention() -> Any:
    """The CUDA attention kernel (flash decoding over each row's own columns), or None without Triton.

    One program per (row, key/value head, split): the cache's columns are cut into ``splits`` equal ranges and
    each program attends its row's query heads to the columns of its range that lie between the row's start and
    the current column; split 0 also takes the new key/value (from registers) and writes it into the cache. With
    one split the program writes the output; with more, each writes its running maximum, sum and weighted values
    and a second kernel combines them. Splits give the GPU work when the rows and heads alone are too few
    programs to fill it (64 rows of 2 key/value heads: 128 programs on 132 multiprocessors, each reading a long
    row alone)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def kernel(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, start_ptr, slot_ptr, o_ptr, pm_ptr, pt_ptr, pa_ptr, cos_ptr,
               sin_ptr, scale, s_qb, s_qh, s_kb, s_kh, s_cb, s_ch, s_cl, s_ob, s_oh, s_rb, chunk,
               REP: tl.constexpr, REP_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
               SPLITS: tl.constexpr, ROPE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1)
        split = tl.program_id(2)
        r = tl.arange(0, REP_PAD)
        d = tl.arange(0, D)
        real = r < REP
        q_at = q_ptr + row * s_qb + (group * REP + r)[:, None] * s_qh
        q = tl.load(q_at + d[None, :], mask=real[:, None], other=0.0)
        if ROPE:  # the rotary embedding of the query heads (and below of the new key), from the unrotated q/k/v
            half = (d + D // 2) % D  # rotate_half: x[d + D/2] negated in the first half, x[d - D/2] in the second
            sign = tl.where(d < D // 2, -1.0, 1.0)
            cos = tl.load(cos_ptr + row * s_rb + d).to(tl.float32)
            sin = tl.load(sin_ptr + row * s_rb + d).to(tl.float32)
            q_half = tl.load(q_at + half[None, :], mask=real[:, None], other=0.0).to(tl.float32)
            q = (q.to(tl.float32) * cos[None, :] + sign[None, :] * q_half * sin[None, :]).to(q.dtype)
        start = tl.load(start_ptr + row)
        slot = tl.load(slot_ptr)
        cache = row * s_cb + group * s_ch
        if split == 0:  # the new column: written into the cache, attended from registers
            k_new = tl.load(k_ptr + row * s_kb + group * s_kh + d)
            v_new = tl.load(v_ptr + row * s_kb + group * s_kh + d)
            if ROPE:
                k_half = tl.load(k_ptr + row * s_kb + group * s_kh + half).to(tl.float32)
                k_new = (k_new.to(tl.float32) * cos + sign * k_half * sin).to(k_new.dtype)
            tl.store(kc_ptr + cache + slot * s_cl + d, k_new)
            tl.store(vc_ptr + cache + slot * s_cl + d, v_new)
            m = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
            m = tl.where(real, m, 0.0)
            total = tl.full([REP_PAD], 1.0, dtype=tl.float32)
            acc = tl.zeros([REP_PAD, D], dtype=tl.float32) + v_new.to(tl.float32)[None, :]
        else:
            m = tl.full([REP_PAD], float("-inf"), dtype=tl.float32)
            total = tl.zeros([REP_PAD], dtype=tl.float32)
            acc = tl.zeros([REP_PAD, D], dtype=tl.float32)
        first = tl.maximum(start, split * chunk)
        last = tl.minimum(slot, (split + 1) * chunk)
        lo = (first // BLOCK) * BLOCK
        for s in range(lo, last, BLOCK):
            n = s + tl.arange(0, BLOCK)
            valid = (n >= first) & (n < last)
            keys = tl.load(kc_ptr + cache + n[:, None] * s_cl + d[None, :], mask=valid[:, None], other=0.0)
            values = tl.load(vc_ptr + cache + n[:, None] * s_cl + d[None, :], mask=valid[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(keys)) * scale  # (REP_PAD, BLOCK), float32
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a split with no column yet
            p = tl.exp(scores - safe[:, None])
            alpha = tl.exp(m - safe)
            total = total * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values)
            m = m_new
        if SPLITS == 1:
            out = acc / total[:, None]
            tl.store(o_ptr + row * s_ob + (group * REP + r)[:, None] * s_oh + d[None, :], out.to(q.dtype),
                     mask=real[:, None])
        else:
            part = ((row * tl.num_programs(1) + group) * SPLITS + split) * REP_PAD + r
            tl.store(pm_ptr + part, m)
            tl.store(pt_ptr + part, total)
            tl.store(pa_ptr + part[:, None] * D + d[None, :], acc)

    @triton.jit
    def combine(pm_ptr, pt_ptr, pa_ptr, o_ptr, s_ob, s_oh, REP: tl.constexpr, REP_PAD: tl.constexpr,
                D: tl.constexpr, SPLITS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1)
        r = tl.arange(0, REP_PAD)
        d = tl.arange(0, D)
        base = (row * tl.num_programs(1) + group) * SPLITS * REP_PAD
        top = tl.full([REP_PAD], float("-inf"), dtype=tl.float32)
        for i in range(SPLITS):
            top = tl.maximum(top, tl.load(pm_ptr + base + i * REP_PAD + r))
        total = tl.zeros([REP_PAD], dtype=tl.float32)
        acc = tl.zeros([REP_PAD, D], dtype=tl.float32)
        for i in range(SPLITS):
            at = base + i * REP_PAD + r
            w = tl.exp(tl.load(pm_ptr + at) - top)  # 0 for a split that saw no column
            total += w * tl.load(pt_ptr + at)
            acc += w[:, None] * tl.load(pa_ptr + at[:, None] * D + d[None, :])
        out = acc / total[:, None]
        tl.store(o_ptr + row * s_ob + (group * REP + r)[:, None] * s_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=(r < REP)[:, None])

    def run(q: Any, k: Any, v: Any, k_cache: Any, v_cache: Any, start: Any, slot: Any, scale: float,
            splits: int | None = None, cos: Any = None, sin: Any = None) -> Any:
        """q (b, heads, d), k and v (b, kv_heads, d), each with unit stride in d and k's strides v's; with
        ``cos``/``sin`` (b, d) the kernel applies the rotary embedding to q and the new k itself."""
        import torch

        b, heads, d = q.shape
        kv_heads, length = k_cache.shape[1], k_cache.shape[2]
        rep = heads // kv_heads
        rep_pad = max(16, triton.next_power_of_2(rep))
        block = 64
        if splits is None:
            splits = attention_splits(b * kv_heads, length, q.device, block) if FUSED_KERNELS else 1
        chunk = -(-length // splits)
        out = torch.empty(b, heads, d, dtype=q.dtype, device=q.device)
        rope = cos is not None
        if not rope:
            cos = sin = out  # not read
        if splits > 1:
            f32 = {"dtype": torch.float32, "device": q.device}
            pm = torch.empty(b * kv_heads * splits * rep_pad, **f32)
            pt = torch.empty_like(pm)
            pa = torch.empty(b * kv_heads * splits * rep_pad * d, **f32)
        else:
            pm = pt = pa = out  # not read
        kernel[(b, kv_heads, splits)](q, k, v, k_cache, v_cache, start, slot, out, pm, pt, pa, cos, sin, scale,
                                      q.stride(0), q.stride(1), k.stride(0), k.stride(1), k_cache.stride(0),
                                      k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1),
                                      cos.stride(0), chunk, REP=rep, REP_PAD=rep_pad, D=d, BLOCK=block,
                                      SPLITS=splits, ROPE=rope, num_warps=4)
        if splits > 1:
            combine[(b, kv_heads)](pm, pt, pa, out, out.stride(0), out.stride(1), REP=rep, REP_PAD=rep_pad, D=d,
                                   SPLITS=splits, num_warps=4)
        return out

    return run


def attention_splits(programs: int, length: int, device: Any, block: int = 64) -> int:
    """How many ranges the decode attention cuts each row's cache into: as many as still fit the (row, head)
    programs in one wave of the multiprocessors (none when the rows alone nearly fill it), each range at least
    2 blocks of columns long, at most 16 ranges. Measured on an H100 (2026-12-07, 0.5b shape, 64 rows x 2
    key/value heads = 128 programs on 132 multiprocessors): three ranges, the earlier rule's two waves, cost
    0.04 ms a decode step against none."""
    import torch

    sms = torch.cuda.get_device_properties(device).multi_processor_count if str(device).startswith("cuda") else 132
    want = sms // max(programs, 1)
    return max(1, min(want, length // (2 * block), 16))


def triton_usable(q: Any, k_cache: Any) -> bool:
    d = q.shape[-1]
    return (q.is_cuda and d in (64, 128, 256) and q.dtype in _half_dtypes() and k_cache.dtype == q.dtype
            and _triton_attention() is not None)


def _half_dtypes() -> tuple[Any, ...]:
    import torch

    return (torch.bfloat16, torch.float16)


@functools.cache
def attention_op() -> Any:
    """``rlx::slot_attention`` (registered once): :func:`attend_reference`'s contract, the Triton kernel on a
    GPU in half precision. An opaque operator to torch.compile, which writes the two caches in place."""
    import torch

    schema = ("(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor start, Tensor slot, "
              "float scale) -> Tensor")  # spelled out: annotations are strings under postponed evaluation

    @torch.library.custom_op("rlx::slot_attention", mutates_args=("k_cache", "v_cache"), schema=schema)
    def slot_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, start: torch.Tensor, slot: torch.Tensor, scale: float) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if triton_usable(q, k_cache):
            return _triton_attention()(q, k, v, k_cache, v_cache, start, slot, scale)
        return attend_reference(q, k, v, k_cache, v_cache, start, slot, scale)

    @slot_attention.register_fake
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          start: torch.Tensor, slot: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.empty_like(q)

    return slot_attention


@functools.cache
def rope_attention_op() -> Any:
    """``rlx::slot_attention_rope``: :func:`attention_op` on the unrotated q, k, v (views of the fused q/k/v
    product, no copy), the rotary embedding (``cos``/``sin``, (b, d)) applied by the Triton kernel itself on a
    GPU in half precision; elsewhere rotated in torch (:func:`_rotate`) and attended by the reference."""
    import torch

    schema = ("(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
              "Tensor start, Tensor slot, float scale) -> Tensor")

    @torch.library.custom_op("rlx::slot_attention_rope", mutates_args=("k_cache", "v_cache"), schema=schema)
    def slot_attention_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor,
                            slot: torch.Tensor, scale: float) -> torch.Tensor:
        if triton_usable(q, k_cache):  # views of the q/k/v product as they come; copies only where the kernel must
            if q.stride(-1) != 1:
                q = q.contiguous()
            if k.stride() != v.stride() or k.stride(-1) != 1:
                k, v = k.contiguous(), v.contiguous()
            return _triton_attention()(q, k, v, k_cache, v_cache, start, slot, scale, cos=cos.contiguous(),
                                       sin=sin.contiguous())
        q, k = _rotate(q, cos[:, None], sin[:, None]), _rotate(k, cos[:, None], sin[:, None])
        return attend_reference(q.contiguous(), k.contiguous(), v.contiguous(), k_cache, v_cache, start, slot,
                                scale)

    @slot_attention_rope.register_fake
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor, slot: torch.Tensor,
          scale: float) -> torch.Tensor:
        return q.new_empty(q.shape)

    return slot_attention_rope


def slot_forward(w: FusedWeights, tok: Any, pos: Any, start: Any, slot: Any, k_caches: list[Any],
                 v_caches: list[Any]) -> Any:
    """Next-token logits (b, V) of one decode step for rows :b (b = len(tok)), the new keys and values
    written at cache column ``slot``; the same arithmetic as transformers' Llama-family layers."""
    import torch

    attention = w.attention
    b = tok.shape[0]
    h = torch.nn.functional.embedding(tok, w.embed)  # (b, H)
    cos, sin = w.rotary(h, pos[:, None])  # (b, 1, d)
    nq, nk, d = w.heads * w.head_dim, w.kv_heads * w.head_dim, w.head_dim
    for i, layer in enumerate(w.layers):
        x = _rms_norm(h, layer["in_w"], layer["in_eps"])
        qkv = w.linear(x, layer["qkv"], layer["qkv_b"])
        if w.scratch is not None:  # this layer's MLP weights into L2 while its attention half runs
            w.prefetch(w.scratch, qkv, [layer["gate_up"], layer["down"]])
        q = qkv[:, :nq].reshape(b, w.heads, d)
        k = qkv[:, nq:nq + nk].reshape(b, w.kv_heads, d)
        v = qkv[:, nq + nk:].reshape(b, w.kv_heads, d)
        if layer["q_norm"] is None and FUSED_KERNELS:  # the rotary embedding inside the attention kernel
            a = w.rope_attention(q, k, v, cos[:, 0], sin[:, 0], k_caches[i], v_caches[i], start, slot, w.scale)
        else:
            if layer["q_norm"] is not None:
                q, k = layer["q_norm"](q), layer["k_norm"](k)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            a = attention(q, k, v, k_caches[i], v_caches[i], start, slot, w.scale)
        h = h + w.linear(a.reshape(b, nq), layer["o"], layer["o_b"])
        x = _rms_norm(h, layer["post_w"], layer["post_eps"])
        gate_up = w.linear(x, layer["gate_up"], layer["gate_up_b"])
        if w.scratch is not None and w.schedule == "mlp+next" and i + 1 < len(w.layers):
            after = w.layers[i + 1]  # the next layer's attention products, while this MLP runs
            w.prefetch(w.scratch, gate_up, [after["qkv"], after["o"]])
        act = layer["act"](gate_up[:, :w.intermediate]) * gate_up[:, w.intermediate:]
        h = h + w.linear(act, layer["down"], layer["down_b"])
    return w.linear(_rms_norm(h, w.norm_w, w.norm_eps), w.head, None)


def slot_prefill(w: FusedWeights, ids: Any, mask: Any, positions: Any, k_caches: list[Any], v_caches: list[Any],
                 lo: int) -> Any:
    """The prompts (rows, P), left-padded, through the fused weights in one pass: each layer's keys and values
    written into cache rows lo:lo+rows, columns :P (zero at padding); returns the last position's logits
    (rows, V). The arithmetic of :func:`slot_forward` (transformers' Llama-family layers), attention by
    ``scaled_dot_product_attention`` with a causal mask over each row's real tokens (a padding query attends
    to itself alone, so no row is all masked)."""
    import torch

    rows, width = ids.shape
    nq, nk, d = w.heads * w.head_dim, w.kv_heads * w.head_dim, w.head_dim
    h = torch.nn.functional.embedding(ids, w.embed)  # (rows, P, H)
    cos, sin = w.rotary(h, positions)  # (rows, P, d)
    cos, sin = cos[:, None], sin[:, None]
    real = mask.bool()
    causal = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril()
    allowed = (causal[None] & real[:, None, :]) | torch.eye(width, dtype=torch.bool, device=ids.device)[None]
    allowed = allowed[:, None]  # (rows, 1, P, P)
    keep = real.to(h.dtype)[:, None, :, None]  # (rows, 1, P, 1)
    for i, layer in enumerate(w.layers):
        x = _rms_norm(h, layer["in_w"], layer["in_eps"])
        qkv = torch.nn.functional.linear(x, layer["qkv"], layer["qkv_b"])
        q = qkv[..., :nq].reshape(rows, width, w.heads, d).transpose(1, 2)
        k = qkv[..., nq:nq + nk].reshape(rows, width, w.kv_heads, d).transpose(1, 2)
        v = qkv[..., nq + nk:].reshape(rows, width, w.kv_heads, d).transpose(1, 2)
        if layer["q_norm"] is not None:
            q, k = layer["q_norm"](q), layer["k_norm"](k)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k_caches[i][lo:lo + rows, :, :width] = k * keep
        v_caches[i][lo:lo + rows, :, :width] = v * keep
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=w.scale,
                                                             enable_gqa=w.heads != w.kv_heads)
        h = h + torch.nn.functional.linear(a.transpose(1, 2).reshape(rows, width, nq), layer["o"], layer["o_b"])
        x = _rms_norm(h, layer["post_w"], layer["post_eps"])
        gate_up = torch.nn.functional.linear(x, layer["gate_up"], layer["gate_up_b"])
        act = layer["act"](gate_up[..., :w.intermediate]) * gate_up[..., w.intermediate:]
        h = h + torch.nn.functional.linear(act, layer["down"], layer["down_b"])
    return torch.nn.functional.linear(_rms_norm(h[:, -1], w.norm_w, w.norm_eps), w.head)


def _fused_kernels_off() -> None:
    global FUSED_KERNELS
    FUSED_KERNELS = False


def buckets(rows: int) -> list[int]:
    """The batch sizes a decode of ``rows`` (a power of two) steps at as rows finish: rows, rows/2, ..., 8."""
    sizes = [rows]
    while sizes[-1] > MIN_BUCKET:
        sizes.append(sizes[-1] // 2)
    return sizes


class SlotDecoder:
    """Decoding for one capacity of rows, prompt width, response length and sampler, with rlx's own step
    (:func:`slot_forward`): fused q/k/v and gate/up weights, a key/value cache of (rows, kv_heads, length, d)
    per layer, attention over each row's own columns, sampling in the step. Rows live in slots: every
    ``check_every`` steps the rows still decoding move to the front and the step runs at the smallest batch
    bucket that holds them (on CUDA one recorded graph per bucket), so finished rows cost nothing."""

    def __init__(self, model: Any, weights: FusedWeights, batch: int, prompt_len: int, max_tokens: int,
                 sampler: Sampler, stop: list[int], use_graph: bool, pool: Any, fused: bool = True) -> None:
        import torch

        from rlx.plugins.rollout import hf_kernels

        self.model, self.w, self.sampler = model, weights, sampler
        self.batch, self.prompt_len, self.max_tokens = batch, prompt_len, max_tokens
        self.length = prompt_len + max_tokens
        device, dtype = model.device, model.dtype
        shape = (batch, weights.kv_heads, self.length, weights.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in weights.layers]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in weights.layers]
        long = {"dtype": torch.long, "device": device}
        self.tok = torch.zeros(batch, **long)  # the token each slot feeds to the next step
        self.pos = torch.zeros(batch, **long)  # its position id
        self.start = torch.zeros(batch, **long)  # the slot's first real cache column
        self.row = torch.arange(batch, **long)  # the output row each slot decodes
        self.slot = torch.zeros(1, **long)  # the cache column the next step writes
        self.column = torch.zeros(1, **long)  # the output column it writes
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.tokens = torch.zeros(batch, max_tokens, **long)  # by output row
        self.log_probs = torch.zeros(batch, max_tokens, dtype=torch.float32, device=device)
        # Sampling fused into one Triton pass over the logits (rlx::race_sample) on a GPU: its noise is drawn in
        # the kernel from a seed redrawn each step, so no (rows, vocabulary) noise buffer is kept.
        self.fused = bool(fused and FUSED_KERNELS and sampler.plain and hf_kernels.race_available(device))
        self.race: Any = hf_kernels.race_op() if self.fused else None  # fetched here: never inside a compiled step
        self.seed = torch.zeros(1, **long)
        self.noise = None if sampler.greedy or self.fused else torch.zeros(batch, model.config.vocab_size,
                                                                           device=device)
        self.stop = torch.tensor(sorted(set(stop)) or [-1], **long)
        self.step_fn: Any = self._choose  # (tok, pos, start, noise) -> (token, log-prob); the engine may compile it
        self.prefill_fn: Any = slot_prefill if OWN_PREFILL else None  # None: the model's own forward
        self.compiled = False
        self.use_graph, self.pool = use_graph, pool
        self.graphs: dict[int, Any] = {}  # bucket -> recorded step (None: a bucket whose recording failed)
        self._retry: set[int] = set()  # buckets whose late recording failed, recorded again at the next rollout
        self.warm = True  # warm-up steps before recording (the engine sets it; see REWARM)
        self.live = batch  # the bucket the rows still decoding occupy

    # -- the step -----------------------------------------------------------------------------------
    def _choose(self, tok: Any, pos: Any, start: Any, noise: Any) -> tuple[Any, Any]:
        import torch

        logits = slot_forward(self.w, tok, pos, start, self.slot, self.k_caches, self.v_caches)
        if self.fused:
            inv_t = 1.0 if self.sampler.greedy else 1.0 / self.sampler.temperature
            return self.race(logits, inv_t, noise, self.sampler.greedy)
        if self.sampler.plain:
            return self.sampler.race(logits, noise)
        log_probs = self.sampler.log_probs(logits)
        if noise is None:
            token = log_probs.argmax(-1)
        else:  # the exponential race of Sampler.choose, its noise drawn outside (an input here)
            race = noise.clamp_min(torch.finfo(torch.float32).tiny)
            token = (log_probs.exp() / race).argmax(-1)
        return token, log_probs.gather(-1, token.unsqueeze(-1)).squeeze(-1)

    def step(self, b: int) -> None:
        """One decode step of slots :b, entirely on the device (what each bucket's graph records)."""
        import torch

        from rlx.plugins.rollout import hf_prefetch

        noise = None
        if self.fused:  # the kernel's seed, drawn afresh at every replay of a recorded graph
            noise = self.seed
            if not self.sampler.greedy:
                noise.random_(0, 2**31 - 1)
        elif self.noise is not None:
            noise = self.noise[:b]
            noise.exponential_()
        tok, pos, start = self.tok[:b], self.pos[:b], self.start[:b]
        if self.compiled:  # one compilation for every bucket
            for t in (tok, pos, start) + ((noise,) if noise is not None and not self.fused else ()):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        token, log_prob = self.step_fn(tok, pos, start, noise)
        hf_prefetch.join()  # the side stream of the L2 prefetch, if it ran, back into this one
        rows = self.row[:b]
        columns = self.column.expand(b)
        self.tokens.index_put_((rows, columns), token)
        self.log_probs.index_put_((rows, columns), log_prob)
        self.done[:b] |= (token.unsqueeze(-1) == self.stop).any(-1)
        tok.copy_(token)
        pos.add_(1)
        self.slot.add_(1)
        self.column.add_(1)

    # -- prefill, compaction, recording -------------------------------------------------------------
    def prefill(self, ids: Any, mask: Any, real_rows: int) -> None:
        """The prompts (rows, P) through the model's own forward (or :func:`slot_prefill`), a few rows at a time;
        their keys and values copied into the cache (zero at padding), the first token drawn. A prompt that
        several rows repeat is run once (``SHARE_PREFILL``). Rows from ``real_rows`` on are fillers: done from
        the start."""
        import torch
        from transformers import DynamicCache

        rows, width = ids.shape
        positions = prompt_positions(mask)
        shared = distinct_prompts(ids, mask) if SHARE_PREFILL else None
        if shared is not None and shared[0].shape[0] == rows:
            shared = None  # every row's prompt is its own
        p_ids, p_mask, p_pos = ids, mask, positions
        if shared is not None:  # cache rows :n hold the n distinct prompts until the copy below
            p_ids, p_mask, p_pos = ids[shared[0]], mask[shared[0]], positions[shared[0]]
        n = p_ids.shape[0]
        chunk = max(1, 65536 // max(width, 1))
        kw = cache_argument(self.model)
        keep = p_mask.to(self.k_caches[0].dtype)[:, None, :, None]  # (n, 1, P, 1)
        first = []
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            if self.prefill_fn is not None:  # rlx's own pass: the keys and values straight into the cache
                with torch.no_grad():
                    first.append(self.prefill_fn(self.w, p_ids[lo:hi], p_mask[lo:hi], p_pos[lo:hi], self.k_caches,
                                                 self.v_caches, lo))
                continue
            cache = DynamicCache(config=self.model.config)
            out = self.model(input_ids=p_ids[lo:hi], attention_mask=p_mask[lo:hi], position_ids=p_pos[lo:hi],
                             use_cache=True, logits_to_keep=1, **{kw: cache})
            for i, (k_cache, v_cache) in enumerate(zip(self.k_caches, self.v_caches, strict=True)):
                keys, values = _layer_kv(cache, i)
                k_cache[lo:hi, :, :width] = keys * keep[lo:hi]
                v_cache[lo:hi, :, :width] = values * keep[lo:hi]
            first.append(out.logits[:, -1])
            del cache, out
        logits = torch.cat(first)
        if shared is not None:  # each row's prompt from its distinct one (gathered first: rows :n are sources)
            source = shared[1]
            for cache_ in (*self.k_caches, *self.v_caches):
                cache_[:rows, :, :width] = cache_[source, :, :width]
            logits = logits[source]
        for k_cache, v_cache in zip(self.k_caches, self.v_caches, strict=True):  # stale columns of a last call
            k_cache[:, :, width:].zero_()
            v_cache[:, :, width:].zero_()
        token, log_prob = self.sampler.step(logits)
        self.row.copy_(torch.arange(rows, device=ids.device))
        self.tokens.zero_()
        self.log_probs.zero_()
        self.tokens[:, 0], self.log_probs[:, 0] = token, log_prob
        self.done.copy_((token.unsqueeze(-1) == self.stop).any(-1))
        self.done[real_rows:] = True
        self.tok.copy_(token)
        self.pos.copy_(positions[:, -1] + 1)
        self.start.copy_(width - mask.long().sum(-1))
        self.slot.fill_(width)
        self.column.fill_(1)
        self.live = rows

    def compact(self, live: Any, written: int) -> None:
        """Move the slots still decoding (``live``, sorted, on the device) to the front and shrink the active
        bucket to the smallest that holds them; the finished slots fill the rest of it. ``written``: the
        cache columns in use."""
        import torch

        b = self.live
        n = int(live.numel())
        new = next(s for s in reversed(buckets(self.batch)) if s >= n)
        if new >= b:
            return
        finished = torch.ones(b, dtype=torch.bool, device=live.device)
        finished[live] = False
        order = torch.cat([live, finished.nonzero().squeeze(-1)])[:new]
        for cache in (*self.k_caches, *self.v_caches):
            cache[:new, :, :written] = cache[order, :, :written]
        for t in (self.tok, self.pos, self.start, self.row, self.done):
            t[:new] = t[order]
        self.live = new

    def capture(self, warmup: int = 2, sizes: list[int] | None = None) -> None:
        """Record one step per bucket (``sizes``: these only), each after warm-up steps on a side stream
        (compilation and library workspaces happen there). The warm-up steps run on whatever the slots hold
        (zeros in a new decoder: every index in range, no NaN from the zero cache); the prefill that follows
        resets every slot, output and the cache columns the warm-ups wrote, so no prefill is spent on the
        recording (with ``rollout.free_on_sleep=discard`` the graphs are recorded again at every rollout).
        Without warm-up steps nothing runs: a recording then leaves every slot as it is, so a decode can record
        a bucket when it first needs it."""
        import torch

        for b in sizes or buckets(self.batch):
            if warmup:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(warmup):
                        self.slot.fill_(self.prompt_len)  # every step within the cache and the output columns
                        self.column.fill_(1)
                        self.step(b)
                    self.slot.fill_(self.prompt_len)
                    self.column.fill_(1)
                torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.step(b)
            self.graphs[b] = graph

    def _record(self) -> None:
        """:meth:`capture` before the prefill. A shape recorded before (``warm`` False) records its full bucket
        without warm-up steps, and each smaller one when the decode first reaches it (:meth:`_late_graph`: a
        decode whose rows all run to the end records one graph, not one per bucket); if that first recording
        fails, every bucket is recorded with warm-ups."""
        if self._retry:  # buckets whose late recording failed: once more, with warm-ups, before this prefill
            failed, self._retry = sorted(self._retry, reverse=True), set()
            for b in failed:
                if self._capture_error(2, b) is not None:
                    self.graphs[b] = None  # for good: this bucket steps unrecorded
            return
        if self.warm:
            self.capture()
        elif self._capture_error(0, self.batch) is not None:
            self.graphs.clear()
            self.capture()

    def _capture_error(self, warmup: int, b: int) -> Exception | None:
        """:meth:`capture` of bucket ``b``; what made it fail, or None (a GPU out of memory is raised)."""
        import torch

        try:
            self.capture(warmup=warmup, sizes=[b])
        except Exception as exc:
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                raise
            return exc
        return None

    def _late_graph(self, b: int) -> Any:
        """Bucket ``b``'s graph, recorded now (no warm-up steps: its shape was recorded before), or None when
        that fails: the bucket then steps unrecorded for this rollout, and is recorded again with warm-ups
        before the next prefill (:meth:`_record`)."""
        from torch.profiler import record_function

        with record_function("rlx.hf.capture"):
            exc = self._capture_error(0, b)
        if exc is not None:
            warnings.warn(f"recording the decode step of {b} rows without warm-up failed ({type(exc).__name__}: "
                          f"{exc}); these rows step unrecorded until the next rollout records them with warm-ups",
                          stacklevel=2)
            self.graphs[b] = None
            self._retry.add(b)
        return self.graphs[b]

    def generate(self, ids: Any, mask: Any, real_rows: int, check_every: int = 16,
                 interrupt: Any = None) -> tuple[Any, Any]:
        """(rows, R) raw tokens and their log-probs by output row; R < max_tokens only when every real row
        has stopped, or when ``interrupt`` was set (both looked at every ``check_every`` steps, when the rows
        still decoding are also compacted)."""
        from torch.profiler import record_function  # named ranges in a profile; next to nothing without one

        if self.max_tokens > 1 and self.use_graph and (not self.graphs or self._retry):
            with record_function("rlx.hf.capture"):
                self._record()
        with record_function("rlx.hf.prefill"):
            self.prefill(ids, mask, real_rows)
        width = 1
        if self.max_tokens > 1 and not bool(self.done.all()):
            with record_function("rlx.hf.decode"):
                width = self._decode(check_every, interrupt)
        return self.tokens[:, :width].clone(), self.log_probs[:, :width].clone()

    def _decode(self, check_every: int, interrupt: Any) -> int:
        """The steps after the prefill's token; the output columns written."""
        for column in range(1, self.max_tokens):
            graph = self.graphs.get(self.live, False) if self.graphs else None
            if graph is False:  # a bucket not recorded yet (after a discard, see _record)
                graph = self._late_graph(self.live)
            if graph is not None:
                graph.replay()
            else:
                self.step(self.live)
            if (column + 1) % check_every == 0 and column + 1 < self.max_tokens:
                live = (~self.done[:self.live]).nonzero().squeeze(-1)  # a host synchronisation
                if live.numel() == 0 or (interrupt is not None and interrupt.is_set()):
                    return column + 1
                self.compact(live, self.prompt_len + column + 1)
        return self.max_tokens


def _layer_kv(cache: Any, i: int) -> tuple[Any, Any]:
    """Layer ``i``'s (b, kv_heads, P, d) keys and values from a transformers cache (5.x layers, or the old
    key_cache/value_cache lists)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[i].keys, layers[i].values
    return cache.key_cache[i], cache.value_cache[i]


class StaticEngine:
    """The static decoders of one model, by shape; the least recently used is dropped beyond ``max_shapes``."""

    def __init__(self, model: Any, pad_token_id: int, use_graph: bool, compile_mode: CompileMode,
                 prompt_bucket: int = 64, max_shapes: int = 4) -> None:
        self.model, self.pad_token_id = model, pad_token_id
        self.use_graph, self.compile_mode = use_graph, compile_mode
        self.prompt_bucket, self.max_shapes = prompt_bucket, max_shapes
        self.decoders: OrderedDict[tuple[Any, ...], StaticDecoder | SlotDecoder] = OrderedDict()
        self.slots = supports_slots(model) is None  # rlx's own step; else transformers' model code, one token a row
        if not self.slots and getattr(model.config, "_attn_implementation", None) == "sdpa":
            use_decode_attention(model)
        self.weights: FusedWeights | None = None
        self.pool: Any = None
        self.compile_failed = False
        self.fused_kernels = True  # round 3's kernels in this engine's slot decoders (off after a failure)
        self.recorded: set[tuple[Any, ...]] = set()  # decoder shapes whose graphs were recorded (see REWARM)

    def clear(self) -> None:
        """Forget every cache and graph (the graphs hold the weights' addresses, which a move changes)."""
        self.decoders.clear()
        self.weights = None
        self.pool = None

    def _step_fn(self, decoder: StaticDecoder | SlotDecoder) -> Any:
        if self.compile_mode == "off" or self.compile_failed:
            return None
        import torch

        mode = "max-autotune-no-cudagraphs" if self.compile_mode == "max-autotune" else None
        if isinstance(decoder, SlotDecoder):  # the batch dimension symbolic: one compilation for all buckets
            decoder.compiled = True
            if decoder.prefill_fn is not None:
                decoder.prefill_fn = torch.compile(slot_prefill, mode=mode, dynamic=None)
            return torch.compile(decoder._choose, mode=mode, dynamic=None)
        return torch.compile(decoder._log_probs, mode=mode, dynamic=False)

    def _fused_weights(self) -> FusedWeights:
        """The fused weights, fused again (and every recorded graph dropped) when the model's parameters were
        replaced since (a move to another device, a freeing sleep)."""
        if self.weights is None or not self.weights.current(self.model):
            self.decoders.clear()
            self.weights = FusedWeights(self.model)
        return self.weights

    def _decoder(self, batch: int, prompt_len: int, max_tokens: int, sampler: Sampler,
                 stop: list[int]) -> StaticDecoder | SlotDecoder:
        import torch

        weights = self._fused_weights() if self.slots else None
        key = (batch, prompt_len, max_tokens, sampler, tuple(sorted(set(stop))))
        if key in self.decoders:
            self.decoders.move_to_end(key)
            return self.decoders[key]
        while len(self.decoders) >= self.max_shapes:
            self.decoders.popitem(last=False)
        if self.use_graph and self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        decoder: StaticDecoder | SlotDecoder
        if weights is not None:
            decoder = SlotDecoder(self.model, weights, batch, prompt_len, max_tokens, sampler, stop, self.use_graph,
                                  self.pool, fused=self.fused_kernels)
        else:
            decoder = StaticDecoder(self.model, batch, prompt_len, max_tokens, sampler, stop, self.use_graph,
                                    self.pool)
        step_fn = self._step_fn(decoder)
        if step_fn is None and isinstance(decoder, SlotDecoder):
            decoder.compiled = False
        decoder.step_fn = step_fn or decoder.step_fn
        if isinstance(decoder, SlotDecoder):
            decoder.warm = REWARM or key not in self.recorded
            self.recorded.add(key)
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
        while True:
            with torch.profiler.record_function("rlx.hf.setup"):  # fused weights, caches (new after a discard)
                decoder = self._decoder(rows, width, max_tokens, sampler, stop)
            try:
                tokens, log_probs = self._run(decoder, ids, mask, b, interrupt)
                break
            except Exception as exc:  # a kernel's or the compiler's failure must not end the run: fall back
                if isinstance(exc, torch.cuda.OutOfMemoryError):
                    raise
                what = f"{type(exc).__name__}: {exc}"
                kernels = getattr(decoder, "fused", False) or str(self.model.device).startswith("cuda")
                if self.slots and self.fused_kernels and FUSED_KERNELS and kernels:
                    warnings.warn(f"rlx's decode kernels (fused sampling, attention in ranges with the rotary "
                                  f"embedding) failed ({what}); decoding with the earlier kernels.", RuntimeWarning,
                                  stacklevel=2)
                    self.fused_kernels = False
                    _fused_kernels_off()
                elif self.compile_mode != "off" and not self.compile_failed:
                    warnings.warn(f"torch.compile of the decode step failed ({what}); decoding without "
                                  "compilation.", RuntimeWarning, stacklevel=2)
                    self.compile_failed = True
                else:
                    raise
                self.clear()
                self.recorded.clear()  # another step function: its first recordings warm up again
        return tokens[:b], log_probs[:b]

    @staticmethod
    def _run(decoder: StaticDecoder | SlotDecoder, ids: torch.Tensor, mask: torch.Tensor, real_rows: int,
             interrupt: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(decoder, SlotDecoder):
            return decoder.generate(ids, mask, real_rows, interrupt=interrupt)
        return decoder.generate(ids, mask, interrupt=interrupt)
