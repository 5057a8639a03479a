"""The ``hf`` rollout engine: batched sampling with Hugging Face ``generate``.

It holds its own copy of the policy, as vLLM or SGLang would, and takes new weights through
:meth:`HFRollout.update_weights`. Log-probs are those of the sampling distribution (after
temperature, top-k and top-p), so they can be compared with the actor's own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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
    micro_batch_size: int = Field(64, gt=0, le=2**20, description="Sequences per generate call.")
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="Attention kernel.")


class HFRollout:
    def __init__(self, model_path: str, options: HFRolloutOptions, device: str, eos_token_ids: list[int],
                 pad_token_id: int, trust_remote_code: bool = False) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from rlx.config import resolve_dtype
        from rlx.plugins.backends.torch_local import pick_device

        self.device = pick_device(device)
        name = resolve_dtype(options.dtype, self.device)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, name), trust_remote_code=trust_remote_code,
            attn_implementation=options.attn_implementation,
        ).to(self.device).eval()
        self.model.requires_grad_(False)
        # Sample exactly as SamplingParams say: a model folder's generation_config.json may carry
        # sampling defaults (repetition_penalty, top_k, ...) that generate() would apply on top of
        # ours, so the responses would not come from the policy the actor trains.
        from transformers import GenerationConfig

        self.model.generation_config = GenerationConfig(
            bos_token_id=self.model.generation_config.bos_token_id, eos_token_id=eos_token_ids,
            pad_token_id=pad_token_id)
        self.options = options
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        self.weight_version = 0

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        from rlx.batch import concat_rollouts

        rows = prompts.repeat_interleave(params.n)
        chunks = [self._generate(mb, params) for mb in rows.split(self.options.micro_batch_size)]
        out = concat_rollouts(chunks, self.pad_token_id)
        out.meta["temperature"] = 1.0 if params.greedy else params.temperature
        out.meta["pad_token_id"] = self.pad_token_id  # to pad other ranks' rollouts to one width
        return out

    def _generate(self, batch: Batch, params: SamplingParams) -> Batch:
        import torch

        from rlx.batch import Batch

        input_ids = batch["input_ids"].to(self.device)  # (b, P), left-padded
        attention_mask = batch["attention_mask"].to(self.device)
        sample = not params.greedy and params.temperature > 0
        kwargs: dict[str, Any] = {"do_sample": sample}
        if sample:
            kwargs.update(temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k if params.top_k > 0 else 0)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        stop = list(dict.fromkeys([*self.eos_token_ids, *params.stop_token_ids]))
        with torch.no_grad():
            out = self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=params.max_tokens,
                eos_token_id=stop, pad_token_id=self.pad_token_id, output_scores=True,
                return_dict_in_generate=True, **kwargs,
            )
        responses = out.sequences[:, input_ids.shape[1]:]  # (b, R)
        # scores are the processed logits each token was sampled from: (R,) x (b, V)
        scores = torch.stack(out.scores, dim=1).float()
        log_probs = torch.log_softmax(scores, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
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
        return Batch(tensors, dict(batch.non_tensors))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        import torch

        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        missing = set(params)
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name in params:
                    params[name].copy_(tensor.to(params[name].device, params[name].dtype))
                    missing.discard(name)
        # Tied weights appear under one name only; buffers (rotary tables) are not trained.
        missing -= {n for n, _ in self.model.named_buffers()}
        tied = {n for n, p in self.model.named_parameters(remove_duplicate=False)} - set(
            dict(self.model.named_parameters()))
        if missing - tied:
            raise RuntimeError(f"update_weights did not receive: {sorted(missing - tied)[:5]}")
        self.weight_version += 1

    def sleep(self) -> None:
        """Nothing to free on the CPU; on a GPU the weights move to host memory."""
        if self.device != "cpu":
            import torch

            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        if self.device != "cpu":
            self.model.to(self.device)

    def close(self) -> None:
        self.model = None


def build(options: HFRolloutOptions | None, ctx: BuildContext) -> HFRollout:
    from rlx.data import resolve_path

    cfg = ctx.config
    assert cfg is not None and ctx.tokenizer is not None
    tok = ctx.tokenizer
    eos = tok.eos_token_id
    return HFRollout(resolve_path(cfg.model.path), options or HFRolloutOptions(), cfg.trainer.device,
                     [eos] if isinstance(eos, int) else list(eos), tok.pad_token_id,
                     cfg.model.trust_remote_code)


@hookimpl
def rlx_rollout_engines() -> list[Component]:
    return [Component(kind="rollout", name="hf", factory=build, config_model=HFRolloutOptions,
                      summary="Hugging Face generate: batched sampling, no extra dependency.")]
