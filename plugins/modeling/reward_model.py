"""A sequence-classification reward model scoring conversations: the ``reward_model`` reward's scorer, and the
evaluator of ``rlx rm`` (both read a conversation the same way, so the scores PPO sees are the ones it learned).
"""

from __future__ import annotations

import math
import os
import threading
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlx.errors import UserError
from rlx.protocols import RewardBatch, RewardOutput
from rlx.run.models import check_model_folder

if TYPE_CHECKING:
    pass


_SENTINEL = "\x00rlx-prompt\x00"


class RewardModelOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(description="Local folder or hub id of the reward model (sequence classification, "
                                  "num_labels=1).")
    batch_size: int = Field(8, gt=0, description="Conversations per forward pass.")
    max_length: int = Field(2048, gt=0, description="Tokens per conversation; longer ones lose their start.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the reward model runs (auto: cuda "
                                                                       "when available).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype (auto: float32 on CPU, bfloat16 on GPU).")
    transform: Literal["raw", "sigmoid"] = Field("raw", description="raw: the logit; sigmoid: 1/(1+exp(-logit)).")
    scale: float = Field(1.0, description="Multiplies the transformed logit.")
    shift: float = Field(0.0, description="Added after scaling.")
    chat_template: str | None = Field(None, description="Jinja chat template for the reward model's tokenizer "
                                                        "(default: its own).")
    trust_remote_code: bool = Field(False, description="Allow custom model code from the hub.")

    @field_validator("path")
    @classmethod
    def _local_path_exists(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("give the reward model's folder or hub id, e.g. reward.path=~/models/my-rm")
        expanded = os.path.expanduser(v)
        looks_local = v.startswith(("/", "./", "../", "~")) or os.sep + os.sep in v
        if looks_local and not os.path.exists(expanded):
            raise ValueError(f"no such folder: {v!r}")
        if os.path.isfile(expanded):
            raise ValueError(f"{v!r} is a file; give the model's folder")
        return expanded if os.path.exists(expanded) else v


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


class PromptUnwrapper:
    """Recovers the user's message from a prompt formatted with the policy's chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.prefix = self.suffix = None
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            return
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}],
                                                 add_generation_prompt=True, tokenize=False)
        except Exception:
            return
        if isinstance(text, str) and text.count(_SENTINEL) == 1:
            self.prefix, self.suffix = text.split(_SENTINEL)

    def __call__(self, prompt: str) -> str:
        p, s = self.prefix, self.suffix
        if p is not None and s is not None and len(prompt) >= len(p) + len(s) \
                and prompt.startswith(p) and prompt.endswith(s):
            return prompt[len(p):len(prompt) - len(s)]
        return prompt


class RewardModelScorer:
    """Holds the reward model and its tokenizer; called with a RewardBatch, returns scores."""

    def __init__(self, opts: RewardModelOptions, policy_tokenizer: Any = None) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.opts = opts
        device = opts.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif device == "cuda" and not torch.cuda.is_available():
            raise UserError("reward.device=cuda but no CUDA device is available.", "Use reward.device=cpu or auto.")
        self.device = device
        dtype = opts.dtype if opts.dtype != "auto" else ("float32" if device == "cpu" else "bfloat16")
        check_model_folder(opts.path, opts.trust_remote_code, key="reward.path")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(opts.path, trust_remote_code=opts.trust_remote_code)
            model, info = AutoModelForSequenceClassification.from_pretrained(
                opts.path, dtype=getattr(torch, dtype), trust_remote_code=opts.trust_remote_code,
                output_loading_info=True)
        except (OSError, ValueError) as exc:
            raise UserError(f"Cannot load a reward model from {opts.path!r}: {exc}",
                            "reward.path must be a sequence-classification model folder (or a hub id available "
                            "offline).") from None
        missing = [k for k in info.get("missing_keys", []) if k.split(".")[0] in ("score", "classifier")]
        if missing:
            raise UserError(f"The model at {opts.path!r} has no trained reward head ({', '.join(sorted(missing))} "
                            "missing from its weights): it is not a reward model.",
                            "Give a sequence-classification reward model (e.g. one trained with TRL's RewardTrainer).")
        if model.config.num_labels != 1:
            raise UserError(f"The reward model at {opts.path!r} has {model.config.num_labels} outputs; a reward "
                            "model has one (num_labels=1).")
        if opts.chat_template is not None:
            self.tokenizer.chat_template = opts.chat_template
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.truncation_side = "left"  # keep the end of the response
        self.tokenizer.padding_side = "right"
        if model.config.pad_token_id is None:  # the model finds the last token by the pad id
            model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model = model.to(device).eval()
        self.model.requires_grad_(False)
        self.unwrap = PromptUnwrapper(policy_tokenizer)
        self.lock = threading.Lock()

    def conversation(self, prompt: str, response: str) -> str:
        question = self.unwrap(prompt)
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": question}, {"role": "assistant", "content": response}], tokenize=False)
        return f"{question}\n{response}"

    def logits(self, texts: list[str]) -> list[float]:
        import torch

        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = [0.0] * len(texts)
        with self.lock, torch.no_grad():
            for start in range(0, len(order), self.opts.batch_size):
                idx = order[start:start + self.opts.batch_size]
                enc = self.tokenizer([texts[i] for i in idx], padding=True, truncation=True,
                                     max_length=self.opts.max_length, add_special_tokens=False, return_tensors="pt")
                logits = self.model(input_ids=enc["input_ids"].to(self.device),
                                    attention_mask=enc["attention_mask"].to(self.device)).logits
                for i, value in zip(idx, logits[:, 0].float().cpu().tolist()):
                    out[i] = value
        return out

    def transform(self, logit: float) -> float:
        o = self.opts
        return o.scale * (_sigmoid(logit) if o.transform == "sigmoid" else logit) + o.shift

    def __call__(self, batch: RewardBatch) -> RewardOutput:
        prompts = batch.prompts if len(batch.prompts) == len(batch) else [""] * len(batch)
        texts = [self.conversation(p, r) for p, r in zip(prompts, batch.responses)]
        raw = self.logits(texts)
        return RewardOutput([self.transform(x) for x in raw], {"reward_model/logit": raw})
