"""The ``hf`` rollout engine: batched sampling with a Hugging Face model's own forward pass.

It holds its own copy of the policy, as vLLM or SGLang would, and takes new weights through
:meth:`HFRollout.update_weights`. Log-probs are those of the sampling distribution (after
temperature, top-k and top-p), so they can be compared with the actor's own; each is taken at its
step, so no full-vocabulary scores are kept.

On a GPU the engine decodes with a static KV cache and the decode step recorded in a CUDA graph
(``hf_static``: for Llama-family models rlx's own step, with fused weights, per-row attention and finished
rows leaving the batch); elsewhere, or with ``decoder=dynamic``, it steps the model with its dynamic cache.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlx import Component, hookimpl
from rlx.context import BuildContext
from rlx.protocols import SamplingParams

if TYPE_CHECKING:
    import torch

    from rlx.batch import Batch


class HFRolloutOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype for generation (auto: float32 on CPU, bfloat16 on GPU).")
    micro_batch_size: int = Field(
        512, gt=0, le=2**20, description="Sequences per decode loop. On a GPU one loop of 512 rows costs about "
        "what a loop of 64 does (the step is bound by reading the weights), so fewer, fuller loops are faster; the "
        "static path holds a key/value cache of this many rows x (prompt + response) tokens.")
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="Attention kernel.")
    decoder: Literal["auto", "static", "dynamic"] = Field(
        "auto", description="KV cache: static (preallocated; with cuda_graph, one recorded decode step) or dynamic "
        "(grows per step). auto: static on a GPU, dynamic on the CPU.")
    cuda_graph: bool = Field(True, description="On a GPU, replay the static decode step as one CUDA graph.")
    compile: Literal["off", "default", "max-autotune"] = Field(
        "default", description="torch.compile the static decode step before it is recorded (a GPU only): "
        "faster steps for a compilation of tens of seconds per shape; max-autotune also tunes matmul kernels "
        "(minutes).")
    free_on_sleep: bool | Literal["offload", "discard"] = Field(
        False, description="What sleep frees. offload (true means offload too): on a GPU the weights move to host "
        "memory and back at wake-up. discard (on any device): the parameters' memory is freed and, at wake-up, "
        "allocated empty for the actor's weights that the launcher loads next; generating before every parameter "
        "was loaded again is an error. Both drop the static caches and graphs (recorded, and compiled, again at "
        "the next generate). false: sleep keeps everything, and waking up costs nothing.")
    prompt_bucket: int = Field(64, gt=0, le=2**16, description="The static path pads prompts to a multiple of "
                               "this many tokens, so that batches of similar prompts share a cache and a graph.")

    @field_validator("free_on_sleep")
    @classmethod
    def _true_means_offload(cls, value: bool | str) -> bool | str:
        return "offload" if value is True else value


class HFRollout:
    def __init__(self, model_path: str, options: HFRolloutOptions, device: str, eos_token_ids: list[int],
                 pad_token_id: int, trust_remote_code: bool = False,
                 config_overrides: dict[str, Any] | None = None, router_dtype: str = "auto") -> None:
        import torch

        from rlx.config import resolve_dtype
        from rlx.plugins.modeling.model import pick_device
        from rlx.plugins.modeling.moe import apply_router_dtype
        from rlx.plugins.modeling.vision import causal_lm_class
        from rlx.run.models import load_hf_config

        self.device = pick_device(device)
        name = resolve_dtype(options.dtype, self.device)
        config = load_hf_config(model_path, trust_remote_code, config_overrides)
        self.model = causal_lm_class(config).from_pretrained(
            model_path, config=config,
            dtype=getattr(torch, name), trust_remote_code=trust_remote_code,
            attn_implementation=options.attn_implementation,
        ).to(self.device).eval()
        self.model.requires_grad_(False)
        apply_router_dtype(self.model, router_dtype, "the hf rollout engine's model")
        # The decode loops read SamplingParams alone: sampling defaults in a model folder's
        # generation_config.json (repetition_penalty, top_k, ...) never apply, so the responses come from
        # the policy the actor trains.
        self.options = options
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        self.weight_version = 0
        self.static = self._static_engine()
        # free_on_sleep=discard: the shapes of the parameters whose memory sleep freed, and the names of those
        # not loaded again since (as named_parameters names them: a tied weight under its first name only).
        self._discarded: dict[str, torch.Size] = {}
        self._not_loaded: set[str] = set()
        self._freed = False  # between a discarding sleep and the next wake_up

    def _static_engine(self) -> Any:
        import warnings

        from rlx.plugins.rollout.hf_static import StaticEngine, supports_static

        o = self.options
        on_gpu = self.device.startswith("cuda")
        if o.decoder == "dynamic" or (o.decoder == "auto" and not on_gpu):
            return None
        why_not = supports_static(self.model)
        if why_not is not None:
            warnings.warn(f"The hf engine's static decoder does not handle {why_not}: it decodes with a dynamic "
                          "cache instead.", RuntimeWarning, stacklevel=3)
            return None
        graph = o.cuda_graph and on_gpu
        return StaticEngine(self.model, self.pad_token_id, use_graph=graph,
                            compile_mode=o.compile if on_gpu else "off", prompt_bucket=o.prompt_bucket)

    def generate(self, prompts: Batch, params: SamplingParams, *, interrupt: Any = None) -> Batch:
        """``params.n`` responses per prompt. ``interrupt`` (an object with ``is_set()``, e.g. a
        ``threading.Event``; partial rollouts): once it is set, decoding stops where it is and the batch gets a
        ``finished`` column (False for a response that neither stopped nor reached ``max_tokens``; rows of
        micro-batches not started yet are empty and unfinished)."""
        from rlx.batch import concat_rollouts

        if self._not_loaded:
            names = sorted(self._not_loaded)
            raise RuntimeError(
                f"The hf engine freed its weights at sleep (rollout.free_on_sleep=discard) and {len(names)} "
                f"parameter(s) were not loaded again since it woke up ({', '.join(names[:5])}"
                f"{', ...' if len(names) > 5 else ''}): it would sample from uninitialised memory. The launcher "
                "must load the actor's weights (update_weights) after wake_up and before generate.")

        rows = prompts.repeat_interleave(params.n)
        chunks = []
        for mb in rows.split(self.options.micro_batch_size):
            if interrupt is not None and interrupt.is_set():
                chunks.append(self._not_started(mb))
            else:
                chunks.append(self._generate(mb, params, interrupt))
        return concat_rollouts(chunks, self.pad_token_id)

    def _not_started(self, batch: Batch) -> Batch:
        import torch

        from rlx.batch import Batch

        b = len(batch)
        tensors = {"prompts": batch["input_ids"], "prompt_mask": batch["attention_mask"],
                   "responses": torch.full((b, 1), self.pad_token_id, dtype=torch.long),
                   "response_mask": torch.zeros((b, 1), dtype=torch.long),
                   "rollout_log_probs": torch.zeros((b, 1)), "finished": torch.zeros(b, dtype=torch.bool)}
        return Batch(tensors, dict(batch.non_tensors))

    def _generate(self, batch: Batch, params: SamplingParams, interrupt: Any = None) -> Batch:
        import torch

        from rlx.batch import Batch
        from rlx.plugins.modeling import vision
        from rlx.plugins.rollout.hf_sampling import Sampler, decode_dynamic

        input_ids = batch["input_ids"].to(self.device)  # (b, P), left-padded
        attention_mask = batch["attention_mask"].to(self.device)
        sampler = Sampler.from_params(params)
        stop = list(dict.fromkeys([*self.eos_token_ids, *params.stop_token_ids]))
        with torch.no_grad():
            if vision.has_images(batch):  # the images' patches at prefill, multimodal rotary positions
                images = vision.image_tensors(batch, self.device, self.model.dtype)
                positions = vision.rope_positions(self.model, input_ids, attention_mask, images["image_grid_thw"])
                responses, log_probs = decode_dynamic(self.model, input_ids, attention_mask, sampler,
                                                      params.max_tokens, torch.tensor(stop, device=self.device),
                                                      interrupt=interrupt, prefill=images, positions=positions)
            elif self.static is not None:
                responses, log_probs = self.static.generate(input_ids, attention_mask, sampler, params.max_tokens, stop,
                                                            interrupt=interrupt)
            else:
                responses, log_probs = decode_dynamic(self.model, input_ids, attention_mask, sampler,
                                                      params.max_tokens, torch.tensor(stop, device=self.device),
                                                      interrupt=interrupt)
        is_stop = torch.isin(responses, torch.tensor(stop, device=responses.device))
        # A response ends at (and includes) its first stop token.
        ended_before = (is_stop.long().cumsum(-1) - is_stop.long()) > 0
        response_mask = (~ended_before).long()
        responses = responses.masked_fill(ended_before, self.pad_token_id)
        log_probs = log_probs.masked_fill(ended_before, 0.0)
        tensors = {
            "prompts": batch["input_ids"], "prompt_mask": batch["attention_mask"],
            "responses": responses.cpu(), "response_mask": response_mask.cpu(),
            "rollout_log_probs": log_probs.cpu(),
        }
        if interrupt is not None:  # a response is finished when it stopped or used its whole budget
            tensors["finished"] = (is_stop.any(-1) | (response_mask.sum(-1) >= params.max_tokens)).cpu()
        return Batch(tensors, dict(batch.non_tensors))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        import torch

        if self._freed:
            raise RuntimeError("update_weights on a sleeping hf engine that freed its weights "
                               "(rollout.free_on_sleep=discard): wake_up must come first.")
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        missing = set(params)
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name in params:
                    params[name].copy_(tensor.to(params[name].device, params[name].dtype))
                    missing.discard(name)
                    self._not_loaded.discard(name)
        # Tied weights appear under one name only; buffers (rotary tables) are not trained.
        missing -= {n for n, _ in self.model.named_buffers()}
        tied = {n for n, p in self.model.named_parameters(remove_duplicate=False)} - set(
            dict(self.model.named_parameters()))
        if missing - tied:
            raise RuntimeError(f"update_weights did not receive: {sorted(missing - tied)[:5]}")
        self.weight_version += 1

    def sleep(self) -> None:
        """What ``free_on_sleep`` says. offload: on a GPU the weights move to host memory (nothing to free on
        the CPU). discard: every parameter's memory is freed, on any device; buffers (rotary tables) stay, as
        the actor does not send them. Both drop the static caches and graphs (they hold the weights' old
        addresses)."""
        mode = self.options.free_on_sleep
        if mode == "discard":
            import torch

            if self.static is not None:
                self.static.clear()
            for name, p in self.model.named_parameters():  # a tied weight once: its aliases stay the same tensor
                self._discarded.setdefault(name, p.shape)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self._not_loaded = set(self._discarded)
            self._freed = True
            if self.device.startswith("cuda"):
                torch.cuda.empty_cache()
        elif mode == "offload" and self.device != "cpu":
            import torch

            if self.static is not None:
                self.static.clear()
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """offload: the weights come back to the device. discard: each parameter gets empty memory of its
        shape, to be filled by the next :meth:`update_weights`; until every one is, :meth:`generate` refuses."""
        mode = self.options.free_on_sleep
        if mode == "discard":
            import torch

            if self._freed:
                for name, p in self.model.named_parameters():
                    p.data = torch.empty(self._discarded[name], dtype=p.dtype, device=p.device)
                self._freed = False
        elif mode == "offload" and self.device != "cpu":
            self.model.to(self.device)

    def close(self) -> None:
        self.static = None
        self.model = None


def build(options: HFRolloutOptions | None, ctx: BuildContext) -> HFRollout:
    from rlx.run.data import resolve_path

    cfg = ctx.config
    assert cfg is not None and ctx.tokenizer is not None
    tok = ctx.tokenizer
    eos = tok.eos_token_id
    return HFRollout(resolve_path(cfg.model.path), options or HFRolloutOptions(), cfg.trainer.device,
                     [eos] if isinstance(eos, int) else list(eos), tok.pad_token_id,
                     cfg.model.trust_remote_code, dict(cfg.model.override_config), cfg.model.router_dtype)


@hookimpl
def rlx_rollout_engines() -> list[Component]:
    return [Component(kind="rollout", name="hf", factory=build, config_model=HFRolloutOptions,
                      summary="Hugging Face models: static-cache, CUDA-graph decoding on a GPU; no extra dependency.",
                      extra={"interruptible": True})]  # generate(..., interrupt=): partial rollouts
